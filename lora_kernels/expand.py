"""Grouped LoRA expand: y[:, slice cols] (+)= bf(Σ partials) @ Bᵀ per token's adapter (Triton).

An item covers a column chunk (`chunk_tiles` tiles of `block_n` columns) of one row tile.
Chunks of all slices are numbered back to back (slice 0's, then slice 1's, ...), so one launch
covers qkv or gate_up. Two launches over the same tile body:
- work list (ours): a persistent grid of fixed size walks (row tile, column tile) items.
- GridTrim (the paper's): two classes, every slot at row bound 16 for groups of ≤ 16 rows and a
  compact list of ≤ 16 larger groups at bound R (or one class at R, see `gridtrim`).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from lora_kernels.gridtrim import BLOCK_M as GRIDTRIM_BLOCK_M
from lora_kernels.gridtrim import SMALL_ROWS, GridTrimPlan
from lora_kernels.launch import PreparedKernel
from lora_kernels.layout import as_3d
from lora_kernels.metadata import LoRABatchMeta
from lora_kernels.tiles import block_rank, column_chunk, expand_tile, pick_slice, tile_row_mask, worklist_rows
from lora_kernels.worklist import RowTileWorklist, persistent_programs

NUM_WARPS = 4
CHUNK_TILES = 4  # with 256-column tiles: the H200 sweeps' choice (benchmarks/results/2026-11-30-kernels.md)
MAX_SLICES = 3
_NO_UPPER_BOUND = 2**31 - 1


@triton.jit
def _expand_column_tile(
        part_ptr, b0_ptr, b1_ptr, b2_ptr, y_ptr, rows, row_mask, lora, j,
        n0, n1, n2, out0, out1, out2, sbl0, sbl1, sbl2, chunks0, chunks1, rank,
        stride_ps, stride_pc, stride_pm, stride_pr, stride_bn, stride_br, stride_ym, stride_yn,
        N_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
        BLOCK_N: tl.constexpr, CHUNK_N: tl.constexpr, ADD_INPUTS: tl.constexpr):
    """Expand column chunk j (numbered across slices) of one row tile."""
    slice_id, col0 = column_chunk(j, chunks0, chunks1, CHUNK_N)
    expand_tile(part_ptr, pick_slice(slice_id, b0_ptr, b1_ptr, b2_ptr), y_ptr, rows, row_mask,
                lora, slice_id, col0, pick_slice(slice_id, n0, n1, n2),
                pick_slice(slice_id, out0, out1, out2), rank,
                stride_ps, stride_pc, stride_pm, stride_pr,
                pick_slice(slice_id, sbl0, sbl1, sbl2), stride_bn, stride_br, stride_ym, stride_yn,
                N_SPLITS, BLOCK_M, BLOCK_R, BLOCK_N, CHUNK_N, ADD_INPUTS)


# `rank` and `stride_bn` are compile-time constants in the expand kernels. B's rows are `rank`
# elements apart (16 bytes at rank 8); with both as runtime ints Triton can prove neither the rank
# mask constant over a row nor the rows' 16-byte alignment, and loads B two bytes at a time
# (32 scalar loads per thread per tile); as constants it issues 16-byte async copies. A server
# has one LoRA rank and B is contiguous over `[out, rank]`, so this compiles one variant.
@triton.jit
def _expand_worklist_kernel(
        part_ptr, b0_ptr, b1_ptr, b2_ptr, y_ptr,
        tile_lora_ptr, tile_tokens_ptr, num_tiles_ptr,
        n0, n1, n2, out0, out1, out2, sbl0, sbl1, sbl2, chunks0, chunks1, col_chunks, rank: tl.constexpr,
        stride_ps, stride_pc, stride_pm, stride_pr, stride_bn: tl.constexpr, stride_br, stride_ym, stride_yn,
        N_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
        BLOCK_N: tl.constexpr, CHUNK_N: tl.constexpr, ADD_INPUTS: tl.constexpr):
    total = tl.load(num_tiles_ptr) * col_chunks
    item = tl.program_id(0)
    while item < total:
        tile = item // col_chunks
        lora = tl.load(tile_lora_ptr + tile).to(tl.int64)
        rows, row_mask = worklist_rows(tl.load(tile_tokens_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M)))
        _expand_column_tile(part_ptr, b0_ptr, b1_ptr, b2_ptr, y_ptr, rows, row_mask, lora,
                            item % col_chunks, n0, n1, n2, out0, out1, out2, sbl0, sbl1, sbl2,
                            chunks0, chunks1, rank, stride_ps, stride_pc, stride_pm, stride_pr,
                            stride_bn, stride_br, stride_ym, stride_yn,
                            N_SPLITS, BLOCK_M, BLOCK_R, BLOCK_N, CHUNK_N, ADD_INPUTS)
        item += tl.num_programs(0)


@triton.jit
def _expand_grid_kernel(
        part_ptr, b0_ptr, b1_ptr, b2_ptr, y_ptr,
        sorted_idx_ptr, counts_ptr, starts_ptr, lora_ids_ptr,
        slot_list_ptr, min_rows, max_rows,
        n0, n1, n2, out0, out1, out2, sbl0, sbl1, sbl2, chunks0, chunks1, col_chunks, rank: tl.constexpr,
        stride_ps, stride_pc, stride_pm, stride_pr, stride_bn: tl.constexpr, stride_br, stride_ym, stride_yn,
        N_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
        BLOCK_N: tl.constexpr, CHUNK_N: tl.constexpr, ADD_INPUTS: tl.constexpr):
    row0 = (tl.program_id(0) // col_chunks) * BLOCK_M
    slot = tl.load(slot_list_ptr + tl.program_id(2))
    safe_slot = tl.maximum(slot, 0)
    # The slot's three loads are issued together, none waiting on another: `first >= 0` (always
    # true) keeps the third ahead of the branch, which the compiler would otherwise sink it into.
    lora = tl.load(lora_ids_ptr + safe_slot).to(tl.int64)
    n_rows = tl.load(counts_ptr + safe_slot)
    first = tl.load(starts_ptr + safe_slot) + row0
    if (slot >= 0) & (lora >= 0) & (row0 < n_rows) & (n_rows >= min_rows) & (n_rows <= max_rows) \
            & (first >= 0):
        offs, row_mask = tile_row_mask(n_rows - row0, BLOCK_M)
        rows = tl.load(sorted_idx_ptr + first + offs, mask=row_mask, other=0).to(tl.int64)
        _expand_column_tile(part_ptr, b0_ptr, b1_ptr, b2_ptr, y_ptr, rows, row_mask, lora,
                            tl.program_id(0) % col_chunks, n0, n1, n2, out0, out1, out2,
                            sbl0, sbl1, sbl2, chunks0, chunks1, rank,
                            stride_ps, stride_pc, stride_pm, stride_pr,
                            stride_bn, stride_br, stride_ym, stride_yn,
                            N_SPLITS, BLOCK_M, BLOCK_R, BLOCK_N, CHUNK_N, ADD_INPUTS)


def default_block_n(rank: int) -> int:
    """Output columns per tile: 4096 B-tile elements (256 columns up to rank 16), at least 64.

    256 columns (with `CHUNK_TILES` tiles per item) was the fastest tile width of the H200 sweeps
    in benchmarks/results/2026-11-30-kernels.md at rank 8.
    """
    return max(64, 4096 // block_rank(rank))


def check_b(lora_b: Sequence[torch.Tensor], y: torch.Tensor,
            offset_start: int) -> list[torch.Tensor]:
    """Validate 1–3 B slices `[max_loras, (1,) N_s, rank]` (fp16/bf16, one dtype, one rank and
    `[out, rank]` strides) against y's columns; return the slices as 3-D views."""
    b3 = [as_3d(b) for b in lora_b]
    if not 1 <= len(b3) <= MAX_SLICES:
        raise ValueError(f"{len(b3)} LoRA slices: use 1..{MAX_SLICES}")
    if any(b.dtype not in (torch.float16, torch.bfloat16) or b.dtype != b3[0].dtype for b in b3):
        raise ValueError(f"expand needs fp16/bf16 B of one dtype, got {[b.dtype for b in b3]}")
    if any(b.shape[2] != b3[0].shape[2] or b.stride()[1:] != b3[0].stride()[1:] for b in b3):
        raise ValueError("all B slices must share the rank and the [out, rank] strides")
    needed = offset_start + sum(b.shape[1] for b in b3)
    if y.dim() != 2 or offset_start < 0:
        raise ValueError(f"y of shape {tuple(y.shape)} at offset_start={offset_start}: expected [M, N] and an "
                         f"offset ≥ 0")
    if y.shape[1] < needed:
        raise ValueError(f"y has {y.shape[1]} columns, slices need {needed}")
    return b3


