"""Fused grouped LoRA: shrink and expand of one op in one persistent launch (needs Triton).

The third launch design. A persistent grid of fixed size walks items (row tile, slice, column
chunk) of a `RowTileWorklist`: item i is tile `i // col_chunks`, column chunk `i % col_chunks`,
chunks of all slices numbered back to back as in `expand`. An item loads its tile's record and
token indices once, computes its rows' shrink for its slice over the whole hidden dimension in
registers (fp32, times scale, cast to B's dtype: the rounding the unfused path applies to the
summed partials before its expand), then expands its column chunk into y. So there is no
partials buffer, no split-K and one launch per op instead of two; the price is that the shrink
is recomputed for every column chunk of a tile (A and x re-reads, mostly L2 hits since the items
of one tile are adjacent in the walk), and that it is a serial chain of K / block_k steps.

The chunking (`chunk_width`) depends only on the op's output widths and the config, and is a
compile-time constant: every row tile gets the same `col_chunks` items, so a prefill-heavy batch
gets no more items per tile than a decode one.

Measured on the H200 (2026-11-29, one Llama-3.2-3B layer at rank 8, default config): about
as fast as the two-launch work list at 128 adapters × 2 rows (125 vs 127 µs), slower on the
mixed 2048-row batch (255 vs 233 µs) and much slower with few row tiles (8 adapters × 32 rows:
85 vs 47 µs), where a handful of items each walk the whole hidden size; see
benchmarks/kernels/bench_lora_ops.py.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lora_kernels.expand import b_kwargs, check_b
from lora_kernels.shrink import a_kwargs, check_a
from lora_kernels.tiles import (block_rank, column_chunk, expand_columns, pick_slice, shrink_acc,
                           worklist_rows)
from lora_kernels.worklist import RowTileWorklist, persistent_programs


@dataclass(frozen=True)
class FusedConfig:
    """Knobs of the fused launch.

    block_n: output columns per expand step; col_chunks: target column chunks per row tile over
    all slices (see `chunk_width`); block_k: hidden step of the shrink loop, split into
    k_groups batched dots so that the warps share the hidden dimension (`tiles.shrink_acc`);
    programs_per_sm: the persistent grid's size per SM (when no `num_programs` is given);
    num_warps and num_stages (software pipelining of the shrink loop) per program.

    Defaults: the best of a first H200 sweep (rank 8, one Llama-3.2-3B layer, 128 adapters × 2
    rows and the mixed 2048-row batch; benchmarks/kernels/bench_lora_ops.py sweeps them again).
    """

    block_n: int = 512
    col_chunks: int = 2
    block_k: int = 256
    programs_per_sm: int = 8  # the fused launch's own sweep (benchmarks/results/2026-11-30-kernels.md)
    num_warps: int = 4
    num_stages: int = 4
    k_groups: int = 4

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "k_groups"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"FusedConfig.{name}={value}: use a power of two")
        if self.block_n < 16 or self.block_k < 16 * self.k_groups:
            raise ValueError(f"FusedConfig: block_n ≥ 16 and block_k ≥ 16·k_groups needed, got "
                             f"block_n={self.block_n} block_k={self.block_k} "
                             f"k_groups={self.k_groups}")

    def __str__(self) -> str:
        return (f"block_n={self.block_n} col_chunks={self.col_chunks} block_k={self.block_k} "
                f"k_groups={self.k_groups} per_sm={self.programs_per_sm} "
                f"warps={self.num_warps} stages={self.num_stages}")


def chunk_width(widths: Sequence[int], block_n: int, col_chunks: int) -> int:
    """Columns per item, the same for all slices: the widest slice is cut into
    `cdiv(N_max, ΣN / col_chunks)` equal chunks, rounded up to a multiple of `block_n`; a slice
    of N_s columns then gets `cdiv(N_s, width)` chunks. The count depends only on the op's
    widths; e.g. qkv 3072 + 1024 + 1024 at col_chunks=2, block_n=512: 1536 → 2 + 1 + 1 items."""
    n_max = max(widths)
    pieces = triton.cdiv(n_max, triton.cdiv(sum(widths), col_chunks))
    return block_n * triton.cdiv(triton.cdiv(n_max, pieces), block_n)


# `rank` and `stride_bn` are compile-time constants for B's vectorized loads (see lora_kernels/expand.py).
@triton.jit
def _fused_worklist_kernel(
        x_ptr, a0_ptr, a1_ptr, a2_ptr, b0_ptr, b1_ptr, b2_ptr, y_ptr,
        tile_lora_ptr, tile_tokens_ptr, num_tiles_ptr,
        K, rank: tl.constexpr, scale, n0, n1, n2, out0, out1, out2, sbl0, sbl1, sbl2,
        stride_xm, stride_xk, stride_al, stride_ar, stride_ak,
        stride_bn: tl.constexpr, stride_br, stride_ym, stride_yn,
        chunks0: tl.constexpr, chunks1: tl.constexpr, col_chunks: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
        K_LEN: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK_N: tl.constexpr,
        ADD_INPUTS: tl.constexpr, K_GROUPS: tl.constexpr):
    total = tl.load(num_tiles_ptr) * col_chunks
    item = tl.program_id(0)
    while item < total:
        tile = item // col_chunks
        # The tile's record and token indices, loaded once per item for shrink and expand.
        lora = tl.load(tile_lora_ptr + tile).to(tl.int64)
        rows, row_mask = worklist_rows(tl.load(tile_tokens_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M)))
        slice_id, col0 = column_chunk(item % col_chunks, chunks0, chunks1, CHUNK_N)
        acc = shrink_acc(x_ptr, pick_slice(slice_id, a0_ptr, a1_ptr, a2_ptr), rows, row_mask,
                         lora, 0, K, rank, stride_xm, stride_xk, stride_al, stride_ar, stride_ak,
                         BLOCK_M, BLOCK_R, BLOCK_K, K_LEN, K_GROUPS)
        expand_columns((acc * scale).to(b0_ptr.dtype.element_ty),
                       pick_slice(slice_id, b0_ptr, b1_ptr, b2_ptr), y_ptr, rows, row_mask,
                       lora, col0, pick_slice(slice_id, n0, n1, n2),
                       pick_slice(slice_id, out0, out1, out2), rank,
                       pick_slice(slice_id, sbl0, sbl1, sbl2), stride_bn, stride_br,
                       stride_ym, stride_yn, BLOCK_R, BLOCK_N, CHUNK_N, ADD_INPUTS)
        item += tl.num_programs(0)


def lora_fused(x: torch.Tensor, lora_a: Sequence[torch.Tensor], lora_b: Sequence[torch.Tensor],
               y: torch.Tensor, schedule: RowTileWorklist,
               scale: float = 1.0, *, offset_start: int = 0, add_inputs: bool = True,
               config: FusedConfig = FusedConfig(), num_programs: int | None = None) -> None:
    """`y[m, slice s cols] (+)= bf(scale · x[m] @ A_s[id_m]ᵀ) @ B_s[id_m]ᵀ` in one launch.

    x: `[M, K]`; lora_a: 1–3 slices `[max_loras, (1,) rank, K]` of x's dtype (fp16/bf16); lora_b:
    as many slices `[max_loras, (1,) N_s, rank]` (fp16/bf16); y: `[M, ≥ offset_start + ΣN_s]`,
    slices written back to back from `offset_start`. Rows of tokens without an adapter are
    untouched. Semantics: `expand_reference(shrink_reference(...))`. `num_programs` sizes the
    persistent grid (default `persistent_programs(device, config.programs_per_sm)`).
    """
    if not isinstance(schedule, RowTileWorklist):
        raise ValueError(f"the fused launch walks a RowTileWorklist, got {type(schedule).__name__}")
    a3, b3 = check_a(x, lora_a), check_b(lora_b, y, offset_start)
    rank, hidden = a3[0].shape[1:]
    if len(b3) != len(a3) or b3[0].shape[2] != rank:
        raise ValueError(f"{len(a3)} A slices of rank {rank} but {len(b3)} B slices of rank "
                         f"{b3[0].shape[2]}")
    # A narrow input needs no wider step than itself, but each of the k_groups dots needs ≥ 16.
    block_k = max(min(config.block_k, triton.next_power_of_2(hidden)), 16 * config.k_groups)
    chunk_n = chunk_width([b.shape[1] for b in b3], config.block_n, config.col_chunks)
    grid = (num_programs or persistent_programs(x.device, config.programs_per_sm),)
    _fused_worklist_kernel[grid](
        **a_kwargs(x, a3), **b_kwargs(b3, y, offset_start, chunk_n),
        tile_lora_ptr=schedule.tile_lora, tile_tokens_ptr=schedule.tile_tokens,
        num_tiles_ptr=schedule.num_tiles, scale=scale,
        BLOCK_M=schedule.block_m, BLOCK_R=block_rank(rank), BLOCK_K=block_k,
        K_LEN=block_k * triton.cdiv(hidden, block_k), BLOCK_N=config.block_n,
        ADD_INPUTS=add_inputs, K_GROUPS=config.k_groups, num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
