"""StepTrim's release decision as one Triton kernel (needs Triton): gather, score, compare.

One program per decided row i reads its (hidden row, slot, t) from an int64 block ``meta``
[3, B] and the step's hidden states through a *source* int64 pair ``src`` = (address of
hidden[0, 0], row stride in elements), then writes

    score[i] = Σ_j hidden[row, j] · w[slot, j] + b[slot]          (float32)
    fire[i]  = (t ≥ k[slot]) | (score[i] < τ[slot])

from StepTrim's per-slot float32 table (columns k, τ, b, then w; slot −1 reads the table's last
row, which never fires). This is the computation of ``StepTrim._score`` and ``StepTrim.fires``,
with one difference of float32 rounding: the row sum runs in this kernel's fixed order
(BLOCK_H-wide partial sums, possibly fused multiply-adds, then one tree reduction), which
depends on the hidden size only. So a row's score does not depend on the other rows of the
launch, on the launch's size, or on which caller (StepTrim.scores, StepTrim.fires, the serving
runtime's launcher) asks: every call of a process runs the same compiled kernel for a hidden
dtype. The torch statement of the same result is StepTrim's path off CUDA
(``serve_bridge.steptrim.StepTrim`` with ``kernel=False``), which the tests compare it with.

Why the hidden address is data rather than an argument: the serving runtime replays this
kernel as a CUDA graph, whose arguments are frozen at capture, while each engine step's hidden
states live at a new address. With the address in ``src`` (pinned host memory there, which the
kernel reads directly, as it reads ``meta`` and writes ``fire``) a step is one graph replay with
no copy before or after it.
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

NUM_WARPS = 4
MAX_BLOCK_H = 1024
_TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
COLUMNS = 3  # k, τ, b before the head weight: serve_bridge.steptrim's table layout (_K, _TAU, _B, _W)


@triton.jit(do_not_specialize=["B", "n_slots", "table_stride"])
def _steptrim_kernel(meta_ptr, B, src_ptr, table_ptr, table_stride, n_slots, score_ptr, fire_ptr,
                     HIDDEN: tl.constexpr, LEARNED: tl.constexpr, H: tl.constexpr, BLOCK_H: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(meta_ptr + i)
    slot = tl.load(meta_ptr + B + i)
    t = tl.load(meta_ptr + 2 * B + i)
    slot = tl.where(slot < 0, n_slots, slot)  # NO_SLOT → the table's last row
    params = table_ptr + slot * table_stride
    k = tl.load(params)
    tau = tl.load(params + 1)
    bias = tl.load(params + 2)
    fire = t.to(tl.float32) >= k
    score = 0.0
    if LEARNED:
        hidden_row = tl.load(src_ptr).to(tl.pointer_type(HIDDEN)) + row * tl.load(src_ptr + 1)
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in range(0, H, BLOCK_H):
            offs = j + tl.arange(0, BLOCK_H)
            mask = offs < H
            x = tl.load(hidden_row + offs, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(params + 3 + offs, mask=mask, other=0.0)  # w from column COLUMNS (= 3)
            acc += x * w
        score = tl.sum(acc, axis=0) + bias
        fire = fire | (score < tau)
    tl.store(score_ptr + i, score)
    tl.store(fire_ptr + i, fire)


def block_h(hidden_size: int) -> int:
    """The kernel's row-sum block width: a function of the hidden size only (fixes the order)."""
    return min(MAX_BLOCK_H, triton.next_power_of_2(hidden_size))


def hidden_source(hidden: torch.Tensor, out: torch.Tensor | np.ndarray | None = None) -> torch.Tensor | np.ndarray:
    """The (address, row stride) pair the kernel reads ``hidden`` [N, H] through, written into
    ``out`` (int64 [2]: a tensor, or a numpy view of one) or into a new tensor on ``hidden``'s
    device. ``hidden`` must outlive every launch that reads the pair."""
    check_hidden(hidden)
    pair = (hidden.data_ptr(), hidden.stride(0))
    if out is None:
        return torch.tensor(pair, dtype=torch.int64).to(hidden.device)
    out[0], out[1] = pair
    return out


def check_hidden(hidden: torch.Tensor) -> None:
    """Raise ValueError unless ``hidden`` is a 2-D float32/bf16/fp16 tensor with unit column stride."""
    if hidden.dim() != 2 or hidden.dtype not in _TL_DTYPE or (hidden.shape[1] > 1 and hidden.stride(1) != 1):
        raise ValueError(f"StepTrim kernel: hidden states must be 2-D float32/bfloat16/float16 rows with unit "
                         f"column stride, got {tuple(hidden.shape)} {hidden.dtype} strides {hidden.stride()}")


def launch_steptrim(meta: torch.Tensor, src: torch.Tensor, hidden_dtype: torch.dtype, table: torch.Tensor,
                    learned: bool, score: torch.Tensor, fire: torch.Tensor) -> None:
    """Decide the ``meta.shape[1]`` rows of ``meta`` (int64 [3, B], contiguous: hidden row, slot,
    t) into ``score`` (float32 [B]) and ``fire`` (bool [B]).

    src: int64 [2] from :func:`hidden_source` for hidden states of ``hidden_dtype`` (read only if
    ``learned``); table: StepTrim's float32 table [slots + 1, 3 (+ H)]. Every tensor must be
    reachable from the device the kernel runs on: device memory, or pinned host memory, which
    the kernel reads and writes directly. Padding rows have slot −1 and any valid hidden row.
    """
    rows = meta.shape[1]
    if meta.dtype != torch.int64 or meta.dim() != 2 or meta.shape[0] != 3 or not meta.is_contiguous():
        raise ValueError(f"StepTrim kernel: meta must be contiguous int64 [3, B], got {meta.dtype} "
                         f"{tuple(meta.shape)}")
    if rows == 0:
        return
    hidden_size = table.shape[1] - COLUMNS if learned else 1
    _steptrim_kernel[(rows,)](
        meta_ptr=meta, B=rows, src_ptr=src, table_ptr=table, table_stride=table.stride(0),
        n_slots=table.shape[0] - 1, score_ptr=score, fire_ptr=fire, HIDDEN=_TL_DTYPE[hidden_dtype],
        LEARNED=learned, H=hidden_size, BLOCK_H=block_h(hidden_size), num_warps=NUM_WARPS)

