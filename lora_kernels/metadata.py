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
from dataclasses import dataclass, fields

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

    def check(self, num_tokens: int | None = None) -> None:
        """Raise TypeError/ValueError (naming the field) unless every array is a 1-D int32 tensor on
        one device, with S slot ids and counts, S+1 start offsets and as many sorted indices as
        mapped tokens, and (given ``num_tokens``, the batch's rows) no more tokens than that.
        Shapes, dtypes and devices only: no device sync, values are not read."""
        device = self.slot_lora_ids.device if isinstance(self.slot_lora_ids, torch.Tensor) else None
        for f in fields(self):
            t = getattr(self, f.name)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"LoRABatchMeta.{f.name} must be a tensor, got {type(t).__name__}")
            if t.dtype != torch.int32:
                raise TypeError(f"LoRABatchMeta.{f.name} must be int32 (vLLM's metadata dtype), got {t.dtype}")
            if t.dim() != 1:
                raise ValueError(f"LoRABatchMeta.{f.name} must be 1-D, got shape {tuple(t.shape)}")
            if t.device != device:
                raise ValueError(f"LoRABatchMeta.{f.name} is on {t.device}, slot_lora_ids on {device}")
        slots, tokens = self.num_slots, self.token_lora_mapping.numel()
        if self.num_tokens_per_slot.numel() != slots or self.slot_start_loc.numel() != slots + 1:
            raise ValueError(f"LoRABatchMeta: {slots} slot ids need {slots} counts and {slots + 1} start offsets, "
                             f"got {self.num_tokens_per_slot.numel()} and {self.slot_start_loc.numel()}")
        if self.token_indices_sorted.numel() != tokens:
            raise ValueError(f"LoRABatchMeta.token_indices_sorted has {self.token_indices_sorted.numel()} entries "
                             f"for {tokens} mapped tokens")
        if num_tokens is not None and tokens > num_tokens:
            raise ValueError(f"LoRABatchMeta maps {tokens} tokens but the batch has {num_tokens} rows")

    def vllm_meta_args(self) -> tuple[torch.Tensor, ...]:
        """The five tensors in the order of vLLM's ``meta_args`` tuple, which :meth:`from_vllm_meta_args` reads."""
        return (self.token_lora_mapping, self.token_indices_sorted, self.num_tokens_per_slot, self.slot_start_loc,
                self.slot_lora_ids)

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
    tokens. The metadata owns its tensors (an int32 mapping is copied, not aliased).
    Precondition: every id is in [-1, max_loras) (not checked: that would sync); the mapping's
    dtype and shape and `max_loras` are (TypeError/ValueError).
    """
    if not isinstance(token_lora_mapping, torch.Tensor) or token_lora_mapping.dtype.is_floating_point \
            or token_lora_mapping.dtype.is_complex or token_lora_mapping.dtype == torch.bool:
        raise TypeError(f"build_metadata: token_lora_mapping must be an integer tensor, got "
                        f"{getattr(token_lora_mapping, 'dtype', type(token_lora_mapping).__name__)}")
    if token_lora_mapping.dim() != 1:
        raise ValueError(f"build_metadata: token_lora_mapping must be 1-D, got shape {tuple(token_lora_mapping.shape)}")
    if not isinstance(max_loras, int) or isinstance(max_loras, bool) or max_loras < 0:
        raise ValueError(f"build_metadata: max_loras must be an int ≥ 0, got {max_loras!r}")
    device = token_lora_mapping.device
    slot_of_token = token_lora_mapping.to(torch.int64) + 1
    num_slots = max_loras + 1
    counts = torch.zeros(num_slots, dtype=torch.int64, device=device)
    counts.scatter_add_(0, slot_of_token, torch.ones_like(slot_of_token))
    starts = torch.zeros(num_slots + 1, dtype=torch.int64, device=device)
    starts[1:] = torch.cumsum(counts, 0)
    order = torch.sort(slot_of_token, stable=True).indices
    return LoRABatchMeta(
        token_lora_mapping=token_lora_mapping.to(torch.int32, copy=True),
        token_indices_sorted=order.to(torch.int32),
        num_tokens_per_slot=counts.to(torch.int32),
        slot_start_loc=starts.to(torch.int32),
        slot_lora_ids=torch.arange(-1, max_loras, dtype=torch.int32, device=device),
    )
