"""vLLM's worker LoRA manager with cheaper per-step adapter bookkeeping (either LoRazor switch).

- :func:`apply_adapters`: vLLM's ``_apply_adapters`` copies the whole adapter registry once per
  adapter of the batch, every step; this makes the same calls on the adapter manager, in the same
  order, and reads the registry once per step, again only after it loaded an adapter.
- :func:`activate_adapter`: vLLM writes an adapter into a GPU slot with a few small copies per
  layer (hundreds per adapter); this writes the same slot contents with one host-to-device copy
  (``serve_bridge.slot_copy``). It matters where slots turn over often: many adapters, few slots.

docs/vllm_integration.md §6 has the vLLM lines these follow.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any, ContextManager

from serve_bridge.slot_copy import SlotImage, SlotWriter


def apply_adapters(self: Any, lora_requests: Iterable[Any]) -> None:
    """``LRUCacheWorkerLoRAManager._apply_adapters`` with one registry read per step (module doc)."""
    loras_map = {request.lora_int_id: request for request in lora_requests if request}
    if len(loras_map) > self._adapter_manager.lora_slots:
        raise RuntimeError(f"This step's batch needs {len(loras_map)} LoRAs at once, more than the "
                           f"{self._adapter_manager.lora_slots} GPU LoRA slots (max_loras).")
    registered = self.list_adapters()
    for lora in loras_map.values():
        if lora.lora_int_id in registered and not lora.load_inplace:
            with self.lorazor_sync_allowed():  # where vLLM 0.33's add_adapter allows GPU syncs
                self._adapter_manager.get_adapter(lora.lora_int_id)
                self._adapter_manager.activate_adapter(lora.lora_int_id)
        else:
            self.add_adapter(lora)
            registered = self.list_adapters()


def activate_adapter(self: Any, lora_id: int) -> bool:
    """``LoRAModelManager.activate_adapter``: the same bookkeeping (the first free slot, recorded
    once the slot is written, as vLLM 0.33 does), the slot written from the adapter's slot image,
    rendered at its first activation and kept while vLLM keeps the adapter loaded (it doubles the
    adapter's host memory)."""
    if lora_id in self._active_adapters:
        return False
    index = next((i for i, held in enumerate(self.lora_index_to_id) if held is None), None)
    if index is None:
        raise ValueError("No free lora slots")
    lora_model = self._registered_adapters[lora_id]
    state = self.__dict__.get("_lorazor_slots")
    if state is None:
        state = self.__dict__["_lorazor_slots"] = (SlotWriter(self.modules), weakref.WeakKeyDictionary())
    writer, images = state
    image: SlotImage | None = images.get(lora_model)
    if image is None:
        def weights(name: str) -> tuple[Any, Any] | None:
            layer = self._get_lora_layer_weights(lora_model, name)
            return (layer.lora_a, layer.lora_b) if layer else None

        image = images[lora_model] = writer.image(weights)
    writer.write(image, index)
    self._active_adapters[lora_id] = None
    self.lora_index_to_id[index] = lora_model.id
    return True


def install(sync_allowed: Callable[[], ContextManager[Any]]) -> None:
    """Make vLLM's LoRA managers use :func:`apply_adapters` and :func:`activate_adapter`
    (idempotent); ``sync_allowed`` is the vLLM line's GPU-sync allowance
    (``serve_bridge.vllm.versions``)."""
    from vllm.lora.model_manager import LoRAModelManager
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager

    LRUCacheWorkerLoRAManager._apply_adapters = apply_adapters
    LRUCacheWorkerLoRAManager.lorazor_sync_allowed = staticmethod(sync_allowed)
    LoRAModelManager.activate_adapter = activate_adapter
