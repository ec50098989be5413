"""One LoRA linear's work: shrink then expand into y, or both in one fused launch (needs Triton)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lora_kernels.expand import CHUNK_TILES, ExpandConfig, expand_config, launch_expand
from lora_kernels.expand import NUM_WARPS as EXPAND_WARPS
from lora_kernels.fused import FusedConfig, lora_fused
from lora_kernels.gridtrim import GridTrimPlan
from lora_kernels.layout import K_CHUNK
from lora_kernels.metadata import LoRABatchMeta
from lora_kernels.shrink import BLOCK_K as SHRINK_BLOCK_K
from lora_kernels.shrink import NUM_STAGES as SHRINK_STAGES
from lora_kernels.shrink import NUM_WARPS as SHRINK_WARPS
from lora_kernels.shrink import ShrinkConfig, launch_shrink, shrink_config
from lora_kernels.worklist import RowTileWorklist


@dataclass(frozen=True)
class LinearKnobs:
    """Tile and launch knobs of the unfused shrink + expand. The defaults are the H200 sweeps'
    choice of 2026-11-30 (benchmarks/results/2026-11-30-kernels.md), which serve_bridge launches with.

    block_n: output columns per expand tile (None: `expand.default_block_n(rank)`); chunk_tiles:
    expand tiles per item; k_chunk: hidden columns per shrink item (one fp32 partial each);
    block_k: hidden columns per step of a shrink item; k_groups: batched dots per shrink hidden
    step (`tiles.shrink_acc`); shrink_warps and expand_warps: warps per program; shrink_stages:
    software-pipelining stages of the shrink's hidden loop.
    """

    block_n: int | None = None
    chunk_tiles: int = CHUNK_TILES
    k_chunk: int = K_CHUNK
    block_k: int = SHRINK_BLOCK_K
    k_groups: int = 1
    shrink_warps: int = SHRINK_WARPS
    shrink_stages: int = SHRINK_STAGES
    expand_warps: int = EXPAND_WARPS

    def __str__(self) -> str:
        return (f"block_n={self.block_n or 'default'} chunk_tiles={self.chunk_tiles} k_chunk={self.k_chunk} "
                f"block_k={self.block_k} k_groups={self.k_groups} warps={self.shrink_warps}/{self.expand_warps} "
                f"stages={self.shrink_stages}")


@dataclass(frozen=True)
class LinearConfig:
    """One LoRA linear's shrink and expand, validated once for its weights and for inputs and
    outputs of one dtype, width and strides (`linear_config`). Building the launch arguments
    costs far more host time than a launch itself; a server builds this once per layer and
    reuses it every step (`launch_linear`)."""

    shrink: ShrinkConfig
    expand: ExpandConfig


def linear_config(y: torch.Tensor, x: torch.Tensor, lora_a: Sequence[torch.Tensor], lora_b: Sequence[torch.Tensor],
                  *, offset_start: int = 0, knobs: LinearKnobs = LinearKnobs()) -> LinearConfig:
    """Validate and precompute `add_lora_linear`'s unfused launches for this layer and these x/y
    layouts (the values of x and y are not read)."""
    return LinearConfig(shrink_config(x, lora_a, knobs.k_chunk, block_k=knobs.block_k, k_groups=knobs.k_groups,
                                      num_warps=knobs.shrink_warps, num_stages=knobs.shrink_stages),
                        expand_config(lora_b, y, offset_start, knobs.block_n, knobs.chunk_tiles,
                                      num_warps=knobs.expand_warps))


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
                    knobs: LinearKnobs = LinearKnobs(), num_programs: int | None = None,
                    fused: bool | FusedConfig = False) -> None:
    """`y[m, slice s cols] (+)= bf(scale · x[m] @ A_s[id_m]ᵀ) @ B_s[id_m]ᵀ` for tokens with an
    adapter, as vLLM's `PunicaWrapperGPU.add_lora_linear`.

    Unfused (default): shrink then expand with `knobs`, through `partials` from
    `layout.partials_buffer(len(lora_a), M, rank, K, k_chunk=knobs.k_chunk)`. `fused=True` (or a
    `FusedConfig`) runs `fused.lora_fused` instead: one launch, `partials` is not used (may be
    None), `schedule` must be a `RowTileWorklist`, and `knobs` are replaced by the config's.
    """
    if fused:
        config = fused if isinstance(fused, FusedConfig) else FusedConfig()
        lora_fused(x, lora_a, lora_b, y, schedule, scale, offset_start=offset_start,
                   add_inputs=add_inputs, config=config, num_programs=num_programs)
        return
    if partials is None:
        raise ValueError("the unfused launch needs a partials buffer (layout.partials_buffer)")
    config = linear_config(y, x, lora_a, lora_b, offset_start=offset_start, knobs=knobs)
    launch_linear(config, y, x, partials, meta, schedule, scale, add_inputs=add_inputs, num_programs=num_programs)
