"""One LoRA linear's work: shrink then expand into y (needs Triton)."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.expand import CHUNK_TILES, lora_expand
from kernels.gridtrim import GridTrimPlan
from kernels.layout import K_CHUNK
from kernels.metadata import LoRABatchMeta
from kernels.shrink import lora_shrink
from kernels.worklist import RowTileWorklist


def add_lora_linear(y: torch.Tensor, x: torch.Tensor, lora_a: Sequence[torch.Tensor],
                    lora_b: Sequence[torch.Tensor], partials: torch.Tensor,
                    meta: LoRABatchMeta, schedule: RowTileWorklist | GridTrimPlan,
                    scale: float = 1.0, *, offset_start: int = 0, add_inputs: bool = True,
                    block_n: int | None = None, chunk_tiles: int = CHUNK_TILES,
                    k_chunk: int = K_CHUNK, num_programs: int | None = None) -> None:
    """`y[m, slice s cols] (+)= bf(scale · x[m] @ A_s[id_m]ᵀ) @ B_s[id_m]ᵀ` for tokens with an
    adapter, as vLLM's `PunicaWrapperGPU.add_lora_linear` (punica_gpu.py:203-264).

    `partials` comes from `layout.partials_buffer(len(lora_a), M, rank, K, k_chunk=k_chunk)`.
    """
    lora_shrink(x, lora_a, partials, meta, schedule, scale, k_chunk=k_chunk,
                num_programs=num_programs)
    lora_expand(partials, lora_b, y, meta, schedule, offset_start=offset_start,
                add_inputs=add_inputs, block_n=block_n, chunk_tiles=chunk_tiles,
                num_programs=num_programs)