def b_kwargs(b3: list[torch.Tensor], y: torch.Tensor, offset_start: int, chunk_n: int) -> dict:
    """Kernel arguments for the B slices (padded to 3) and y: slice widths, output columns,
    adapter strides, and column chunks of `chunk_n` per slice (`col_chunks` in all)."""
    return dict(y_ptr=y, **_b_static(b3, y, offset_start, chunk_n))


def _b_static(b3: list[torch.Tensor], y: torch.Tensor, offset_start: int, chunk_n: int) -> dict:
    """:func:`b_kwargs` without y itself: what holds for every y of the same strides."""
    widths = [b.shape[1] for b in b3]
    outs = [offset_start + sum(widths[:s]) for s in range(len(b3))]
    chunks = [triton.cdiv(n, chunk_n) for n in widths]
    pad = MAX_SLICES - len(b3)
    slices, widths, outs, chunks = b3 + [b3[0]] * pad, widths + [0] * pad, outs + [0] * pad, \
        chunks + [0] * pad
    return dict(
        b0_ptr=slices[0], b1_ptr=slices[1], b2_ptr=slices[2],
        n0=widths[0], n1=widths[1], n2=widths[2], out0=outs[0], out1=outs[1], out2=outs[2],
        sbl0=slices[0].stride(0), sbl1=slices[1].stride(0), sbl2=slices[2].stride(0),
        chunks0=chunks[0], chunks1=chunks[1], col_chunks=sum(chunks),
        stride_bn=b3[0].stride(1), stride_br=b3[0].stride(2),
        stride_ym=y.stride(0), stride_yn=y.stride(1), CHUNK_N=chunk_n,
    )


