"""serve_bridge.vllm.lora_manager.apply_adapters against vLLM's
``LRUCacheWorkerLoRAManager._apply_adapters`` / ``add_adapter`` (0.26.0: ``lora/worker_manager.py:270-320``;
0.33.0: :273-323, the same calls inside ``gpu_sync_allowed()``), restated over a recording adapter
manager: the same calls in the same order, inside the GPU-sync allowance where vLLM has one, with one
registry read per step instead of one per adapter."""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest

from serve_bridge.vllm.lora_manager import apply_adapters


class AdapterManager:
    """Records the calls the worker manager makes; a registry of `capacity` adapters that evicts the
    oldest on a load (``LRUCacheLoRAModelManager``'s ``remove_oldest_adapter``, ``add_adapter``)."""

    def __init__(self, registered: list[int], capacity: int, lora_slots: int) -> None:
        self.registered, self.capacity, self.lora_slots = list(registered), capacity, lora_slots
        self.calls: list[tuple] = []
        self.registry_reads = 0
        self.sync_allowed = False  # inside the worker manager's GPU-sync allowance

    def list_adapters(self) -> dict[int, object]:
        self.registry_reads += 1
        return {i: object() for i in self.registered}

    def __len__(self) -> int:
        return len(self.registered)

    def get_adapter(self, lora_id: int) -> object | None:
        self.calls.append(("get", lora_id, self.sync_allowed))
        return object() if lora_id in self.registered else None

    def activate_adapter(self, lora_id: int) -> bool:
        self.calls.append(("activate", lora_id, self.sync_allowed))
        return True

    def remove_adapter(self, lora_id: int) -> bool:
        self.calls.append(("remove", lora_id))
        if lora_id in self.registered:
            self.registered.remove(lora_id)
        return True

    def remove_oldest_adapter(self) -> bool:
        self.calls.append(("evict", self.registered[0]))
        self.registered.pop(0)
        return True

    def add_adapter(self, lora: SimpleNamespace) -> bool:
        self.calls.append(("add", lora.id, self.sync_allowed))
        self.registered.append(lora.id)
        return True


class WorkerManager:
    """vLLM's LRUCacheWorkerLoRAManager, restated: its _apply_adapters and add_adapter, and the base
    class's list_adapters (a new set of the registry's keys per call)."""

    def __init__(self, manager: AdapterManager, vllm: str) -> None:
        self._adapter_manager, self.vllm = manager, vllm

    @contextlib.contextmanager
    def allowance(self):
        """0.33's ``gpu_sync_allowed()``, recorded on the adapter manager; 0.26 has none."""
        manager, before = self._adapter_manager, self._adapter_manager.sync_allowed
        manager.sync_allowed = self.vllm == "0.33.0"
        try:
            yield
        finally:
            manager.sync_allowed = before

    def lorazor_sync_allowed(self):
        """What lora_manager.install sets: the line's allowance (serve_bridge.vllm.versions)."""
        return self.allowance()

    def list_adapters(self) -> set[int]:
        return set(self._adapter_manager.list_adapters())

    def _load_adapter(self, request: SimpleNamespace) -> SimpleNamespace:
        return SimpleNamespace(id=request.lora_int_id)

    def add_adapter(self, request: SimpleNamespace) -> bool:
        m = self._adapter_manager
        with self.allowance():
            if request.lora_int_id not in self.list_adapters() or request.load_inplace:
                lora = self._load_adapter(request)
                m.remove_adapter(lora.id)
                if len(m) + 1 > m.capacity:
                    m.remove_oldest_adapter()
                loaded = m.add_adapter(lora)
            else:
                loaded = m.get_adapter(request.lora_int_id) is not None
            m.activate_adapter(request.lora_int_id)
        return loaded

    def stock_apply_adapters(self, requests) -> None:
        loras_map = {r.lora_int_id: r for r in requests if r}
        if len(loras_map) > self._adapter_manager.lora_slots:
            raise RuntimeError("too many")
        for lora in loras_map.values():
            self.add_adapter(lora)


def request(lora_id: int, inplace: bool = False) -> SimpleNamespace:
    return SimpleNamespace(lora_int_id=lora_id, load_inplace=inplace)


