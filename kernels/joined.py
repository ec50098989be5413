"""Joined grouped LoRA: split-K shrink and expand of one op in one persistent launch (needs Triton).

The fourth launch design. It keeps the work list's items (`shrink`, `expand`) and its partials
buffer, but runs both halves of an op in one launch, so an op pays one launch instead of two and
the expand's B loads (most of the op's bytes) overlap the tail of the shrink instead of waiting
for a kernel boundary.

Items are handed out in ticket order by a counter in device memory. Tickets
`0 … n_tiles·slices·splits − 1` are shrink items (row tile, slice, hidden chunk), the same items as
the work-list shrink; the rest are expand items (row tile, one column tile of `block_n`; column
tiles of all slices numbered back to back). A shrink item stores its partials and then bumps its
row tile's `done` counter (release). An expand item loads its B tile first, then waits until its
tile's `done` reaches `slices · splits` (acquire), then sums the partials past L1 and writes y.

Why it cannot deadlock, whatever the number of programs resident at once: a ticket is only ever
taken by a running program; shrink items never wait; an expand item waits only for shrink items,
whose tickets are smaller than its own and so were handed out earlier, each to a running program
that reaches it without waiting (a program takes its next ticket while working on the current
item, and the items before a shrink ticket are shrink items too).

The counters (`join_counters`: ticket, finished programs, then `done` and `readers` per work-list
entry) are zero before a launch and zero again after it: the last expand item of a row tile
clears that tile's two counters, and the last program to finish clears the ticket and finished
counters. So one zeroed buffer serves every launch on its stream, graph replays included; it
must not be shared by launches that may run concurrently (another stream).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.expand import b_kwargs, check_b
from kernels.layout import K_CHUNK, num_splits
from kernels.metadata import LoRABatchMeta
from kernels.shrink import a_kwargs, check_a
from kernels.tiles import (block_rank, column_chunk, load_b_tile, load_worklist_tile, pick_slice, shrink_tile,
                           store_y_tile, sum_partials)
from kernels.worklist import PROGRAMS_PER_SM, RowTileWorklist, persistent_programs

BLOCK_K = 256


@dataclass(frozen=True)
class JoinedConfig:
    """Knobs of the joined launch: block_n output columns per expand item; k_chunk hidden
    columns per shrink item (one partial each); k_groups batched dots per hidden step
    (`tiles.shrink_acc`); num_warps per program; programs_per_sm sizes the persistent grid when no
    `num_programs` is given."""

    block_n: int = 256
    k_chunk: int = K_CHUNK
    k_groups: int = 1
    num_warps: int = 4
    programs_per_sm: int = PROGRAMS_PER_SM

    def __post_init__(self) -> None:
        for name in ("block_n", "k_chunk", "k_groups", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"JoinedConfig.{name}={value}: use a power of two")
        if self.block_n < 16 or min(BLOCK_K, self.k_chunk) < 16 * self.k_groups:
            raise ValueError(f"JoinedConfig: block_n ≥ 16 and 16·k_groups ≤ min({BLOCK_K}, k_chunk) needed, "
                             f"got block_n={self.block_n} k_chunk={self.k_chunk} k_groups={self.k_groups}")

    def __str__(self) -> str:
        return (f"block_n={self.block_n} k_chunk={self.k_chunk} k_groups={self.k_groups} "
                f"warps={self.num_warps} per_sm={self.programs_per_sm}")


def join_counters(schedule: RowTileWorklist) -> torch.Tensor:
    """The zeroed int32 counters a joined launch over `schedule` synchronizes through (see the
    module docstring); allocate once per stream and reuse."""
    return torch.zeros(2 + 2 * schedule.capacity, dtype=torch.int32, device=schedule.tile_lora.device)


@triton.jit
def _joined_worklist_kernel(
        x_ptr, a0_ptr, a1_ptr, a2_ptr, part_ptr, b0_ptr, b1_ptr, b2_ptr, y_ptr,
        sorted_idx_ptr,
        tile_lora_ptr, tile_first_ptr, tile_rows_ptr, num_tiles_ptr, sync_ptr, capacity,
        K, rank, scale, n0, n1, n2, out0, out1, out2, sbl0, sbl1, sbl2, chunks0, chunks1, col_chunks,
        stride_xm, stride_xk, stride_al, stride_ar, stride_ak,
        stride_ps, stride_pc, stride_pm, stride_pr, stride_bn, stride_br, stride_ym, stride_yn,
        SLICES: tl.constexpr, N_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
        BLOCK_K: tl.constexpr, K_CHUNK: tl.constexpr, K_GROUPS: tl.constexpr, BLOCK_N: tl.constexpr,
        CHUNK_N: tl.constexpr, ADD_INPUTS: tl.constexpr):
    per_tile = SLICES * N_SPLITS
    n_tiles = tl.load(num_tiles_ptr)
    n_shrink = n_tiles * per_tile
    total = n_shrink + n_tiles * col_chunks
    done_ptr = sync_ptr + 2
    readers_ptr = done_ptr + capacity
    item = tl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")
    while item < total:
        # The next ticket now, so that its latency hides behind this item's loads.
        nxt = tl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")
        if item < n_shrink:
            tile = item // per_tile
            sub = item % per_tile
            lora, rows, row_mask = load_worklist_tile(tile_lora_ptr, tile_first_ptr, tile_rows_ptr,
                                                      sorted_idx_ptr, tile, n_tiles, BLOCK_M)
            shrink_tile(x_ptr, pick_slice(sub // N_SPLITS, a0_ptr, a1_ptr, a2_ptr), part_ptr, rows, row_mask,
                        lora, sub // N_SPLITS, sub % N_SPLITS, K, rank, scale,
                        stride_xm, stride_xk, stride_al, stride_ar, stride_ak,
                        stride_ps, stride_pc, stride_pm, stride_pr,
                        BLOCK_M, BLOCK_R, BLOCK_K, K_CHUNK, K_GROUPS)
            tl.debug_barrier()  # all threads' partials are stored before the release below
            tl.atomic_add(done_ptr + tile, 1, sem="release", scope="gpu")
        else:
            tile = (item - n_shrink) // col_chunks
            lora, rows, row_mask = load_worklist_tile(tile_lora_ptr, tile_first_ptr, tile_rows_ptr,
                                                      sorted_idx_ptr, tile, n_tiles, BLOCK_M)
            slice_id, col0 = column_chunk((item - n_shrink) % col_chunks, chunks0, chunks1, CHUNK_N)
            b_ptr = pick_slice(slice_id, b0_ptr, b1_ptr, b2_ptr)
            offs_n = col0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < pick_slice(slice_id, n0, n1, n2)
            b = load_b_tile(b_ptr, lora, offs_n, n_mask, rank, pick_slice(slice_id, sbl0, sbl1, sbl2),
                            stride_bn, stride_br, BLOCK_R)
            published = tl.atomic_add(done_ptr + tile, 0, sem="acquire", scope="gpu")
            while published < per_tile:
                published = tl.atomic_add(done_ptr + tile, 0, sem="acquire", scope="gpu")
            tl.debug_barrier()  # no thread reads partials before the acquire above
            inter = sum_partials(part_ptr, rows, row_mask, slice_id, rank, stride_ps, stride_pc, stride_pm,
                                 stride_pr, N_SPLITS, BLOCK_R, ".cg")
            store_y_tile(tl.dot(inter.to(b_ptr.dtype.element_ty), b), y_ptr, rows, row_mask,
                         pick_slice(slice_id, out0, out1, out2) + offs_n, n_mask, stride_ym, stride_yn,
                         ADD_INPUTS)
            if tl.atomic_add(readers_ptr + tile, 1, sem="relaxed", scope="gpu") == col_chunks - 1:
                # The tile's last reader: every shrink item and every wait on it are behind us.
                tl.atomic_xchg(done_ptr + tile, 0, sem="relaxed", scope="gpu")
                tl.atomic_xchg(readers_ptr + tile, 0, sem="relaxed", scope="gpu")
        item = nxt
    if tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        # The last program out: every ticket this launch will take has been taken.
        tl.atomic_xchg(sync_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(sync_ptr + 1, 0, sem="relaxed", scope="gpu")


def lora_joined(x: torch.Tensor, lora_a: Sequence[torch.Tensor], lora_b: Sequence[torch.Tensor],
                y: torch.Tensor, partials: torch.Tensor, meta: LoRABatchMeta, schedule: RowTileWorklist,
                counters: torch.Tensor, scale: float = 1.0, *, offset_start: int = 0, add_inputs: bool = True,
                config: JoinedConfig = JoinedConfig(), num_programs: int | None = None) -> None:
    """`y[m, slice s cols] (+)= bf(Σ_split scale · x[m, chunk] @ A_s[id_m, :, chunk]ᵀ) @ B_s[id_m]ᵀ`
    in one launch; the semantics and rounding of `shrink.lora_shrink` then `expand.lora_expand`.

    x: `[M, K]`; lora_a: 1–3 slices `[max_loras, (1,) rank, K]` of x's dtype (fp16/bf16); lora_b:
    as many slices `[max_loras, (1,) N_s, rank]`; y: `[M, ≥ offset_start + ΣN_s]`; partials:
    `layout.partials_buffer(slices, M, rank, K, k_chunk=config.k_chunk)`; counters:
    `join_counters(schedule)`, zero (as every launch leaves it). Rows of tokens without an adapter
    are untouched. `num_programs` sizes the persistent grid (default
    `persistent_programs(device, config.programs_per_sm)`).
    """
    if not isinstance(schedule, RowTileWorklist):
        raise ValueError(f"the joined launch walks a RowTileWorklist, got {type(schedule).__name__}")
    a3, b3 = check_a(x, lora_a), check_b(lora_b, y, offset_start)
    rank, hidden = a3[0].shape[1:]
    if len(b3) != len(a3) or b3[0].shape[2] != rank:
        raise ValueError(f"{len(a3)} A slices of rank {rank} but {len(b3)} B slices of rank {b3[0].shape[2]}")
    splits = num_splits(hidden, config.k_chunk)
    if tuple(partials.shape[:2]) != (splits, len(a3)) or partials.shape[2] < x.shape[0] \
            or partials.shape[3] != rank or partials.dtype != torch.float32:
        raise ValueError(f"partials {tuple(partials.shape)} {partials.dtype}: expected "
                         f"[{splits}, {len(a3)}, ≥{x.shape[0]}, {rank}] float32")
    if counters.dtype != torch.int32 or counters.numel() != 2 + 2 * schedule.capacity:
        raise ValueError(f"counters {tuple(counters.shape)} {counters.dtype}: use join_counters(schedule)")
    ps, pc, pm, pr = partials.stride()
    grid = (num_programs or persistent_programs(x.device, config.programs_per_sm),)
    _joined_worklist_kernel[grid](
        **a_kwargs(x, a3), **b_kwargs(b3, y, offset_start, config.block_n), part_ptr=partials,
        sorted_idx_ptr=meta.token_indices_sorted, tile_lora_ptr=schedule.tile_lora,
        tile_first_ptr=schedule.tile_first, tile_rows_ptr=schedule.tile_rows, num_tiles_ptr=schedule.num_tiles,
        sync_ptr=counters, capacity=schedule.capacity, scale=scale,
        stride_ps=ps, stride_pc=pc, stride_pm=pm, stride_pr=pr, SLICES=len(a3), N_SPLITS=splits,
        BLOCK_M=schedule.block_m, BLOCK_R=block_rank(rank), BLOCK_K=min(BLOCK_K, config.k_chunk),
        K_CHUNK=config.k_chunk, K_GROUPS=config.k_groups, BLOCK_N=config.block_n, ADD_INPUTS=add_inputs,
        num_warps=config.num_warps)
