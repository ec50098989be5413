"""Grouped LoRA shrink: partials = scale · x @ Aᵀ per token's adapter (needs Triton).

Two launches over the same tile body:
- work list (ours): a persistent grid of fixed size walks (row tile, slice, hidden chunk) items
  of `RowTileWorklist`; nothing depends on the batch on the host.
- GridTrim (the paper's): grid `(cdiv(R, BLOCK_M) · splits, slices, slots)`; tiles past a
  group's end or of a slot without adapter exit at once.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from lora_kernels.gridtrim import BLOCK_M as GRIDTRIM_BLOCK_M
from lora_kernels.gridtrim import GridTrimPlan
from lora_kernels.launch import PreparedKernel
from lora_kernels.layout import K_CHUNK, as_3d, num_splits
from lora_kernels.metadata import LoRABatchMeta
from lora_kernels.tiles import block_rank, pick_slice, shrink_tile, tile_row_mask, worklist_rows
from lora_kernels.worklist import RowTileWorklist, persistent_programs

BLOCK_K = 256
NUM_WARPS = 2  # faster than 4 in every H200 sweep since 2026-11-30 (benchmarks/results/2026-11-30-kernels.md)
NUM_STAGES = 3  # Triton's default on sm_90
MAX_SLICES = 3


@triton.jit
def _shrink_worklist_kernel(
        x_ptr, a0_ptr, a1_ptr, a2_ptr, part_ptr,
        tile_lora_ptr, tile_tokens_ptr, num_tiles_ptr,
        K, rank, scale,
        stride_xm, stride_xk, stride_al, stride_ar, stride_ak,
        stride_ps, stride_pc, stride_pm, stride_pr,
        SLICES: tl.constexpr, N_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, K_CHUNK: tl.constexpr, K_GROUPS: tl.constexpr):
    per_tile = SLICES * N_SPLITS
    total = tl.load(num_tiles_ptr) * per_tile
    item = tl.program_id(0)
    while item < total:
        tile = item // per_tile
        sub = item % per_tile
        slice_id = sub // N_SPLITS
        split = sub % N_SPLITS
        lora = tl.load(tile_lora_ptr + tile).to(tl.int64)
        rows, row_mask = worklist_rows(tl.load(tile_tokens_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M)))
        shrink_tile(x_ptr, pick_slice(slice_id, a0_ptr, a1_ptr, a2_ptr), part_ptr, rows, row_mask,
                    lora, slice_id, split, K, rank, scale,
                    stride_xm, stride_xk, stride_al, stride_ar, stride_ak,
                    stride_ps, stride_pc, stride_pm, stride_pr,
                    BLOCK_M, BLOCK_R, BLOCK_K, K_CHUNK, K_GROUPS)
        item += tl.num_programs(0)


@triton.jit
def _shrink_grid_kernel(
        x_ptr, a0_ptr, a1_ptr, a2_ptr, part_ptr,
        sorted_idx_ptr, counts_ptr, starts_ptr, lora_ids_ptr,
        K, rank, scale,
        stride_xm, stride_xk, stride_al, stride_ar, stride_ak,
        stride_ps, stride_pc, stride_pm, stride_pr,
        N_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, K_CHUNK: tl.constexpr, K_GROUPS: tl.constexpr):
    row0 = (tl.program_id(0) // N_SPLITS) * BLOCK_M
    split = tl.program_id(0) % N_SPLITS
    slice_id = tl.program_id(1)
    slot = tl.program_id(2)
    # The slot's three loads are issued together, none waiting on another: `first >= 0` (always
    # true) keeps the third ahead of the branch, which the compiler would otherwise sink it into.
    lora = tl.load(lora_ids_ptr + slot).to(tl.int64)
    n_rows = tl.load(counts_ptr + slot)
    first = tl.load(starts_ptr + slot) + row0
    if (lora >= 0) & (row0 < n_rows) & (first >= 0):
        offs, row_mask = tile_row_mask(n_rows - row0, BLOCK_M)
        rows = tl.load(sorted_idx_ptr + first + offs, mask=row_mask, other=0).to(tl.int64)
        shrink_tile(x_ptr, pick_slice(slice_id, a0_ptr, a1_ptr, a2_ptr), part_ptr, rows, row_mask,
                    lora, slice_id, split, K, rank, scale,
                    stride_xm, stride_xk, stride_al, stride_ar, stride_ak,
                    stride_ps, stride_pc, stride_pm, stride_pr,
                    BLOCK_M, BLOCK_R, BLOCK_K, K_CHUNK, K_GROUPS)


# What a work-list launch gives per call (the rest is the config's), in this order.
WORKLIST_DYNAMIC = ("x_ptr", "part_ptr", "tile_lora_ptr", "tile_tokens_ptr", "num_tiles_ptr", "scale", "stride_ps",
                    "stride_pc", "stride_pm", "stride_pr", "BLOCK_M")


def check_a(x: torch.Tensor, lora_a: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Validate x `[M, K]` and 1–3 A slices `[max_loras, (1,) rank, K]` of x's dtype (fp16/bf16)
    sharing shape and strides; return the slices as 3-D views."""
    a3 = [as_3d(a) for a in lora_a]
    if not 1 <= len(a3) <= MAX_SLICES:
        raise ValueError(f"{len(a3)} LoRA slices: use 1..{MAX_SLICES}")
    if x.dtype not in (torch.float16, torch.bfloat16) or any(a.dtype != x.dtype for a in a3):
        raise ValueError(f"shrink needs fp16/bf16 x and A of the same dtype, got {x.dtype}, "
                         f"{[a.dtype for a in a3]}")
    if any(a.shape[1:] != a3[0].shape[1:] or a.stride() != a3[0].stride() for a in a3):
        raise ValueError("all A slices must share shape [rank, hidden] and strides")
    if x.dim() != 2 or x.shape[1] != a3[0].shape[2]:
        raise ValueError(f"x of shape {tuple(x.shape)}: expected [M, {a3[0].shape[2]}] (A's hidden size)")
    return a3


