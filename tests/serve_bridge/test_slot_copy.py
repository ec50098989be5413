"""serve_bridge.slot_copy against the layers' own ``reset_lora`` + ``set_lora``, restated from vLLM
0.26.0 (``lora/layers/base_linear.py:153-184``, ``column_parallel_linear.py:302-328``: the slot
benchmark's :class:`StackedLinear`; ``logits_processor.py:121-139``: :class:`Head`), on fresh
random adapters written into random slots."""
from __future__ import annotations

import copy
import random

import pytest
import torch

from benchmarks.serve_bridge.bench_slot_image import StackedLinear
from serve_bridge.slot_copy import SlotWriter

MAX_LORAS, MAX_RANK = 4, 8


class Linear(StackedLinear):
    """A linear LoRA layer of ``outputs`` slices: stacked tuples [slot, 1, rank, in] and [slot, 1, out, rank]."""

    def __init__(self, inputs: int, outputs: list[int]) -> None:
        super().__init__(inputs, outputs, MAX_LORAS, MAX_RANK)


class Head:
    """A layer with single stacked tensors (as vLLM's LM head): written by its own methods."""

    def __init__(self, inputs: int, outputs: int) -> None:
        self.lora_a_stacked = torch.zeros(MAX_LORAS, 1, MAX_RANK, inputs)
        self.lora_b_stacked = torch.zeros(MAX_LORAS, 1, outputs, MAX_RANK)

    def reset_lora(self, index: int) -> None:
        self.lora_a_stacked[index] = 0
        self.lora_b_stacked[index] = 0

    def set_lora(self, index: int, lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
        self.reset_lora(index)
        self.lora_a_stacked[index, 0, :lora_a.shape[0], :lora_a.shape[1]].copy_(lora_a)
        self.lora_b_stacked[index, 0, :lora_b.shape[0], :lora_b.shape[1]].copy_(lora_b)


def layers() -> dict[str, object]:
    return {"qkv": Linear(16, [16, 8, 8]), "o": Linear(16, [16]), "gate_up": Linear(16, [24, 24]),
            "down": Linear(24, [16]), "lm_head": Head(16, 32)}


def random_adapter(rng: random.Random, mods: dict[str, object]) -> dict[str, tuple | None]:
    """Random ranks; some layers without weights, some slices without weights."""
    out: dict[str, tuple | None] = {}
    rank = rng.randint(1, MAX_RANK)
    for name, m in mods.items():
        if rng.random() < 0.2:
            out[name] = None
        elif isinstance(m, Head):
            out[name] = (torch.randn(rank, m.lora_a_stacked.shape[-1]), torch.randn(m.lora_b_stacked.shape[2], rank))
        else:
            a = [torch.randn(rank, t.shape[-1]) if rng.random() > 0.1 else None for t in m.lora_a_stacked]
            b = [torch.randn(t.shape[2], rank) if x is not None else None for t, x in zip(m.lora_b_stacked, a)]
            out[name] = (a, b)
    return out


def state(mods: dict[str, object]) -> list[torch.Tensor]:
    return [t for m in mods.values() for ts in (m.lora_a_stacked, m.lora_b_stacked)
            for t in (ts if isinstance(ts, tuple) else (ts,))]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_writes_equal_the_layers_own_methods(seed: int) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    ours = layers()
    reference = copy.deepcopy(ours)
    writer = SlotWriter(ours)
    assert set(writer.fast) == {"qkv", "o", "gate_up", "down"}
    adapters = [random_adapter(rng, ours) for _ in range(6)]
    images = [writer.image(ad.__getitem__) for ad in adapters]
    for _ in range(20):  # slots overwritten in random order, each adapter's image reused
        slot, k = rng.randrange(MAX_LORAS), rng.randrange(len(adapters))
        writer.write(images[k], slot)
        for name, m in reference.items():
            if adapters[k][name] is None:
                m.reset_lora(slot)
            else:
                m.set_lora(slot, *adapters[k][name])
        for got, want in zip(state(ours), state(reference)):
            assert torch.equal(got, want)


def test_rendering_leaves_the_layers_untouched() -> None:
    mods = layers()
    before = [t.clone() for t in state(mods)]
    stacked = {name: (m.lora_a_stacked, m.lora_b_stacked) for name, m in mods.items()}
    SlotWriter(mods).image(random_adapter(random.Random(0), mods).__getitem__)
    assert all(torch.equal(a, b) for a, b in zip(state(mods), before))
    assert all(m.lora_a_stacked is stacked[n][0] and m.lora_b_stacked is stacked[n][1] for n, m in mods.items())


@pytest.mark.parametrize("built_in_inference_mode", [True, False])
def test_writes_in_and_out_of_inference_mode(built_in_inference_mode: bool) -> None:
    """vLLM first activates adapters under inference mode (warm-up dummy LoRAs); ``vllm serve
    --lora-modules`` activates the next ones outside it: both write the same slot contents."""
    rng = random.Random(3)
    ours = layers()
    reference = copy.deepcopy(ours)
    with torch.inference_mode(built_in_inference_mode):
        writer = SlotWriter(ours)
    adapters = [random_adapter(rng, ours) for _ in range(4)]
    for step, adapter in enumerate(adapters * 2):
        slot = rng.randrange(MAX_LORAS)
        with torch.inference_mode(step % 2 == 0):
            writer.write(writer.image(adapter.__getitem__), slot)
        for name, m in reference.items():
            m.reset_lora(slot) if adapter[name] is None else m.set_lora(slot, *adapter[name])
        assert all(torch.equal(got, want) for got, want in zip(state(ours), state(reference)))
