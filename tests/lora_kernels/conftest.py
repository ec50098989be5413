"""Shared helpers for the kernels tests: random batches and vLLM-style compacted metadata."""
from __future__ import annotations


import pytest
import torch

from lora_kernels.metadata import LoRABatchMeta


def mapping_from_groups(groups: dict[int, int], generator: torch.Generator) -> torch.Tensor:
    """A shuffled token→adapter mapping with `groups[id]` tokens per id (-1 = no adapter)."""
    ids = torch.cat([torch.full((n,), lora, dtype=torch.int32) for lora, n in groups.items()])
    return ids[torch.randperm(ids.numel(), generator=generator)]


def vllm_style_metadata(mapping: torch.Tensor, max_loras: int) -> tuple[LoRABatchMeta, int]:
    """Metadata laid out as vLLM 0.26's `LoRAKernelMeta.prepare_tensors` does: slots are the
    sorted unique ids (-1 first when present), padded to max_loras + 1 slots with id -1 and
    count 0. Returns the metadata and the number of slots in use (vLLM's num_active_loras)."""
    ids, counts = torch.unique(mapping, sorted=True, return_counts=True)
    slots = max_loras + 1
    lora_ids = torch.full((slots,), -1, dtype=torch.int32)
    lora_ids[: ids.numel()] = ids.to(torch.int32)
    per_slot = torch.zeros(slots, dtype=torch.int32)
    per_slot[: ids.numel()] = counts.to(torch.int32)
    starts = torch.zeros(slots + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(per_slot, 0)
    order = torch.sort(mapping, stable=True).indices.to(torch.int32)
    return LoRABatchMeta(mapping.to(torch.int32), order, per_slot, starts, lora_ids), ids.numel()


@pytest.fixture
def gen() -> torch.Generator:
    """A seeded generator; each test draws fresh random inputs from it."""
    return torch.Generator().manual_seed(1234)