def a_kwargs(x: torch.Tensor, a3: list[torch.Tensor]) -> dict:
    """Kernel arguments for x and the A slices (padded to 3 with slice 0)."""
    return dict(x_ptr=x, **_a_static(x, a3))


def _a_static(x: torch.Tensor, a3: list[torch.Tensor]) -> dict:
    """:func:`a_kwargs` without x itself: what holds for every x of the same width and strides."""
    slices = a3 + [a3[0]] * (MAX_SLICES - len(a3))
    return dict(a0_ptr=slices[0], a1_ptr=slices[1], a2_ptr=slices[2],
                K=a3[0].shape[2], rank=a3[0].shape[1],
                stride_xm=x.stride(0), stride_xk=x.stride(1),
                stride_al=a3[0].stride(0), stride_ar=a3[0].stride(1), stride_ak=a3[0].stride(2))


@dataclass(frozen=True)
class ShrinkConfig(PreparedKernel):
    """A validated shrink of 1–3 A slices for inputs of one width, dtype and strides: the kernel
    arguments that hold for every batch (``args``: the weights, widths, strides of x and A, tile
    sizes). A launch adds x, the partials buffer and its strides, the metadata and the scale."""

    args: dict[str, Any]
    slices: int
    rank: int
    splits: int
    DYNAMIC = WORKLIST_DYNAMIC

    @property
    def kernel(self) -> Any:
        return _shrink_worklist_kernel

    def fixed_arguments(self) -> dict[str, Any]:
        return {**self.args, "SLICES": self.slices}