# What a work-list launch gives per call (the rest is the config's), in this order.
WORKLIST_DYNAMIC = ("part_ptr", "y_ptr", "tile_lora_ptr", "tile_tokens_ptr", "num_tiles_ptr", "stride_ps", "stride_pc",
                    "stride_pm", "stride_pr", "N_SPLITS", "ADD_INPUTS", "BLOCK_M")


@dataclass(frozen=True)
class ExpandConfig(PreparedKernel):
    """A validated expand of 1–3 B slices into outputs of one width, dtype and strides from
    `offset_start`: the kernel arguments that hold for every batch (``args``: the weights, slice
    widths and columns, strides of B and y, tile sizes). A launch adds y, the partials buffer and
    its strides, the metadata and ``add_inputs``."""

    args: dict[str, Any]
    slices: int
    rank: int
    DYNAMIC = WORKLIST_DYNAMIC

    @property
    def kernel(self) -> Any:
        return _expand_worklist_kernel

    def fixed_arguments(self) -> dict[str, Any]:
        return self.args


def expand_config(lora_b: Sequence[torch.Tensor], y: torch.Tensor, offset_start: int = 0,
                  block_n: int | None = None, chunk_tiles: int = CHUNK_TILES, *,
                  num_warps: int = NUM_WARPS) -> ExpandConfig:
    """Validate 1–3 B slices against y (see `check_b`) and compute the launch arguments that do
    not change between batches. An item writes `chunk_tiles` tiles of `block_n` columns (default
    `default_block_n(rank)`), with `num_warps` per program."""
    b3 = check_b(lora_b, y, offset_start)
    rank = b3[0].shape[2]
    block_n = block_n or default_block_n(rank)
    args = dict(**_b_static(b3, y, offset_start, block_n * chunk_tiles), rank=rank, BLOCK_R=block_rank(rank),
                BLOCK_N=block_n, num_warps=num_warps)
    return ExpandConfig(args, len(b3), rank)


