"""The paper's GridTrim launch plan: row-bound buckets and the two-class expand.

vLLM 0.26's shrink and expand launch `cdiv(M, BLOCK_M)` row tiles for every slot, M being the
padded token count. GridTrim replaces M by a row bound
R, the smallest bucket in {16·2^k < M} ∪ {M} that covers the largest group, so one CUDA graph
per (M, R) bucket replays. Expand is split in two classes: every slot at bound 16 for groups of
≤ 16 rows, and a compact list of ≤ 16 larger groups at bound R. With more than 16 large groups
the expand falls back to one class at bound R.

The plan needs the largest group size on the host, so building it syncs with the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lora_kernels.metadata import LoRABatchMeta

SMALL_ROWS = 16
BLOCK_M = 16  # row tile of the GridTrim launches
MAX_LARGE_SLOTS = 16


def row_bound(max_group_rows: int, num_tokens: int) -> int:
    """Smallest bucket of {16·2^k < num_tokens} ∪ {num_tokens} that is ≥ `max_group_rows`."""
    bucket = SMALL_ROWS
    while bucket < num_tokens:
        if bucket >= max_group_rows:
            return bucket
        bucket *= 2
    return num_tokens


@dataclass(frozen=True)
class GridTrimPlan:
    """Launch plan for one batch.

    `all_slots` is `arange(num_slots)`; `large_slots` (length 16, -1 padded) lists the slots
    with more than 16 rows when the two-class expand applies, else it is None and expand runs
    one class over `all_slots` at `row_bound`.
    """

    num_slots: int
    row_bound: int
    all_slots: torch.Tensor
    large_slots: torch.Tensor | None

    def check(self, meta: LoRABatchMeta, num_tokens: int | None = None) -> None:
        """Raise ValueError/TypeError unless `meta` is well formed (`LoRABatchMeta.check`) and this
        plan's slot lists fit it: at most `meta.num_slots` slots, int32 on its device. No sync."""
        meta.check(num_tokens)
        if self.num_slots > meta.num_slots:
            raise ValueError(f"GridTrimPlan covers {self.num_slots} slots but the metadata has {meta.num_slots}")
        for name in ("all_slots", "large_slots"):
            t = getattr(self, name)
            if t is not None and (t.dtype != torch.int32 or t.device != meta.slot_lora_ids.device):
                raise TypeError(f"GridTrimPlan.{name} must be int32 on {meta.slot_lora_ids.device}, got {t.dtype} "
                                f"on {t.device}")
        if self.all_slots.numel() != self.num_slots:
            raise ValueError(f"GridTrimPlan.all_slots has {self.all_slots.numel()} entries for {self.num_slots} slots")


def plan_gridtrim(meta: LoRABatchMeta, num_tokens: int, num_slots: int) -> GridTrimPlan:
    """Plan the launches for the first `num_slots` slots of `meta` (syncs to read group sizes).

    `num_slots` is the number of slots the grid covers, e.g. vLLM's `num_active_loras`; it must
    cover every slot with adapter tokens, and `num_tokens` every group (ValueError otherwise:
    a launch would skip those rows). The same two reads check both.
    """
    meta.check(num_tokens)
    if not isinstance(num_slots, int) or not 0 <= num_slots <= meta.num_slots:
        raise ValueError(f"plan_gridtrim: num_slots={num_slots!r}, expected 0..{meta.num_slots} (the metadata's slots)")
    all_sizes = torch.where(meta.slot_lora_ids.cpu() >= 0, meta.num_tokens_per_slot.cpu(), 0)
    missed = torch.nonzero(all_sizes[num_slots:]).flatten()
    if missed.numel():
        slot = num_slots + int(missed[0])
        raise ValueError(f"plan_gridtrim: num_slots={num_slots} but slot {slot} of the metadata holds "
                         f"{int(all_sizes[slot])} adapter tokens; cover every used slot (vLLM's num_active_loras)")
    sizes = all_sizes[:num_slots]
    largest = int(sizes.max()) if num_slots else 0
    if largest > num_tokens:
        raise ValueError(f"plan_gridtrim: num_tokens={num_tokens} but a slot holds {largest} tokens")
    bound = row_bound(largest, num_tokens)
    device = meta.slot_lora_ids.device
    all_slots = torch.arange(num_slots, dtype=torch.int32, device=device)
    if bound <= SMALL_ROWS:
        return GridTrimPlan(num_slots, bound, all_slots, None)
    large = torch.nonzero(sizes > SMALL_ROWS).flatten()
    if large.numel() > MAX_LARGE_SLOTS:
        return GridTrimPlan(num_slots, bound, all_slots, None)
    padded = torch.full((MAX_LARGE_SLOTS,), -1, dtype=torch.int32)
    padded[: large.numel()] = large.to(torch.int32)
    return GridTrimPlan(num_slots, bound, all_slots, padded.to(device))
