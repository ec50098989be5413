"""Weight views and the split-K partials buffer shared by shrink and expand.

Weights use vLLM's stacked layout:
A of a slice is `[max_loras, (1,) rank, hidden]`, B is `[max_loras, (1,) out_features, rank]`.

Shrink splits the hidden dimension into chunks of `K_CHUNK` and writes one fp32 partial per
chunk, so no atomics and no zeroing are needed; expand sums the partials as it loads them.
Partials: `[num_splits, num_slices, num_tokens, rank]` fp32. Rows of tokens without an adapter
are never written nor read.
"""
from __future__ import annotations

import torch

K_CHUNK = 1024


def as_3d(weight: torch.Tensor) -> torch.Tensor:
    """View a stacked LoRA weight `[L, 1, a, b]` or `[L, a, b]` as `[L, a, b]`."""
    if weight.dim() == 4:
        if weight.size(1) != 1:
            raise ValueError(f"stacked LoRA weight of shape {tuple(weight.shape)}: dim 1 must be 1")
        return weight.squeeze(1)
    if weight.dim() != 3:
        raise ValueError(f"stacked LoRA weight of shape {tuple(weight.shape)}: "
                         "expected 3 or 4 dims")
    return weight


def num_splits(hidden: int, k_chunk: int = K_CHUNK) -> int:
    """Number of hidden-dimension chunks shrink uses for an input of width `hidden`."""
    return -(-hidden // k_chunk)


def partials_buffer(num_slices: int, num_tokens: int, rank: int, hidden: int,
                    device: torch.device | str, k_chunk: int = K_CHUNK) -> torch.Tensor:
    """Allocate (uninitialised) shrink partials for `num_tokens` rows."""
    return torch.empty(num_splits(hidden, k_chunk), num_slices, num_tokens, rank,
                       dtype=torch.float32, device=device)