def shrink_config(x: torch.Tensor, lora_a: Sequence[torch.Tensor], k_chunk: int = K_CHUNK, *,
                  block_k: int = BLOCK_K, k_groups: int = 1, num_warps: int = NUM_WARPS,
                  num_stages: int = NUM_STAGES) -> ShrinkConfig:
    """Validate x `[M, K]` against 1–3 A slices `[max_loras, (1,) rank, K]` (see `check_a`) and
    compute the launch arguments that do not change between batches. An item's hidden chunk of
    `k_chunk` is walked in steps of `block_k` (at most `k_chunk`); `k_groups` splits each step into
    that many batched dots (`tiles.shrink_acc`); `num_warps` per program and `num_stages` of
    software pipelining of the hidden loop (shared memory grows with it)."""
    a3 = check_a(x, lora_a)
    rank, hidden = a3[0].shape[1:]
    block_k = min(block_k, k_chunk)
    if k_groups < 1 or k_groups & (k_groups - 1) or block_k < 16 * k_groups:
        raise ValueError(f"k_groups={k_groups}: use a power of two with 16·k_groups ≤ {block_k}")
    args = dict(**_a_static(x, a3), BLOCK_R=block_rank(rank), BLOCK_K=block_k, K_CHUNK=k_chunk,
                N_SPLITS=num_splits(hidden, k_chunk), K_GROUPS=k_groups, num_warps=num_warps,
                num_stages=num_stages)
    return ShrinkConfig(args, len(a3), rank, args["N_SPLITS"])


def lora_shrink(x: torch.Tensor, lora_a: Sequence[torch.Tensor], partials: torch.Tensor,
                meta: LoRABatchMeta, schedule: RowTileWorklist | GridTrimPlan,
                scale: float = 1.0, *, k_chunk: int = K_CHUNK, k_groups: int = 1,
                num_programs: int | None = None) -> None:
    """Write `partials[split, s, m] = scale · x[m, chunk] @ A_s[id_m, :, chunk]ᵀ` (fp32).

    x: `[M, K]`; lora_a: 1–3 slices, each `[max_loras, (1,) rank, K]` of x's dtype (bf16/fp16);
    partials: `[cdiv(K, k_chunk), slices, ≥M, rank]` fp32 (see `layout.partials_buffer`); only
    rows of tokens with an adapter are written. `schedule` picks the launch design;
    `num_programs` sizes the persistent grid (default: `persistent_programs`); `k_groups` as in
    `shrink_config`. The metadata and the schedule are checked against x first (shapes and
    dtypes only: `RowTileWorklist.check`, `GridTrimPlan.check`).
    """
    schedule.check(meta, x.shape[0])
    launch_shrink(shrink_config(x, lora_a, k_chunk, k_groups=k_groups), x, partials, meta, schedule, scale,
                  num_programs=num_programs)


def launch_shrink(config: ShrinkConfig, x: torch.Tensor, partials: torch.Tensor, meta: LoRABatchMeta,
                  schedule: RowTileWorklist | GridTrimPlan, scale: float = 1.0, *,
                  num_programs: int | None = None) -> None:
    """:func:`lora_shrink` with a prebuilt `config`, for an x of the width, dtype and strides it
    was built for (the caller's contract: not re-checked, that is what the config saves)."""
    if partials.dim() != 4 or tuple(partials.shape[:2]) != (config.splits, config.slices) \
            or partials.shape[2] < x.shape[0] or partials.shape[3] != config.rank or partials.dtype != torch.float32:
        raise ValueError(f"partials {tuple(partials.shape)} {partials.dtype}: expected "
                         f"[{config.splits}, {config.slices}, ≥{x.shape[0]}, {config.rank}] float32")
    ps, pc, pm, pr = partials.stride()
    if isinstance(schedule, RowTileWorklist):
        config.launch((num_programs or persistent_programs(x.device),), x, partials, schedule.tile_lora,
                      schedule.tile_tokens, schedule.num_tiles, scale, ps, pc, pm, pr, schedule.block_m)
    elif schedule.num_slots:
        common = dict(**config.args, x_ptr=x, part_ptr=partials, scale=scale,
                      stride_ps=ps, stride_pc=pc, stride_pm=pm, stride_pr=pr)
        grid = (triton.cdiv(schedule.row_bound, GRIDTRIM_BLOCK_M) * config.splits, config.slices,
                schedule.num_slots)
        _shrink_grid_kernel[grid](sorted_idx_ptr=meta.token_indices_sorted,
                                  counts_ptr=meta.num_tokens_per_slot,
                                  starts_ptr=meta.slot_start_loc, lora_ids_ptr=meta.slot_lora_ids,
                                  BLOCK_M=GRIDTRIM_BLOCK_M, **common)
