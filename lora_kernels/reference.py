"""Pure-torch semantics of the grouped LoRA shrink and expand (the kernels' test oracle).

These work from `token_lora_mapping` alone, not from the grouped metadata, so they also check
the metadata and work-list code. They loop over adapters and are meant for tests, not speed.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from lora_kernels.layout import as_3d


def _rows_by_adapter(token_lora_mapping: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(adapter id, token indices) for each adapter present in the mapping."""
    mapping = token_lora_mapping.to(torch.int64)
    ids = torch.unique(mapping[mapping >= 0]).tolist()
    return [(lora, torch.nonzero(mapping == lora).flatten()) for lora in ids]


def shrink_reference(x: torch.Tensor, lora_a: Sequence[torch.Tensor],
                     token_lora_mapping: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """`out[s, m] = scale · x[m] @ A_s[id_m]ᵀ` in fp32 for tokens with an adapter, 0 otherwise.

    Shape `[num_slices, num_tokens, rank]`, float32.
    """
    rank = as_3d(lora_a[0]).shape[1]
    out = torch.zeros(len(lora_a), x.shape[0], rank, dtype=torch.float32, device=x.device)
    for lora, rows in _rows_by_adapter(token_lora_mapping):
        xs = x[rows].float()
        for s, a in enumerate(lora_a):
            out[s, rows] = scale * (xs @ as_3d(a)[lora].float().T)
    return out


def expand_reference(inter: torch.Tensor, lora_b: Sequence[torch.Tensor], y: torch.Tensor,
                     token_lora_mapping: torch.Tensor, offset_start: int = 0,
                     add_inputs: bool = True) -> torch.Tensor:
    """Return a copy of `y` with the expand applied to tokens that have an adapter.

    For slice s with columns `[c_s, c_s + N_s)` (c_0 = offset_start, slices back to back):
    `y[m, c_s:c_s+N_s] = (y[m, ...] if add_inputs else 0) + bf(inter[s, m]) @ B_s[id_m]ᵀ`,
    where bf casts the fp32 intermediate to the weights' dtype (as vLLM's expand does). The
    products are summed in fp32 and rounded to y's dtype, and that is added to y with one more
    rounding, which is vLLM's rounding too (it rounds the accumulator, then adds the loaded output). Rows of tokens without an
    adapter are left untouched.
    """
    out = y.clone()
    col = offset_start
    groups = _rows_by_adapter(token_lora_mapping)
    for s, b in enumerate(lora_b):
        b3 = as_3d(b)
        n = b3.shape[1]
        for lora, rows in groups:
            upd = (inter[s, rows].to(b3.dtype).float() @ b3[lora].float().T).to(out.dtype)
            if add_inputs:
                upd = (upd.float() + out[rows, col:col + n].float()).to(out.dtype)
            out[rows, col:col + n] = upd
        col += n
    return out
