"""One LoRA linear's work: shrink then expand into y, or both in one fused launch (needs Triton)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.expand import CHUNK_TILES, ExpandConfig, expand_config, launch_expand
from kernels.fused import FusedConfig, lora_fused
from kernels.gridtrim import GridTrimPlan
from kernels.layout import K_CHUNK
from kernels.metadata import LoRABatchMeta
from kernels.shrink import NUM_WARPS as SHRINK_WARPS
from kernels.shrink import ShrinkConfig, launch_shrink, shrink_config
from kernels.worklist import RowTileWorklist


@dataclass(frozen=True)
class LinearConfig:
    """One LoRA linear's shrink and expand, validated once for its weights and for inputs and
    outputs of one dtype, width and strides (`linear_config`). Building the launch arguments
    costs far more host time than a launch itself; a server builds this once per layer and
    reuses it every step (`launch_linear`)."""

    shrink: ShrinkConfig
    expand: ExpandConfig


def linear_config(y: torch.Tensor, x: torch.Tensor, lora_a: Sequence[torch.Tensor], lora_b: Sequence[torch.Tensor],
                  *, offset_start: int = 0, block_n: int | None = None, chunk_tiles: int = CHUNK_TILES,
                  k_chunk: int = K_CHUNK, k_groups: int = 1, shrink_warps: int = SHRINK_WARPS) -> LinearConfig:
    """Validate and precompute `add_lora_linear`'s unfused launches for this layer and these x/y
    layouts (the values of x and y are not read)."""
    return LinearConfig(shrink_config(x, lora_a, k_chunk, k_groups=k_groups, num_warps=shrink_warps),
                        expand_config(lora_b, y, offset_start, block_n, chunk_tiles))


def launch_linear(config: LinearConfig, y: torch.Tensor, x: torch.Tensor, partials: torch.Tensor,
                  meta: LoRABatchMeta, schedule: RowTileWorklist | GridTrimPlan, scale: float = 1.0, *,
                  add_inputs: bool = True, num_programs: int | None = None) -> None:
    """`add_lora_linear`'s unfused path with a prebuilt `config`; x and y must have the dtypes,
    widths and strides it was built for (the caller's contract, not re-checked here)."""
    launch_shrink(config.shrink, x, partials, meta, schedule, scale, num_programs=num_programs)
    launch_expand(config.expand, partials, y, meta, schedule, add_inputs=add_inputs, num_programs=num_programs)


def add_lora_linear(y: torch.Tensor, x: torch.Tensor, lora_a: Sequence[torch.Tensor],
                    lora_b: Sequence[torch.Tensor], partials: torch.Tensor | None,
                    meta: LoRABatchMeta, schedule: RowTileWorklist | GridTrimPlan,
                    scale: float = 1.0, *, offset_start: int = 0, add_inputs: bool = True,
                    block_n: int | None = None, chunk_tiles: int = CHUNK_TILES,
                    k_chunk: int = K_CHUNK, k_groups: int = 1, shrink_warps: int = SHRINK_WARPS,
                    num_programs: int | None = None, fused: bool | FusedConfig = False) -> None:
    """`y[m, slice s cols] (+)= bf(scale · x[m] @ A_s[id_m]ᵀ) @ B_s[id_m]ᵀ` for tokens with an
    adapter, as vLLM's `PunicaWrapperGPU.add_lora_linear` (punica_gpu.py:203-264).

    Unfused (default): shrink then expand, through `partials` from
    `layout.partials_buffer(len(lora_a), M, rank, K, k_chunk=k_chunk)`. `fused=True` (or a
    `FusedConfig`) runs `fused.lora_fused` instead: one launch, `partials` is not used (may be
    None), `schedule` must be a `RowTileWorklist`, and `block_n`, `chunk_tiles`, `k_chunk` are
    replaced by the config's knobs. `k_groups` and `shrink_warps` shape the unfused shrink
    (`shrink.shrink_config`).
    """
    if fused:
        config = fused if isinstance(fused, FusedConfig) else FusedConfig()
        lora_fused(x, lora_a, lora_b, y, meta, schedule, scale, offset_start=offset_start,
                   add_inputs=add_inputs, config=config, num_programs=num_programs)
        return
    if partials is None:
        raise ValueError("the unfused launch needs a partials buffer (layout.partials_buffer)")
    config = linear_config(y, x, lora_a, lora_b, offset_start=offset_start, block_n=block_n,
                           chunk_tiles=chunk_tiles, k_chunk=k_chunk, k_groups=k_groups,
                           shrink_warps=shrink_warps)
    launch_linear(config, y, x, partials, meta, schedule, scale, add_inputs=add_inputs, num_programs=num_programs)
