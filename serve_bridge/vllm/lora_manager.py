"""One adapter-registry read per step in vLLM's LRU worker LoRA manager (either LoRazor switch).

vLLM's ``_apply_adapters`` copies the whole adapter registry once per adapter of the batch, every
step (at 128 adapters, the largest host cost of a step after waiting for the GPU).
:func:`apply_adapters` makes the same calls on the adapter manager, in the same order, and reads the
registry once per step, again only after it loaded an adapter (docs/vllm_integration.md §6).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def apply_adapters(self: Any, lora_requests: Iterable[Any]) -> None:
    """``LRUCacheWorkerLoRAManager._apply_adapters`` with one registry read per step (module doc)."""
    loras_map = {request.lora_int_id: request for request in lora_requests if request}
    if len(loras_map) > self._adapter_manager.lora_slots:
        raise RuntimeError(f"This step's batch needs {len(loras_map)} LoRAs at once, more than the "
                           f"{self._adapter_manager.lora_slots} GPU LoRA slots (max_loras).")
    registered = self.list_adapters()
    for lora in loras_map.values():
        if lora.lora_int_id in registered and not lora.load_inplace:
            self._adapter_manager.get_adapter(lora.lora_int_id)
            self._adapter_manager.activate_adapter(lora.lora_int_id)
        else:
            self.add_adapter(lora)
            registered = self.list_adapters()


def install() -> None:
    """Make vLLM's LRU worker LoRA manager use :func:`apply_adapters` (idempotent)."""
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager

    LRUCacheWorkerLoRAManager._apply_adapters = apply_adapters
