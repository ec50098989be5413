"""One LoRA linear's work: shrink then expand into y, or both in one fused launch (needs Triton)."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.expand import CHUNK_TILES, lora_expand
from kernels.fused import FusedConfig, lora_fused
from kernels.gridtrim import GridTrimPlan
from kernels.layout import K_CHUNK
from kernels.metadata import LoRABatchMeta
from kernels.shrink import lora_shrink
from kernels.worklist import RowTileWorklist


def add_lora_linear(y: torch.Tensor, x: torch.Tensor, lora_a: Sequence[torch.Tensor],
                    lora_b: Sequence[torch.Tensor], partials: torch.Tensor | None,
                    meta: LoRABatchMeta, schedule: RowTileWorklist | GridTrimPlan,
                    scale: float = 1.0, *, offset_start: int = 0, add_inputs: bool = True,
                    block_n: int | None = None, chunk_tiles: int = CHUNK_TILES,
                    k_chunk: int = K_CHUNK, num_programs: int | None = None,
                    fused: bool | FusedConfig = False) -> None:
    """`y[m, slice s cols] (+)= bf(scale · x[m] @ A_s[id_m]ᵀ) @ B_s[id_m]ᵀ` for tokens with an
    adapter, as vLLM's `PunicaWrapperGPU.add_lora_linear` (punica_gpu.py:203-264).

    Unfused (default): shrink then expand, through `partials` from
    `layout.partials_buffer(len(lora_a), M, rank, K, k_chunk=k_chunk)`. `fused=True` (or a
    `FusedConfig`) runs `fused.lora_fused` instead: one launch, `partials` is not used (may be
    None), `schedule` must be a `RowTileWorklist`, and `block_n`, `chunk_tiles`, `k_chunk` are
    replaced by the config's knobs.
    """
    if fused:
        config = fused if isinstance(fused, FusedConfig) else FusedConfig()
        lora_fused(x, lora_a, lora_b, y, meta, schedule, scale, offset_start=offset_start,
                   add_inputs=add_inputs, config=config, num_programs=num_programs)
        return
    if partials is None:
        raise ValueError("the unfused launch needs a partials buffer (layout.partials_buffer)")
    lora_shrink(x, lora_a, partials, meta, schedule, scale, k_chunk=k_chunk,
                num_programs=num_programs)
    lora_expand(partials, lora_b, y, meta, schedule, offset_start=offset_start,
                add_inputs=add_inputs, block_n=block_n, chunk_tiles=chunk_tiles,
                num_programs=num_programs)
