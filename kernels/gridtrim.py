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

from kernels.metadata import LoRABatchMeta

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


def plan_gridtrim(meta: LoRABatchMeta, num_tokens: int, num_slots: int) -> GridTrimPlan:
    """Plan the launches for the first `num_slots` slots of `meta` (syncs to read group sizes).

    `num_slots` is the number of slots the grid covers, e.g. vLLM's `num_active_loras`.
    """
    counts = meta.num_tokens_per_slot[:num_slots].cpu()
    with_adapter = meta.slot_lora_ids[:num_slots].cpu() >= 0
    sizes = torch.where(with_adapter, counts, 0)
    bound = row_bound(int(sizes.max()) if num_slots else 0, num_tokens)
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
