"""Triton tile bodies shared by both launch designs (needs Triton).

A tile is BLOCK_M rows of one slot's group. Rows past the group's end are masked, so a tile
never touches another group's tokens. All designs call the same bodies; they differ only in
how (slot, row tile, sub-item) is found: from the grid (GridTrim) or from the work list, and in
whether the shrink result goes through the partials buffer (`shrink_tile` → `expand_tile`) or
stays in registers (`shrink_acc` → `expand_columns`, the fused launch).
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
def tile_row_mask(n_rows, BLOCK_M: tl.constexpr):
    """A grid tile's offsets `0..BLOCK_M` and which of them hold one of its `n_rows` rows; the
    kernel loads `sorted_idx[first + offs]` under that mask itself (:func:`worklist_rows` says why)."""
    offs = tl.arange(0, BLOCK_M)
    return offs, offs < n_rows


@triton.jit
def worklist_rows(tokens):
    """A work-list tile's token indices (lora_kernels/worklist.py; -1 past the group's end), loaded
    by the kernel itself, as int64 indices and their mask.

    The kernels load a tile's record (``tile_lora``, ``tile_tokens``) in their own body, not in a
    helper: torch.compile's analysis of a user-defined Triton kernel (``identify_accessed_tensors``,
    torch 2.13-2.14) takes every pointer argument of a called helper whose result feeds a store's
    address as written, so a helper's loads would make the work list look mutated (docs/vllm_integration.md §4c)."""
    return tl.maximum(tokens, 0).to(tl.int64), tokens >= 0


@triton.jit
def shrink_acc(x_ptr, a_ptr, rows, row_mask, lora, k_first, K, rank,
               stride_xm, stride_xk, stride_al, stride_ar, stride_ak,
               BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
               K_LEN: tl.constexpr, K_GROUPS: tl.constexpr = 1):
    """fp32 `x[rows, k] @ A[lora, :, k]ᵀ` over k in `[k_first, k_first + K_LEN)` ∩ `[0, K)`,
    shape `[BLOCK_M, BLOCK_R]` (masked rows and ranks are 0).

    With K_GROUPS > 1 each step is a batched dot over K_GROUPS slices of BLOCK_K, summed at the
    end: the warps then split the hidden dimension instead of repeating a 16 × 16 output tile.
    """
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    if K_GROUPS == 1:
        offs_k = tl.arange(0, BLOCK_K)
        x_rows = x_ptr + rows[:, None] * stride_xm
        a_rows = a_ptr + lora * stride_al + offs_r[:, None] * stride_ar
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for kk in range(0, K_LEN, BLOCK_K):
            k = k_first + kk + offs_k
            k_mask = k < K
            xt = tl.load(x_rows + k[None, :] * stride_xk,
                         mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            at = tl.load(a_rows + k[None, :] * stride_ak,
                         mask=r_mask[:, None] & k_mask[None, :], other=0.0)
            acc += tl.dot(xt, tl.trans(at))
    else:
        KS: tl.constexpr = BLOCK_K // K_GROUPS
        offs_gk = tl.arange(0, K_GROUPS)[:, None] * KS + tl.arange(0, KS)[None, :]  # [G, KS]
        x_rows = x_ptr + rows[None, :, None] * stride_xm  # [1, M, 1]
        a_rows = a_ptr + lora * stride_al + offs_r[None, None, :] * stride_ar  # [1, 1, R]
        acc3 = tl.zeros((K_GROUPS, BLOCK_M, BLOCK_R), dtype=tl.float32)
        for kk in range(0, K_LEN, BLOCK_K):
            k = k_first + kk + offs_gk
            k_mask = k < K
            xt = tl.load(x_rows + k[:, None, :] * stride_xk,
                         mask=row_mask[None, :, None] & k_mask[:, None, :], other=0.0)
            at = tl.load(a_rows + k[:, :, None] * stride_ak,
                         mask=r_mask[None, None, :] & k_mask[:, :, None], other=0.0)
            acc3 += tl.dot(xt, at)
        acc = tl.sum(acc3, axis=0)
    return acc


@triton.jit
def shrink_tile(x_ptr, a_ptr, part_ptr, rows, row_mask, lora, slice_id, split, K, rank, scale,
                stride_xm, stride_xk, stride_al, stride_ar, stride_ak,
                stride_ps, stride_pc, stride_pm, stride_pr,
                BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                K_CHUNK: tl.constexpr, K_GROUPS: tl.constexpr = 1):
    """partials[split, slice, rows] = scale · x[rows, chunk] @ A[lora, :, chunk]ᵀ (fp32);
    K_GROUPS as in `shrink_acc`."""
    acc = shrink_acc(x_ptr, a_ptr, rows, row_mask, lora, split * K_CHUNK, K, rank,
                     stride_xm, stride_xk, stride_al, stride_ar, stride_ak,
                     BLOCK_M, BLOCK_R, BLOCK_K, K_CHUNK, K_GROUPS)
    offs_r = tl.arange(0, BLOCK_R)
    out = (part_ptr + split * stride_ps + slice_id * stride_pc
           + rows[:, None] * stride_pm + offs_r[None, :] * stride_pr)
    tl.store(out, acc * scale, mask=row_mask[:, None] & (offs_r < rank)[None, :])


@triton.jit
def column_chunk(j, chunks0, chunks1, CHUNK_N: tl.constexpr):
    """(slice, first column within the slice) of column chunk j, chunks of all slices being
    numbered back to back (`chunks0` of slice 0, `chunks1` of slice 1, then slice 2's)."""
    slice_id = (j >= chunks0).to(tl.int32) + (j >= chunks0 + chunks1).to(tl.int32)
    col0 = (j - pick_slice(slice_id, 0, chunks0, chunks0 + chunks1)) * CHUNK_N
    return slice_id, col0


@triton.jit
def load_b_tile(b_ptr, lora, offs_n, n_mask, rank, stride_bl, stride_bn, stride_br,
                BLOCK_R: tl.constexpr):
    """`B[lora, offs_n, :rank]ᵀ` as a `[BLOCK_R, BLOCK_N]` tile (masked ranks and columns 0)."""
    offs_r = tl.arange(0, BLOCK_R)
    return tl.load(b_ptr + lora * stride_bl + offs_r[:, None] * stride_br + offs_n[None, :] * stride_bn,
                   mask=(offs_r < rank)[:, None] & n_mask[None, :], other=0.0)


@triton.jit
def store_y_tile(acc, y_ptr, rows, row_mask, offs_out, n_mask, stride_ym, stride_yn,
                 ADD_INPUTS: tl.constexpr):
    """`y[rows, offs_out] (+)= acc`: acc (fp32 `[BLOCK_M, BLOCK_N]`) is rounded to y's dtype, then
    added to y with one more rounding, as vLLM 0.26's expand adds.

    The add is a relaxed atomic add (16-byte `red.global.add` of 8 bf16/fp16): the program does
    not wait for y to be read. Per layer that measured 13–19% faster on the H200 than a load, add
    and store, with or without the next tile's y prefetched (benchmarks/results/2026-11-30-kernels.md,
    2026-11-30). Each element of y belongs to one tile of one item, so no two adds meet and the
    result is deterministic."""
    y = y_ptr + rows[:, None] * stride_ym + offs_out[None, :] * stride_yn
    y_mask = row_mask[:, None] & n_mask[None, :]
    if ADD_INPUTS:
        tl.atomic_add(y, acc.to(y_ptr.dtype.element_ty), mask=y_mask, sem="relaxed")
    else:
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=y_mask)