@pytest.mark.parametrize("vllm", ["0.26.0", "0.33.0"])
@pytest.mark.parametrize("capacity", [64, 12])  # 12: loads evict registered adapters mid-step
def test_same_calls_in_the_same_order_with_one_registry_read_per_step(capacity, vllm):
    steps = [
        [request(i) for i in range(1, 11)],  # all registered
        [request(i) for i in (3, 40, 5, 41, 1)] + [None],  # two new ones, a falsy entry
        [request(7), request(41, inplace=True), request(2)],  # an in-place reload
        [request(i) for i in range(50, 56)] + [request(1)],  # many loads; 1 may be evicted meanwhile
    ]
    stock_m, ours_m = AdapterManager(list(range(1, 11)), capacity, 16), AdapterManager(list(range(1, 11)), capacity, 16)
    stock, ours = WorkerManager(stock_m, vllm), WorkerManager(ours_m, vllm)
    for batch in steps:
        stock.stock_apply_adapters(batch)
        reads_before = ours_m.registry_reads
        apply_adapters(ours, batch)
        loads = sum(1 for c in ours_m.calls if c[0] == "add")
        assert ours_m.calls == stock_m.calls and ours_m.registered == stock_m.registered
        assert all(c[2] == (vllm == "0.33.0") for c in ours_m.calls if c[0] != "remove" and c[0] != "evict")
        assert ours_m.registry_reads - reads_before <= 1 + 2 * loads  # stock: one or more per adapter
        stock_m.calls.clear()
        ours_m.calls.clear()
    assert stock_m.registry_reads > ours_m.registry_reads


def test_more_adapters_than_slots_is_one_clear_error():
    ours = WorkerManager(AdapterManager([], 64, 2), "0.33.0")
    with pytest.raises(RuntimeError, match="3 LoRAs at once, more than the 2 GPU LoRA slots"):
        apply_adapters(ours, [request(1), request(2), request(3)])


class LoRAModel:
    """vLLM's ``LoRAModel`` (``lora/lora_model.py:60``): an id and per-layer weights."""

    def __init__(self, lora_id: int, loras: dict) -> None:
        self.id, self.loras = lora_id, loras


class SlotManager:
    """The state ``LoRAModelManager.activate_adapter`` reads and writes (``lora/model_manager.py:301-340``)."""

    def __init__(self, adapters: dict[int, dict]) -> None:
        from tests.serve_bridge.test_slot_copy import MAX_LORAS, layers

        self.modules = layers()
        self.lora_index_to_id: list[int | None] = [None] * MAX_LORAS
        self._active_adapters: dict[int, None] = {}
        self._registered_adapters = {i: LoRAModel(i, w) for i, w in adapters.items()}

    def _get_lora_layer_weights(self, lora_model: LoRAModel, name: str) -> SimpleNamespace | None:
        w = lora_model.loras[name]
        return SimpleNamespace(lora_a=w[0], lora_b=w[1]) if w is not None else None

    def deactivate(self, lora_id: int) -> None:  # the id leaves _active_adapters; _deactivate_adapter (:342-347)
        self.lora_index_to_id[self.lora_index_to_id.index(lora_id)] = None
        del self._active_adapters[lora_id]


def vllm_activate_adapter(self: SlotManager, lora_id: int) -> bool:
    """vLLM 0.26.0's ``LoRAModelManager.activate_adapter``, restated: the first free slot, then every
    layer's ``set_lora`` (or ``reset_lora`` where the adapter has no weights)."""
    if lora_id in self._active_adapters:
        return False
    if None not in self.lora_index_to_id:
        raise ValueError("No free lora slots")
    slot = self.lora_index_to_id.index(None)
    self._active_adapters[lora_id] = None
    self.lora_index_to_id[slot] = lora_id
    for name, module in self.modules.items():
        weights = self._get_lora_layer_weights(self._registered_adapters[lora_id], name)
        if weights:
            module.set_lora(slot, weights.lora_a, weights.lora_b)
        else:
            module.reset_lora(slot)
    return True


def test_activate_adapter_matches_vllm() -> None:
    """Random activations and deactivations: the same return values, slot bookkeeping, errors and
    slot contents as vLLM's activate_adapter."""
    import random

    import torch

    from serve_bridge.vllm.lora_manager import activate_adapter
    from tests.serve_bridge.test_slot_copy import layers, random_adapter, state

    rng = random.Random(0)
    torch.manual_seed(0)
    adapters = {i: random_adapter(rng, layers()) for i in range(1, 9)}
    ours, ref = SlotManager(adapters), SlotManager(adapters)
    for _ in range(60):
        lora_id = rng.choice(list(adapters))
        if lora_id in ref._active_adapters and rng.random() < 0.5:
            ours.deactivate(lora_id)
            ref.deactivate(lora_id)
            continue
        try:
            want = vllm_activate_adapter(ref, lora_id)
        except ValueError as err:
            with pytest.raises(ValueError, match=str(err)):
                activate_adapter(ours, lora_id)
            continue
        assert activate_adapter(ours, lora_id) == want
        assert ours.lora_index_to_id == ref.lora_index_to_id and ours._active_adapters == ref._active_adapters
        assert all(torch.equal(a, b) for a, b in zip(state(ours.modules), state(ref.modules)))
