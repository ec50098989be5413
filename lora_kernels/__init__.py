"""Grouped multi-LoRA shrink/expand kernels with three launch designs.

GridTrim (the paper's row-bound grid) and the work list (a persistent launch over the useful row
tiles) run shrink then expand, through a split-K partials buffer; the fused launch walks the same
work list and does both in one launch per op (`fused`).

CPU-safe modules (importable without Triton):
- `metadata`: the per-batch token→slot metadata (vLLM's contract) and a sync-free builder.
- `worklist`: the device-built list of useful row tiles walked by the persistent launch.
- `gridtrim`: the paper's row-bound buckets and two-class expand plan.
- `layout`: weight views and the split-K partials buffer.
- `reference`: pure-torch semantics of shrink and expand.

Triton modules (import them explicitly; they need Triton): `tiles`, `shrink`, `expand`, `fused`,
`linear`, and `launch` (launches through the compiled kernels' runners).
"""
from lora_kernels.gridtrim import GridTrimPlan, plan_gridtrim, row_bound
from lora_kernels.layout import K_CHUNK, as_3d, num_splits, partials_buffer
from lora_kernels.metadata import LoRABatchMeta, build_metadata
from lora_kernels.reference import expand_reference, shrink_reference
from lora_kernels.worklist import RowTileWorklist, persistent_programs

__all__ = [
    "GridTrimPlan", "K_CHUNK", "LoRABatchMeta", "RowTileWorklist", "as_3d", "build_metadata",
    "expand_reference", "num_splits", "partials_buffer", "persistent_programs", "plan_gridtrim",
    "row_bound", "shrink_reference",
]