@triton.jit
def expand_columns(inter, b_ptr, y_ptr, rows, row_mask, lora, col0, n_cols, out_col0, rank,
                   stride_bl, stride_bn, stride_br, stride_ym, stride_yn,
                   BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK_N: tl.constexpr,
                   ADD_INPUTS: tl.constexpr):
    """y[rows, out_col0 + cols] (+)= inter @ B[lora, cols]ᵀ, inter `[BLOCK_M, BLOCK_R]` already in
    B's dtype; cols = `[col0, col0 + CHUNK_N)` ∩ `[0, n_cols)` of the slice, in steps of BLOCK_N.
    Products are summed in fp32 and rounded to y's dtype, then added as `store_y_tile` adds."""
    for c in range(0, CHUNK_N, BLOCK_N):
        offs_n = col0 + c + tl.arange(0, BLOCK_N)
        n_mask = offs_n < n_cols
        b = load_b_tile(b_ptr, lora, offs_n, n_mask, rank, stride_bl, stride_bn, stride_br, BLOCK_R)
        store_y_tile(tl.dot(inter, b), y_ptr, rows, row_mask, out_col0 + offs_n, n_mask,
                     stride_ym, stride_yn, ADD_INPUTS)


@triton.jit
def sum_partials(part_ptr, rows, row_mask, slice_id, rank, stride_ps, stride_pc, stride_pm, stride_pr,
                 N_SPLITS: tl.constexpr, BLOCK_R: tl.constexpr):
    """fp32 `Σ_split partials[split, slice, rows]`, `[BLOCK_M, BLOCK_R]` (masked entries 0)."""
    offs_r = tl.arange(0, BLOCK_R)
    p = part_ptr + slice_id * stride_pc + rows[:, None] * stride_pm + offs_r[None, :] * stride_pr
    p_mask = row_mask[:, None] & (offs_r < rank)[None, :]
    inter = tl.load(p, mask=p_mask, other=0.0)
    for sp in tl.static_range(1, N_SPLITS):
        inter += tl.load(p + sp * stride_ps, mask=p_mask, other=0.0)
    return inter


@triton.jit
def expand_tile(part_ptr, b_ptr, y_ptr, rows, row_mask, lora, slice_id, col0, n_cols, out_col0,
                rank, stride_ps, stride_pc, stride_pm, stride_pr,
                stride_bl, stride_bn, stride_br, stride_ym, stride_yn,
                N_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_N: tl.constexpr, CHUNK_N: tl.constexpr, ADD_INPUTS: tl.constexpr):
    """y[rows, out_col0 + cols] (+)= bf(Σ_split partials[split, slice, rows]) @ B[lora, cols]ᵀ.

    cols as in `expand_columns`; bf casts to B's dtype.
    """
    inter = sum_partials(part_ptr, rows, row_mask, slice_id, rank, stride_ps, stride_pc, stride_pm, stride_pr,
                         N_SPLITS, BLOCK_R)
    expand_columns(inter.to(b_ptr.dtype.element_ty), b_ptr, y_ptr, rows, row_mask, lora, col0,
                   n_cols, out_col0, rank, stride_bl, stride_bn, stride_br, stride_ym, stride_yn,
                   BLOCK_R, BLOCK_N, CHUNK_N, ADD_INPUTS)