def lora_expand(partials: torch.Tensor, lora_b: Sequence[torch.Tensor], y: torch.Tensor,
                meta: LoRABatchMeta, schedule: RowTileWorklist | GridTrimPlan, *,
                offset_start: int = 0, add_inputs: bool = True, block_n: int | None = None,
                chunk_tiles: int = CHUNK_TILES, num_programs: int | None = None) -> None:
    """Apply `y[m, c_s:c_s+N_s] (+)= bf(Σ_split partials[:, s, m]) @ B_s[id_m]ᵀ` in place.

    partials: shrink's `[splits, slices, ≥M, rank]` fp32; lora_b: 1–3 slices, each
    `[max_loras, (1,) N_s, rank]` (fp16/bf16); y: `[M, ≥ offset_start + ΣN_s]`, slices written
    back to back from `offset_start`. Rows of tokens without an adapter are untouched. The
    semantics are `reference.expand_reference`'s. An item writes `chunk_tiles` tiles of `block_n`
    columns (default `default_block_n(rank)`). The metadata and the schedule are checked against y
    first (shapes and dtypes only: `RowTileWorklist.check`, `GridTrimPlan.check`).
    """
    schedule.check(meta, y.shape[0])
    launch_expand(expand_config(lora_b, y, offset_start, block_n, chunk_tiles), partials, y, meta, schedule,
                  add_inputs=add_inputs, num_programs=num_programs)


def launch_expand(config: ExpandConfig, partials: torch.Tensor, y: torch.Tensor, meta: LoRABatchMeta,
                  schedule: RowTileWorklist | GridTrimPlan, *, add_inputs: bool = True,
                  num_programs: int | None = None) -> None:
    """:func:`lora_expand` with a prebuilt `config`, for a y of the width, dtype and strides it was
    built for (the caller's contract: not re-checked, that is what the config saves)."""
    if partials.dim() != 4 or partials.shape[1] != config.slices or partials.shape[2] < y.shape[0] \
            or partials.shape[3] != config.rank or partials.dtype != torch.float32:
        raise ValueError(f"partials {tuple(partials.shape)} {partials.dtype} do not match {config.slices} slices "
                         f"of rank {config.rank} for {y.shape[0]} tokens (float32)")
    ps, pc, pm, pr = partials.stride()
    if isinstance(schedule, RowTileWorklist):
        config.launch((num_programs or persistent_programs(y.device),), partials, y, schedule.tile_lora,
                      schedule.tile_tokens, schedule.num_tiles, ps, pc, pm, pr, partials.shape[0], add_inputs,
                      schedule.block_m)
        return
    common = dict(**config.args, part_ptr=partials, y_ptr=y, stride_ps=ps, stride_pc=pc, stride_pm=pm,
                  stride_pr=pr, N_SPLITS=partials.shape[0], ADD_INPUTS=add_inputs)
    if schedule.num_slots == 0:
        return
    col_chunks = config.args["col_chunks"]
    if schedule.large_slots is None:
        classes = [(schedule.all_slots, schedule.row_bound, 1, _NO_UPPER_BOUND)]
    else:
        classes = [(schedule.all_slots, SMALL_ROWS, 1, SMALL_ROWS),
                   (schedule.large_slots, schedule.row_bound, SMALL_ROWS + 1, _NO_UPPER_BOUND)]
    for slot_list, bound, min_rows, max_rows in classes:
        grid = (triton.cdiv(bound, GRIDTRIM_BLOCK_M) * col_chunks, 1, slot_list.numel())
        _expand_grid_kernel[grid](sorted_idx_ptr=meta.token_indices_sorted,
                                  counts_ptr=meta.num_tokens_per_slot,
                                  starts_ptr=meta.slot_start_loc, lora_ids_ptr=meta.slot_lora_ids,
                                  slot_list_ptr=slot_list, min_rows=min_rows, max_rows=max_rows,
                                  BLOCK_M=GRIDTRIM_BLOCK_M, **common)
