"""Per-batch LoRA kernel metadata: which tokens go to which adapter slot.

The contract is the one vLLM 0.26's LoRA ops take (``LoRAKernelMeta`` builds it), so a
punica-wrapper subclass can hand its `meta_args(...)` straight to these kernels:

- `token_lora_mapping[M]`: adapter id of each token, -1 = no adapter.
- `token_indices_sorted[M]`: token indices grouped by slot; slot g owns
  `token_indices_sorted[slot_start_loc[g] : slot_start_loc[g] + num_tokens_per_slot[g]]`.
- `num_tokens_per_slot[S]`, `slot_start_loc[S+1]` (exclusive prefix sum, `[0] == 0`).
- `slot_lora_ids[S]`: adapter id (row of the stacked weights) of each slot; -1 marks the slot of
  unmapped tokens or an unused slot. Kernels skip such slots.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoRABatchMeta:
    """Token→slot metadata for one batch (all int32, on the kernels' device)."""

    token_lora_mapping: torch.Tensor
    token_indices_sorted: torch.Tensor
    num_tokens_per_slot: torch.Tensor
    slot_start_loc: torch.Tensor
    slot_lora_ids: torch.Tensor

    @property
    def num_slots(self) -> int:
        """Capacity S of the slot arrays (not the number of slots in use)."""
        return self.slot_lora_ids.numel()

    @classmethod
    def from_vllm_meta_args(cls, args: Sequence[torch.Tensor]) -> LoRABatchMeta:
        """Wrap the first five tensors of vLLM's `LoRAKernelMeta.meta_args(...)` tuple.

        Its order is (token_lora_mapping, token_indices_sorted_by_lora_ids, num_tokens_per_lora,
        lora_token_start_loc, active_lora_ids, no_lora_flag_cpu, num_active_loras). The views share storage
        with vLLM's static buffers, so a CUDA graph captured on them replays new batches.
        """
        mapping, sorted_idx, counts, starts, lora_ids = args[:5]
        return cls(mapping, sorted_idx, counts, starts, lora_ids)


def build_metadata(token_lora_mapping: torch.Tensor, max_loras: int) -> LoRABatchMeta:
    """Build the metadata on the mapping's device without a host sync.

    Slot s holds adapter s-1, so slot 0 collects the unmapped (-1) tokens and `slot_lora_ids`
    is `[-1, 0, 1, ..., max_loras-1]`; slots of adapters absent from the batch have zero
    tokens. Precondition: every id is in [-1, max_loras) (not checked: that would sync).
    """
    device = token_lora_mapping.device
    slot_of_token = token_lora_mapping.to(torch.int64) + 1
    num_slots = max_loras + 1
    counts = torch.zeros(num_slots, dtype=torch.int64, device=device)
    counts.scatter_add_(0, slot_of_token, torch.ones_like(slot_of_token))
    starts = torch.zeros(num_slots + 1, dtype=torch.int64, device=device)
    starts[1:] = torch.cumsum(counts, 0)
    order = torch.sort(slot_of_token, stable=True).indices
    return LoRABatchMeta(
        token_lora_mapping=token_lora_mapping.to(torch.int32),
        token_indices_sorted=order.to(torch.int32),
        num_tokens_per_slot=counts.to(torch.int32),
        slot_start_loc=starts.to(torch.int32),
        slot_lora_ids=torch.arange(-1, max_loras, dtype=torch.int32, device=device),
    )
