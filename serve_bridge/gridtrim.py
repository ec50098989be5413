"""GridTrim behind vLLM's punica contract: our work-list kernels for LoRA linears (DESIGN §4, §6).

Pure torch; importable without vLLM and without Triton (the ``kernels`` Triton modules are
imported on first launch). :mod:`serve_bridge.vllm_punica` is the thin vLLM side that calls it.

Per engine step (eager, outside any CUDA graph), :func:`refresh_worklist` rebuilds the
:class:`~kernels.worklist.RowTileWorklist` from the metadata vLLM has just written
(``LoRAKernelMeta.prepare_tensors``, ``lora/ops/triton_ops/lora_kernel_metadata.py:109-168``,
paths inside the ``vllm`` package 0.26.0). The worklist lists only row tiles of slots whose
adapter id is ≥ 0, so rows mapped to -1 (no adapter, or released by StepTrim) and CUDA-graph
padding rows launch no work. It uses device ops only and static buffers.

Per LoRA linear, :func:`add_lora_linear` runs shrink + expand with the persistent launch. Its
grid does not depend on the batch, and the kernels read the tile count on device. A step with no
adapter rows therefore has ``num_tiles = 0`` and the launch is a no-op, with no host-side
early return, so one captured CUDA graph per batch size replays every adapter mix.
It does not use ``num_active_loras`` (the last element of ``meta_args``) at all.

The launch goes through one custom op, ``torch.ops.lorazor.gridtrim_lora_linear`` (registered
on first use for CPU and CUDA, with a fake kernel). torch.compile (vLLM's default compilation
mode) then treats it as opaque, as vLLM does its own ``torch.ops.vllm.lora_shrink``
(``lora/ops/triton_ops/lora_shrink_op.py:285-291``).

Eligibility (:func:`ineligible_reason`): x, y and every A/B in fp16 or bf16, all of one dtype;
1–3 slices; rank ≤ 64; all A slices of one shape and strides; B slices of that rank with
shared ``[out, rank]`` strides whose widths are ``output_slices``. Any other layer falls back to
vLLM's stock path; the first fallback for each reason logs one warning.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kernels.layout import as_3d, partials_buffer
from kernels.metadata import LoRABatchMeta
from kernels.worklist import RowTileWorklist

# A child of vLLM's "vllm" logger, as serve_bridge.runtime's, so records follow vLLM's logging.
logger = logging.getLogger("vllm.lorazor.gridtrim")

MAX_SLICES = 3
MAX_RANK = 64
DTYPES = (torch.float16, torch.bfloat16)
OP_NAME = "gridtrim_lora_linear"

_warned: set[str] = set()
# Eligibility per layer, keyed by the identity of its stacked-weight tuples (vLLM builds them
# once per layer: lora/layers/base_linear.py:129-150, column_parallel_linear.py:225-246) and the
# activation's dtype and widths; each value keeps the tuples alive, so an id is never reused while
# its entry exists.
_eligibility: dict[tuple, tuple[object, object, str | None]] = {}


def ineligible_reason(y: torch.Tensor, x: torch.Tensor, lora_a: Sequence[torch.Tensor],
                      lora_b: Sequence[torch.Tensor], output_slices: Sequence[int],
                      offset_start: int = 0) -> str | None:
    """Why our kernels cannot run this LoRA linear (None: they can).

    Checks shapes, strides and dtypes only (no data access), so it is cheap and traceable.
    """
    n = len(lora_a)
    if not 1 <= n <= MAX_SLICES:
        return f"{n} LoRA slices (GridTrim supports 1-{MAX_SLICES})"
    if len(lora_b) != n or len(output_slices) != n:
        return f"{n} A slices, {len(lora_b)} B slices and {len(output_slices)} output slices"
    if x.dtype not in DTYPES:
        return f"activations in {x.dtype} (GridTrim needs float16 or bfloat16)"
    if any(w.dtype != x.dtype for w in (*lora_a, *lora_b)):
        return (f"LoRA weights in {sorted({str(w.dtype) for w in (*lora_a, *lora_b)})} with {x.dtype} "
                "activations (GridTrim needs one dtype)")
    if any(w.dim() not in (3, 4) or (w.dim() == 4 and w.size(1) != 1) for w in (*lora_a, *lora_b)):
        return "stacked LoRA weights not of shape [max_loras, (1,) a, b]"
    a3 = [as_3d(a) for a in lora_a]
    b3 = [as_3d(b) for b in lora_b]
    if any(a.shape != a3[0].shape or a.stride() != a3[0].stride() for a in a3):
        return "A slices of different shapes or strides"
    rank, hidden = a3[0].shape[1:]
    if rank > MAX_RANK:
        return f"rank {rank} (GridTrim supports ranks up to {MAX_RANK})"
    if x.shape[-1] != hidden:
        return f"input width {x.shape[-1]} but A has {hidden} columns"
    if any(b.shape[2] != rank or b.stride()[1:] != b3[0].stride()[1:] for b in b3):
        return "B slices of another rank or of different [out, rank] strides"
    if any(b.shape[0] != a3[0].shape[0] for b in b3):
        return "A and B stacks of different adapter counts"
    widths = [b.shape[1] for b in b3]
    if widths != list(output_slices):
        return f"B widths {widths} differ from output_slices {list(output_slices)}"
    if y.shape[-1] < offset_start + sum(widths):
        return f"output has {y.shape[-1]} columns, the slices need {offset_start + sum(widths)}"
    if y.dtype != x.dtype:
        return f"output in {y.dtype} with {x.dtype} activations (GridTrim writes the activations' dtype)"
    if y.device != x.device:
        return "output and input on different devices"
    return None


def _cached_reason(y: torch.Tensor, x: torch.Tensor, lora_a: Sequence[torch.Tensor],
                   lora_b: Sequence[torch.Tensor], output_slices: Sequence[int], offset_start: int) -> str | None:
    """:func:`ineligible_reason`, computed once per layer in eager mode (about 25 µs a call
    otherwise, i.e. ~3 ms per eager step of a 28-layer model); torch.compile traces it once anyway."""
    if torch.compiler.is_compiling():
        return ineligible_reason(y, x, lora_a, lora_b, output_slices, offset_start)
    key = (id(lora_a), id(lora_b), x.dtype, y.dtype, x.shape[-1], y.shape[-1], tuple(output_slices), offset_start,
           x.device, y.device)
    hit = _eligibility.get(key)
    if hit is None or hit[0] is not lora_a or hit[1] is not lora_b:
        hit = (lora_a, lora_b, ineligible_reason(y, x, lora_a, lora_b, output_slices, offset_start))
        _eligibility[key] = hit
    return hit[2]


def warn_fallback_once(reason: str) -> None:
    """One warning per distinct reason (not while torch.compile traces: logging would break
    the graph, so a compiled engine may fall back silently)."""
    if reason in _warned or torch.compiler.is_compiling():
        return
    _warned.add(reason)
    logger.warning("LoRazor GridTrim: a LoRA linear runs vLLM's stock kernels instead: %s.", reason)


def refresh_worklist(worklist: RowTileWorklist, meta_args: Sequence[torch.Tensor]) -> None:
    """Rebuild the work list from vLLM's freshly prepared metadata (device ops only).

    ``meta_args`` is ``LoRAKernelMeta.meta_args(...)``'s tuple (``lora_kernel_metadata.py:
    197-205``); only the per-slot arrays are read, so the token count it was sliced to is
    irrelevant. After ``prepare_tensors`` saw no adapter rows (``:118-126``, which resets the
    slot ids to -1 and the counts to 0 and returns), the list is empty.
    """
    worklist.update(LoRABatchMeta.from_vllm_meta_args(meta_args))


def add_lora_linear(y: torch.Tensor, x: torch.Tensor, lora_a: Sequence[torch.Tensor],
                    lora_b: Sequence[torch.Tensor], scale: float, output_slices: Sequence[int],
                    meta_args: Sequence[torch.Tensor], worklist: RowTileWorklist, *,
                    offset_start: int = 0, add_inputs: bool = True,
                    num_programs: int | None = None) -> bool:
    """vLLM's ``add_lora_linear`` contract (``lora/punica_wrapper/punica_gpu.py:203-264``) on
    our kernels: for rows m whose adapter id ≥ 0, slice s with columns ``[c_s, c_s + N_s)``
    (``c_0 = offset_start``, slices back to back)::

        y[m, c_s:c_s+N_s] = (y[m, ...] if add_inputs else 0) + bf(scale · x[m] @ A_s[id]ᵀ) @ B_s[id]ᵀ

    Other rows of ``y`` (no adapter, CUDA-graph padding) are not touched. ``worklist`` must have
    been refreshed from the same metadata this step. Returns False, after a one-time warning,
    when the layer is not eligible; the caller then runs vLLM's stock path.
    """
    x2 = x.view(-1, x.shape[-1])
    y2 = y.view(-1, y.shape[-1])
    reason = _cached_reason(y2, x2, lora_a, lora_b, output_slices, offset_start)
    if reason is not None:
        warn_fallback_once(reason)
        return False
    meta = LoRABatchMeta.from_vllm_meta_args(meta_args)
    _op()(y2, x2, list(lora_a), list(lora_b), meta.token_lora_mapping, meta.token_indices_sorted,
          meta.num_tokens_per_slot, meta.slot_start_loc, meta.slot_lora_ids, worklist.tile_lora,
          worklist.tile_first, worklist.tile_rows, worklist.num_tiles, worklist.positions,
          worklist.block_m, float(scale), int(offset_start), bool(add_inputs), int(num_programs or 0))
    return True


# -- the custom op ------------------------------------------------------------------------------

_LIB: torch.library.Library | None = None
_OP = None
_SCHEMA = (f"{OP_NAME}(Tensor(a!) y, Tensor x, Tensor[] lora_a, Tensor[] lora_b, Tensor token_lora_mapping, "
           "Tensor token_indices_sorted, Tensor num_tokens_per_slot, Tensor slot_start_loc, Tensor slot_lora_ids, "
           "Tensor tile_lora, Tensor tile_first, Tensor tile_rows, Tensor num_tiles, Tensor positions, "
           "int block_m, float scale, int offset_start, bool add_inputs, int num_programs) -> ()")


def _launch(y: torch.Tensor, x: torch.Tensor, lora_a: list[torch.Tensor], lora_b: list[torch.Tensor],
            token_lora_mapping: torch.Tensor, token_indices_sorted: torch.Tensor,
            num_tokens_per_slot: torch.Tensor, slot_start_loc: torch.Tensor, slot_lora_ids: torch.Tensor,
            tile_lora: torch.Tensor, tile_first: torch.Tensor, tile_rows: torch.Tensor,
            num_tiles: torch.Tensor, positions: torch.Tensor, block_m: int, scale: float,
            offset_start: int, add_inputs: bool, num_programs: int) -> None:
    from kernels.linear import add_lora_linear as kernels_add_lora_linear

    meta = LoRABatchMeta(token_lora_mapping, token_indices_sorted, num_tokens_per_slot, slot_start_loc,
                         slot_lora_ids)
    worklist = RowTileWorklist(block_m, tile_lora, tile_first, tile_rows, num_tiles, positions)
    a3 = as_3d(lora_a[0])
    # Uninitialised: shrink writes every (split, slice, row) that expand reads (kernels/layout.py).
    partials = partials_buffer(len(lora_a), x.shape[0], a3.shape[1], a3.shape[2], x.device)
    kernels_add_lora_linear(y, x, lora_a, lora_b, partials, meta, worklist, scale,
                            offset_start=offset_start, add_inputs=add_inputs,
                            num_programs=num_programs or None)


def _fake(*args: object) -> None:
    """Shape function for torch.compile: the op only mutates ``y`` in place."""
    return None


def _op():
    """``torch.ops.lorazor.gridtrim_lora_linear``, registered once per process."""
    global _LIB, _OP
    if _OP is None:
        if not hasattr(torch.ops.lorazor, OP_NAME):
            lib = torch.library.Library("lorazor", "FRAGMENT")  # the op lives as long as this object
            lib.define(_SCHEMA)
            for key in ("CPU", "CUDA"):
                lib.impl(OP_NAME, _launch, key)
            lib._register_fake(OP_NAME, _fake)
            _LIB = lib
        _OP = getattr(torch.ops.lorazor, OP_NAME)
    return _OP
