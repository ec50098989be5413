"""Triton tile bodies shared by both launch designs (needs Triton).

A tile is BLOCK_M rows of one slot's group. Rows past the group's end are masked, so a tile
never touches another group's tokens. Both designs call the same bodies; they differ only in
how (slot, row tile, sub-item) is found: from the grid (GridTrim) or from the work list.
"""
from __future__ import annotations

import triton
import triton.language as tl


def block_rank(rank: int) -> int:
    """Rank padded for `tl.dot` (≥ 16, a power of two)."""
    if not 1 <= rank <= 128:
        raise ValueError(f"LoRA rank {rank} not supported: use 1..128")
    return max(16, triton.next_power_of_2(rank))


@triton.jit
def pick_slice(slice_id, v0, v1, v2):
    """Per-slice value (pointer or int) for slice 0, 1 or 2."""
    return tl.where(slice_id == 2, v2, tl.where(slice_id == 1, v1, v0))


@triton.jit
def load_tile_rows(sorted_idx_ptr, first, n_rows, BLOCK_M: tl.constexpr):
    """Token indices `sorted_idx[first : first + min(n_rows, BLOCK_M)]` and their mask."""
    offs = tl.arange(0, BLOCK_M)
    mask = offs < n_rows
    rows = tl.load(sorted_idx_ptr + first + offs, mask=mask, other=0)
    return rows.to(tl.int64), mask


@triton.jit
def shrink_tile(x_ptr, a_ptr, part_ptr, rows, row_mask, lora, slice_id, split, K, rank, scale,
                stride_xm, stride_xk, stride_al, stride_ar, stride_ak,
                stride_ps, stride_pc, stride_pm, stride_pr,
                BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                K_CHUNK: tl.constexpr):
    """partials[split, slice, rows] = scale · x[rows, chunk] @ A[lora, :, chunk]ᵀ (fp32)."""
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    r_mask = offs_r < rank
    x_rows = x_ptr + rows[:, None] * stride_xm
    a_rows = a_ptr + lora * stride_al + offs_r[:, None] * stride_ar
    k_first = split * K_CHUNK
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for kk in range(0, K_CHUNK, BLOCK_K):
        k = k_first + kk + offs_k
        k_mask = k < K
        xt = tl.load(x_rows + k[None, :] * stride_xk,
                     mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        at = tl.load(a_rows + k[None, :] * stride_ak,
                     mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.dot(xt, tl.trans(at))
    out = (part_ptr + split * stride_ps + slice_id * stride_pc
           + rows[:, None] * stride_pm + offs_r[None, :] * stride_pr)
    tl.store(out, acc * scale, mask=row_mask[:, None] & r_mask[None, :])


@triton.jit
def expand_tile(part_ptr, b_ptr, y_ptr, rows, row_mask, lora, slice_id, col0, n_cols, out_col0,
                rank, stride_ps, stride_pc, stride_pm, stride_pr,
                stride_bl, stride_bn, stride_br, stride_ym, stride_yn,
                N_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_N: tl.constexpr, CHUNK_N: tl.constexpr, ADD_INPUTS: tl.constexpr):
    """y[rows, out_col0 + cols] (+)= bf(Σ_split partials[split, slice, rows]) @ B[lora, cols]ᵀ.

    cols = `[col0, col0 + CHUNK_N)` ∩ `[0, n_cols)` of the slice, in steps of BLOCK_N;
    bf casts to B's dtype.
    """
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    p = part_ptr + slice_id * stride_pc + rows[:, None] * stride_pm + offs_r[None, :] * stride_pr
    p_mask = row_mask[:, None] & r_mask[None, :]
    inter = tl.load(p, mask=p_mask, other=0.0)
    for sp in tl.static_range(1, N_SPLITS):
        inter += tl.load(p + sp * stride_ps, mask=p_mask, other=0.0)
    inter = inter.to(b_ptr.dtype.element_ty)
    b_rows = b_ptr + lora * stride_bl + offs_r[:, None] * stride_br
    y_rows = y_ptr + rows[:, None] * stride_ym
    for c in range(0, CHUNK_N, BLOCK_N):
        offs_n = col0 + c + tl.arange(0, BLOCK_N)
        n_mask = offs_n < n_cols
        b = tl.load(b_rows + offs_n[None, :] * stride_bn, mask=r_mask[:, None] & n_mask[None, :],
                    other=0.0)
        acc = tl.dot(inter, b)
        y = y_rows + (out_col0 + offs_n)[None, :] * stride_yn
        y_mask = row_mask[:, None] & n_mask[None, :]
        if ADD_INPUTS:
            acc += tl.load(y, mask=y_mask, other=0.0).to(tl.float32)
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
