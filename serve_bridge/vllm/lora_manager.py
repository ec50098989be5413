"""One registry read per step in vLLM 0.26.0's LRU worker LoRA manager (either LoRazor switch).

vLLM's ``LRUCacheWorkerLoRAManager._apply_adapters`` (``lora/worker_manager.py:270-283``; paths
inside the ``vllm`` package) runs once per engine step, from ``set_active_loras``
(``v1/worker/lora_model_runner_mixin.py:48-71``), and calls ``add_adapter`` (:285-320) for every
adapter in the batch. Each call tests membership in ``self.list_adapters()`` (:237-238): a new set
of ``LRUCacheLoRAModelManager.list_adapters()`` (``model_manager.py:1169-1170``),
``dict(self._registered_adapters.cache)``, where ``cache`` is a ``UserDict`` copy of the registry
built key by key in Python (``utils/cache.py:21-33, 80-86``). A batch over 128 adapters thus
copies a 128-entry registry 128 times per step. In the sixth session's full-graph profiles at 128
adapters, that was the largest host cost of a step after waiting for the GPU, in every mode,
stock included (``benchmarks/serve_bridge/BENCH.md``, sixth session).

:func:`apply_adapters` makes the same calls on the adapter manager, in the same order, and reads
the registry once per step, again only after it loaded an adapter (a load can evict another).
For an adapter that is registered and not ``load_inplace``, vLLM's ``add_adapter`` calls
``get_adapter`` (the cache's hit counters) and ``activate_adapter`` (a GPU slot, and the LRU
touch), and so does this. Otherwise it calls vLLM's ``add_adapter`` itself.
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
