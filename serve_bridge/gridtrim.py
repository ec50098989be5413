"""GridTrim behind vLLM's punica contract: our work-list kernels for LoRA linears (docs/design.md §4, §6).

Pure torch; importable without vLLM and without Triton (the ``lora_kernels`` Triton modules load on
first launch). :mod:`serve_bridge.vllm.punica_wrapper` is the vLLM side that calls it.

Per engine step, the :class:`~lora_kernels.worklist.RowTileWorklist` is rebuilt from the step's LoRA
metadata (:func:`refresh_worklist`, or on the host by :mod:`serve_bridge.punica_meta`). It holds only
row tiles of slots whose adapter id is ≥ 0, so rows mapped to -1 (no adapter, or released by
StepTrim) and CUDA-graph padding rows launch no work. Per LoRA linear, :func:`add_lora_linear`
runs shrink + expand with a persistent grid that does not depend on the batch; the kernels read
the tile count on the device, so a step with no adapter rows is a no-op without a host-side early
return, and one captured CUDA graph per batch size replays every adapter mix. ``num_active_loras``
is not used. :func:`shrink` and :func:`expand` are the ``add_shrink`` / ``add_expand`` halves, with
vLLM's fp32 ``[slices, M, rank]`` buffer between them, for the tensor-parallel paths that
communicate in between (docs/vllm_integration.md §5).

Under torch.compile, ``compiled_launch`` picks how a forward's launches are traced. ``"ops"`` (the
default): through the custom ops ``torch.ops.lorazor.gridtrim_lora_linear``, ``gridtrim_shrink`` and
``gridtrim_expand``, registered when this module is imported (never while a forward is traced):
opaque to the compiler, each declares that it mutates ``y`` and has a fake kernel. ``"inductor"``:
Dynamo traces the implementations, records each kernel call as a user-defined Triton kernel (its
mutated arguments found from the kernel's code) and Inductor launches it from the compiled graph's
own code, without the dispatcher and our per-call Python in steps past the CUDA graphs
(docs/vllm_integration.md §4c). In eager mode the implementations are called directly, each
layer's launch arguments built once.

Eligibility (:func:`ineligible_reason`): x, y and every A/B in fp16 or bf16, all of one dtype;
1–3 slices; rank ≤ 64; all A slices of one shape and strides; B slices of that rank with shared
``[out, rank]`` strides whose widths are ``output_slices``. :func:`shrink_ineligible_reason` and
:func:`expand_ineligible_reason` check the A or B half. Any other layer falls back to vLLM's stock
path; the first fallback for each reason logs one warning.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from lora_kernels.layout import as_3d, partials_buffer
from lora_kernels.metadata import LoRABatchMeta
from lora_kernels.worklist import RowTileWorklist

# A child of vLLM's "vllm" logger, as serve_bridge.runtime's, so records follow vLLM's logging.
logger = logging.getLogger("vllm.lorazor.gridtrim")

MAX_SLICES = 3
MAX_RANK = 64
DTYPES = (torch.float16, torch.bfloat16)
OP_NAME = "gridtrim_lora_linear"
SHRINK_OP = "gridtrim_shrink"
EXPAND_OP = "gridtrim_expand"

_T = TypeVar("_T")
# How a compiled forward launches the kernels (module doc): through the custom ops, or traced by Dynamo.
COMPILED_LAUNCHES = ("ops", "inductor")
DEFAULT_LAUNCH = COMPILED_LAUNCHES[0]  # LORAZOR_GRIDTRIM_LAUNCH unset
_warned: set[tuple[str, str]] = set()
# Eligibility per layer (and, for LoRA linears, the launch config it allows), keyed by the identity
# of its stacked-weight tensors (vLLM allocates them once per layer) and the activation's dtype, widths and strides;
# each value keeps the tensors alive, so an id is never reused while its entry exists.
_eligibility: dict[tuple, tuple[tuple[object, ...], Any]] = {}
_CACHE_LIMIT = 4096  # entries; a model has ~100 LoRA layers of a few layouts each, so only churn reaches it


def _slices_reason(n: int) -> str | None:
    return None if 1 <= n <= MAX_SLICES else f"{n} LoRA slices (GridTrim supports 1-{MAX_SLICES})"


def _weights_reason(dtype: torch.dtype, weights: Sequence[torch.Tensor], of: str) -> str | None:
    """All stacked weights in ``dtype`` (fp16/bf16) and of vLLM's stacked shape; ``of`` names
    what sets the dtype, for the message."""
    if dtype not in DTYPES:
        return f"{of} in {dtype} (GridTrim needs float16 or bfloat16)"
    if any(w.dtype != dtype for w in weights):
        return (f"LoRA weights in {sorted({str(w.dtype) for w in weights})} with {dtype} {of} "
                "(GridTrim needs one dtype)")
    if any(w.dim() not in (3, 4) or (w.dim() == 4 and w.size(1) != 1) for w in weights):
        return "stacked LoRA weights not of shape [max_loras, (1,) a, b]"
    return None


def _a_reason(x: torch.Tensor, a3: Sequence[torch.Tensor]) -> str | None:
    """A slices (3-D views) that shrink can read with x: one shape and strides, rank ≤ MAX_RANK,
    x's width."""
    if any(a.shape != a3[0].shape or a.stride() != a3[0].stride() for a in a3):
        return "A slices of different shapes or strides"
    rank, hidden = a3[0].shape[1:]
    if rank > MAX_RANK:
        return f"rank {rank} (GridTrim supports ranks up to {MAX_RANK})"
    if x.shape[-1] != hidden:
        return f"input width {x.shape[-1]} but A has {hidden} columns"
    return None


def _b_reason(b3: Sequence[torch.Tensor], rank: int, n_adapters: int, output_slices: Sequence[int],
              y: torch.Tensor, offset_start: int) -> str | None:
    """B slices (3-D views) that expand can apply into y's columns from ``offset_start``."""
    if rank > MAX_RANK:
        return f"rank {rank} (GridTrim supports ranks up to {MAX_RANK})"
    if any(b.shape[2] != rank or b.stride()[1:] != b3[0].stride()[1:] for b in b3):
        return "B slices of another rank or of different [out, rank] strides"
    if any(b.shape[0] != n_adapters for b in b3):
        return "A and B stacks of different adapter counts"
    widths = [b.shape[1] for b in b3]
    if widths != list(output_slices):
        return f"B widths {widths} differ from output_slices {list(output_slices)}"
    if y.shape[-1] < offset_start + sum(widths):
        return f"output has {y.shape[-1]} columns, the slices need {offset_start + sum(widths)}"
    return None


def ineligible_reason(y: torch.Tensor, x: torch.Tensor, lora_a: Sequence[torch.Tensor],
                      lora_b: Sequence[torch.Tensor], output_slices: Sequence[int],
                      offset_start: int = 0) -> str | None:
    """Why our kernels cannot run this LoRA linear (None: they can).

    Checks shapes, strides and dtypes only (no data access), so it is cheap and traceable.
    """
    n = len(lora_a)
    reason = _slices_reason(n)
    if reason is None and (len(lora_b) != n or len(output_slices) != n):
        reason = f"{n} A slices, {len(lora_b)} B slices and {len(output_slices)} output slices"
    reason = reason or _weights_reason(x.dtype, (*lora_a, *lora_b), "activations")
    if reason is not None:
        return reason
    a3 = [as_3d(a) for a in lora_a]
    reason = _a_reason(x, a3) or _b_reason([as_3d(b) for b in lora_b], a3[0].shape[1], a3[0].shape[0],
                                           output_slices, y, offset_start)
    if reason is not None:
        return reason
    if y.dtype != x.dtype:
        return f"output in {y.dtype} with {x.dtype} activations (GridTrim writes the activations' dtype)"
    if y.device != x.device:
        return "output and input on different devices"
    return None


def shrink_ineligible_reason(y: torch.Tensor, x: torch.Tensor, lora_a: Sequence[torch.Tensor]) -> str | None:
    """Why our kernels cannot run this ``add_shrink`` (None: they can): x ``[M, K]`` fp16/bf16,
    1–3 A slices as :func:`ineligible_reason` wants them, y vLLM's fp32 buffer
    ``[slices, M, rank]``."""
    reason = _static_shrink_reason(x, lora_a)
    if reason is not None:
        return reason
    return _shrink_output_reason(y, x, as_3d(lora_a[0]).shape[1], len(lora_a))


def _static_shrink_reason(x: torch.Tensor, lora_a: Sequence[torch.Tensor]) -> str | None:
    """The per-layer part of :func:`shrink_ineligible_reason` (weights against x's dtype and width)."""
    reason = _slices_reason(len(lora_a)) or _weights_reason(x.dtype, lora_a, "activations")
    if reason is not None:
        return reason
    return _a_reason(x, [as_3d(a) for a in lora_a])


def _shrink_output_reason(y: torch.Tensor, x: torch.Tensor, rank: int, slices: int) -> str | None:
    """The per-call part: y's dtype, shape and device (x.size(0) changes every step)."""
    if y.dtype != torch.float32:
        return f"shrink output in {y.dtype} (GridTrim writes vLLM's float32 buffer)"
    if tuple(y.shape) != (slices, x.shape[0], rank):
        return f"shrink output of shape {tuple(y.shape)}, expected [{slices}, {x.shape[0]}, {rank}]"
    if y.device != x.device:
        return "output and input on different devices"
    return None


def expand_ineligible_reason(y: torch.Tensor, x: torch.Tensor, lora_b: Sequence[torch.Tensor],
                             output_slices: Sequence[int], offset_start: int = 0) -> str | None:
    """Why our kernels cannot run this ``add_expand`` (None: they can): x the fp32 shrink buffer
    ``[slices, M, rank]``, 1–3 B slices of one fp16/bf16
    dtype, rank ≤ 64, widths ``output_slices``, y ``[M, ≥ offset_start + Σ widths]`` in B's dtype."""
    reason = _static_expand_reason(y, x, lora_b, output_slices, offset_start)
    if reason is not None:
        return reason
    return _expand_io_reason(y, x, len(lora_b))


def _static_expand_reason(y: torch.Tensor, x: torch.Tensor, lora_b: Sequence[torch.Tensor],
                          output_slices: Sequence[int], offset_start: int) -> str | None:
    """The per-layer part of :func:`expand_ineligible_reason` (weights against the widths, y's
    columns and dtype, the buffer's rank and dtype)."""
    n = len(lora_b)
    reason = _slices_reason(n)
    if reason is None and len(output_slices) != n:
        reason = f"{n} B slices and {len(output_slices)} output slices"
    reason = reason or _weights_reason(lora_b[0].dtype, lora_b, "LoRA B")
    if reason is not None:
        return reason
    if x.dtype != torch.float32 or x.dim() != 3:
        return f"expand input in {x.dtype} of {x.dim()} dims (GridTrim reads vLLM's float32 [slices, M, rank] buffer)"
    b3 = [as_3d(b) for b in lora_b]
    reason = _b_reason(b3, x.shape[-1], b3[0].shape[0], output_slices, y, offset_start)
    if reason is not None:
        return reason
    if y.dtype != b3[0].dtype:
        return f"output in {y.dtype} with LoRA B in {b3[0].dtype} (GridTrim writes B's dtype)"
    return None


def _expand_io_reason(y: torch.Tensor, x: torch.Tensor, slices: int) -> str | None:
    """The per-call part: the buffer's slices and rows against y (the token count changes every step)."""
    if x.shape[0] != slices or x.shape[1] != y.shape[0]:
        return f"expand input of shape {tuple(x.shape)} for {slices} slices and an output of {y.shape[0]} rows"
    if y.device != x.device:
        return "output and input on different devices"
    return None


def _cached(weights: tuple[torch.Tensor, ...], key: tuple, compute: Callable[[], _T]) -> _T:
    """``compute()`` (an eligibility check, with the launch arguments it allows), once per layer
    and layout, in eager mode and in a compiled graph's op calls (about 25 µs a call otherwise for
    the check alone, i.e. ~3 ms per eager step of a 28-layer model); torch.compile traces it once
    anyway.

    ``weights`` are the layer's stacked-weight tensors (keyed by identity, kept alive by the
    entry: the same tensors whatever sequence the caller holds them in), ``key`` the rest of what
    the result depends on."""
    if torch.compiler.is_compiling():
        return compute()
    full = (*map(id, weights), *key)
    hit = _eligibility.get(full)
    if hit is None or any(a is not b for a, b in zip(hit[0], weights)):
        if len(_eligibility) >= _CACHE_LIMIT:  # weights that are new objects every call: stay bounded
            _eligibility.clear()
        hit = (weights, compute())
        _eligibility[full] = hit
    return hit[1]


def _plan(weights: tuple[torch.Tensor, ...], key: tuple, reason: Callable[[], str | None],
          config: Callable[[], Any]) -> tuple[str | None, Any]:
    """(``reason()``, and when None the layer's launch config ``config()``) once per layer and
    layout through :func:`_cached`; while torch.compile traces, the reason alone (the op path
    rebuilds the config at run time, the traced implementation in the trace: keep the cache out of
    the trace)."""
    if torch.compiler.is_compiling():
        return reason(), None

    def compute() -> tuple[str | None, Any]:
        why = reason()
        return (why, None) if why is not None else (None, config())

    return _cached(weights, key, compute)


def _linear_plan(y: torch.Tensor, x: torch.Tensor, lora_a: Sequence[torch.Tensor],
                 lora_b: Sequence[torch.Tensor], output_slices: Sequence[int],
                 offset_start: int) -> tuple[str | None, Any]:
    """(:func:`ineligible_reason`, and when None the layer's ``lora_kernels.linear.LinearConfig`` for
    x and y of these layouts) through the per-layer cache. Building the launch arguments costs
    about 0.2 ms of Python per call on the development CPU, the same order as the GPU host's
    measured per-call cost in eager steps (``benchmarks/results/2026-11-29-host-path.md``, 2026-11-29)."""
    def config() -> Any:
        from lora_kernels.linear import linear_config

        return linear_config(y, x, lora_a, lora_b, offset_start=offset_start)

    key = ("linear", x.dtype, y.dtype, x.shape[-1], y.shape[-1], x.stride(), y.stride(), tuple(output_slices),
           offset_start, x.device, y.device)
    return _plan((*lora_a, *lora_b), key, lambda: ineligible_reason(y, x, lora_a, lora_b, output_slices, offset_start),
                 config)


def _shrink_plan(x: torch.Tensor, lora_a: Sequence[torch.Tensor]) -> tuple[str | None, Any]:
    """(the per-layer part of :func:`shrink_ineligible_reason`, and when None the layer's
    ``lora_kernels.shrink.ShrinkConfig`` for x of this layout) through the per-layer cache."""
    def config() -> Any:
        from lora_kernels.shrink import shrink_config

        return shrink_config(x, lora_a)

    return _plan(tuple(lora_a), ("shrink", x.dtype, x.shape[-1], x.stride(), x.device),
                 lambda: _static_shrink_reason(x, lora_a), config)


def _expand_plan(y: torch.Tensor, x: torch.Tensor, lora_b: Sequence[torch.Tensor], output_slices: Sequence[int],
                 offset_start: int) -> tuple[str | None, Any]:
    """(the per-layer part of :func:`expand_ineligible_reason`, and when None the layer's
    ``lora_kernels.expand.ExpandConfig`` for y of this layout) through the per-layer cache."""
    def config() -> Any:
        from lora_kernels.expand import expand_config

        return expand_config(lora_b, y, offset_start)

    key = ("expand", x.dtype, x.dim(), x.shape[-1], y.dtype, y.shape[-1], y.stride(), tuple(output_slices),
           offset_start, x.device)
    return _plan(tuple(lora_b), key, lambda: _static_expand_reason(y, x, lora_b, output_slices, offset_start), config)


def warn_fallback_once(reason: str, what: str = "a LoRA linear") -> None:
    """One warning per distinct (``what``, reason) (not while torch.compile traces: logging would
    break the graph, so a compiled engine may fall back silently)."""
    if (what, reason) in _warned or torch.compiler.is_compiling():
        return
    _warned.add((what, reason))
    logger.warning("LoRazor GridTrim: %s runs vLLM's stock kernels instead: %s.", what, reason)


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, width]``: itself when already 2-D. A view node in a traced graph costs
    nothing in eager mode, but a user-defined Triton kernel that writes through one may make
    Inductor copy the tensor before and after the launch."""
    return t if t.dim() == 2 else t.view(-1, t.shape[-1])


def refresh_worklist(worklist: RowTileWorklist, meta_args: Sequence[torch.Tensor]) -> None:
    """Rebuild the work list from vLLM's freshly prepared metadata (device ops only).

    ``meta_args`` is ``LoRAKernelMeta.meta_args(...)``'s tuple; only the per-slot arrays are read,
    so the token count it was sliced to is irrelevant. After a step without adapter rows (slot ids
    -1, counts 0) the list is empty.
    """
    worklist.update(LoRABatchMeta.from_vllm_meta_args(meta_args))


def _call(name: str, head: tuple, meta_args: Sequence[torch.Tensor], worklist: RowTileWorklist,
          tail: tuple, compiled_launch: str, **eager: Any) -> None:
    """Run op ``name`` on ``head`` (the output, the input, the weights), the step's metadata and
    work list, and ``tail`` (its scalars, typed as in its schema). In eager mode (CUDA-graph capture
    included) its implementation is called directly, with the ``eager`` keywords (a cached launch
    config), skipping the dispatcher's per-call cost (about 15 µs on the development CPU, for ~113
    calls per eager step). While torch.compile traces, ``compiled_launch`` decides: ``"ops"`` calls
    ``torch.ops.lorazor.<name>``, opaque to the tracer; ``"inductor"`` traces the implementation,
    whose kernel calls Dynamo records as user-defined Triton kernels that Inductor launches."""
    if compiled_launch not in COMPILED_LAUNCHES:
        raise ValueError(f"compiled_launch={compiled_launch!r}: use one of {COMPILED_LAUNCHES}")
    meta = LoRABatchMeta.from_vllm_meta_args(meta_args)
    if not torch.compiler.is_compiling():
        _DIRECT[name][0](*head, meta, worklist, *tail, **eager)
    elif compiled_launch == "ops":
        _OPS[name](*op_arguments(head, meta, worklist, tail))
    else:  # traced: the implementation builds its launch config in the trace
        _DIRECT[name][0](*head, meta, worklist, *tail)


def op_arguments(head: tuple, meta: LoRABatchMeta, worklist: RowTileWorklist, tail: tuple) -> tuple:
    """The flat arguments of ``torch.ops.lorazor.<name>`` (its schema's order), as a compiled graph
    passes them at run time: ``head`` (y, x, then the weight sequences as lists), the metadata and
    work-list tensors, ``block_m``, then ``tail``."""
    return (*head[:2], *map(list, head[2:]), *meta.vllm_meta_args(), worklist.tile_lora, worklist.tile_tokens,
            worklist.num_tiles, worklist.positions, worklist.block_m, *tail)


def add_lora_linear(y: torch.Tensor, x: torch.Tensor, lora_a: Sequence[torch.Tensor],
                    lora_b: Sequence[torch.Tensor], scale: float, output_slices: Sequence[int],
                    meta_args: Sequence[torch.Tensor], worklist: RowTileWorklist, *,
                    offset_start: int = 0, add_inputs: bool = True,
                    num_programs: int | None = None, compiled_launch: str = DEFAULT_LAUNCH) -> bool:
    """vLLM's ``add_lora_linear`` contract on our kernels: for rows m whose adapter id ≥ 0, slice s with columns ``[c_s, c_s + N_s)``
    (``c_0 = offset_start``, slices back to back)::

        y[m, c_s:c_s+N_s] = (y[m, ...] if add_inputs else 0) + bf(scale · x[m] @ A_s[id]ᵀ) @ B_s[id]ᵀ

    Other rows of ``y`` (no adapter, CUDA-graph padding) are not touched. ``worklist`` must have
    been refreshed from the same metadata this step. Returns False, after a one-time warning,
    when the layer is not eligible; the caller then runs vLLM's stock path. ``compiled_launch``
    (``"ops"`` or ``"inductor"``): how a torch.compile trace launches the kernels (module doc).
    """
    x2, y2 = as_rows(x), as_rows(y)
    reason, config = _linear_plan(y2, x2, lora_a, lora_b, output_slices, offset_start)
    if reason is not None:
        warn_fallback_once(reason)
        return False
    _call(OP_NAME, (y2, x2, lora_a, lora_b), meta_args, worklist,
          (float(scale), int(offset_start), bool(add_inputs), int(num_programs or 0)), compiled_launch,
          config=config)
    return True


def shrink(y: torch.Tensor, x: torch.Tensor, lora_a: Sequence[torch.Tensor], scale: float,
           meta_args: Sequence[torch.Tensor], worklist: RowTileWorklist, *,
           num_programs: int | None = None, compiled_launch: str = DEFAULT_LAUNCH) -> bool:
    """vLLM's ``add_shrink`` contract on our kernels::

        y[s, m] = scale · x[m] @ A_s[id_m]ᵀ   (fp32) for rows m whose adapter id ≥ 0, else 0

    x ``[M, K]`` (fp16/bf16), y the fp32 buffer ``[slices, M, rank]``; as with the stock op, the
    result *replaces* y. The fully-sharded tensor-parallel paths call it on a rank's A shard and
    then all-gather or all-reduce y. Returns False, after a one-time warning, when ineligible.
    ``compiled_launch`` as in :func:`add_lora_linear`.
    """
    x2 = as_rows(x)
    if isinstance(lora_a, torch.Tensor):  # a bare tensor: one slice
        lora_a = (lora_a,)
    reason, config = _shrink_plan(x2, lora_a)
    if reason is None:
        reason = _shrink_output_reason(y, x2, as_3d(lora_a[0]).shape[1], len(lora_a))
    if reason is not None:
        warn_fallback_once(reason, "a LoRA shrink (add_shrink)")
        return False
    _call(SHRINK_OP, (y, x2, lora_a), meta_args, worklist, (float(scale), int(num_programs or 0)), compiled_launch,
          config=config)
    return True


def expand(y: torch.Tensor, x: torch.Tensor, lora_b: Sequence[torch.Tensor], output_slices: Sequence[int],
           meta_args: Sequence[torch.Tensor], worklist: RowTileWorklist, *, offset_start: int = 0,
           add_inputs: bool = True, num_programs: int | None = None, compiled_launch: str = DEFAULT_LAUNCH) -> bool:
    """vLLM's ``add_expand`` contract on our kernels: for rows m whose adapter id ≥ 0,
    slice s with columns ``[c_s, c_s + N_s)`` (``c_0 = offset_start``, slices back to back)::

        y[m, c_s:c_s+N_s] = (y[m, ...] if add_inputs else 0) + bf(x[s, m]) @ B_s[id_m]ᵀ

    x the fp32 shrink buffer ``[slices, M, rank]``; bf casts it to B's dtype, as the stock op
    does (``CAST_TYPE``). Other rows of y are not touched. Under tensor parallelism x is the
    all-gathered (fully-sharded column-parallel, full rank, ``offset_start`` 0) or all-reduced
    (fully-sharded row-parallel, ``offset_start`` = rank · shard width) buffer and B the rank's
    output shard. Returns False, after a one-time warning,
    when ineligible. ``compiled_launch`` as in :func:`add_lora_linear`.
    """
    y2 = as_rows(y)
    if isinstance(lora_b, torch.Tensor):
        lora_b = (lora_b,)
    reason, config = _expand_plan(y2, x, lora_b, output_slices, offset_start)
    if reason is None:
        reason = _expand_io_reason(y2, x, len(lora_b))
    if reason is not None:
        warn_fallback_once(reason, "a LoRA expand (add_expand)")
        return False
    _call(EXPAND_OP, (y2, x, lora_b), meta_args, worklist,
          (int(offset_start), bool(add_inputs), int(num_programs or 0)), compiled_launch, config=config)
    return True


# -- the custom ops -----------------------------------------------------------------------------

_META = ("Tensor token_lora_mapping, Tensor token_indices_sorted, Tensor num_tokens_per_slot, Tensor slot_start_loc, "
         "Tensor slot_lora_ids, Tensor tile_lora, Tensor tile_tokens, Tensor num_tiles, "
         "Tensor positions, int block_m")
# Each op mutates y in place (``Tensor(a!)``) and returns nothing, so torch.compile functionalizes
# the call and keeps it opaque; the fake kernel (:func:`_fake`) has nothing to allocate.
OP_SCHEMAS = {
    OP_NAME: (f"{OP_NAME}(Tensor(a!) y, Tensor x, Tensor[] lora_a, Tensor[] lora_b, {_META}, float scale, "
              "int offset_start, bool add_inputs, int num_programs) -> ()"),
    SHRINK_OP: f"{SHRINK_OP}(Tensor(a!) y, Tensor x, Tensor[] lora_a, {_META}, float scale, int num_programs) -> ()",
    EXPAND_OP: (f"{EXPAND_OP}(Tensor(a!) y, Tensor x, Tensor[] lora_b, {_META}, int offset_start, bool add_inputs, "
                "int num_programs) -> ()"),
}

def _linear(y: torch.Tensor, x: torch.Tensor, lora_a: Sequence[torch.Tensor], lora_b: Sequence[torch.Tensor],
            meta: LoRABatchMeta, worklist: RowTileWorklist, scale: float, offset_start: int, add_inputs: bool,
            num_programs: int, config: Any = None) -> None:
    """``gridtrim_lora_linear``: shrink then expand through an uninitialised partials buffer (shrink
    writes every (split, slice, row) that expand reads, lora_kernels/layout.py). ``config``: the layer's
    ``lora_kernels.linear.LinearConfig`` for these x/y layouts (built here when None, as under the op)."""
    from lora_kernels.linear import launch_linear, linear_config

    if config is None:
        config = linear_config(y, x, lora_a, lora_b, offset_start=offset_start)
    sh = config.shrink
    partials = partials_buffer(sh.slices, x.shape[0], sh.rank, sh.args["K"], x.device, k_chunk=sh.args["K_CHUNK"])
    launch_linear(config, y, x, partials, meta, worklist, scale, add_inputs=add_inputs,
                  num_programs=num_programs or None)


def _shrink(y: torch.Tensor, x: torch.Tensor, lora_a: list[torch.Tensor], meta: LoRABatchMeta,
            worklist: RowTileWorklist, scale: float, num_programs: int, config: Any = None) -> None:
    """``gridtrim_shrink``: y (fp32 ``[slices, M, rank]``) = the shrink, 0 on rows without adapter.

    With one hidden chunk (``K ≤ K_CHUNK``) the kernel writes straight into y (a view as
    ``[1, slices, M, rank]`` partials); otherwise into zeroed split-K partials, summed into y.
    ``config``: the layer's ``lora_kernels.shrink.ShrinkConfig`` for x's layout (built here when None)."""
    from lora_kernels.shrink import launch_shrink, shrink_config

    if config is None:
        config = shrink_config(x, lora_a)
    if config.splits == 1:
        y.zero_()
        partials = y.unsqueeze(0)
    else:
        partials = torch.zeros(config.splits, config.slices, x.shape[0], config.rank, dtype=torch.float32,
                               device=x.device)
    launch_shrink(config, x, partials, meta, worklist, scale, num_programs=num_programs or None)
    if config.splits > 1:
        torch.sum(partials, dim=0, out=y)


def _expand(y: torch.Tensor, x: torch.Tensor, lora_b: list[torch.Tensor], meta: LoRABatchMeta,
            worklist: RowTileWorklist, offset_start: int, add_inputs: bool, num_programs: int,
            config: Any = None) -> None:
    """``gridtrim_expand``: y's slices (+)= bf(x[s]) @ B_s[id]ᵀ on rows with an adapter. ``config``:
    the layer's ``lora_kernels.expand.ExpandConfig`` for y's layout (built here when None)."""
    from lora_kernels.expand import expand_config, launch_expand

    if config is None:
        config = expand_config(lora_b, y, offset_start)
    launch_expand(config, x.unsqueeze(0), y, meta, worklist, add_inputs=add_inputs, num_programs=num_programs or None)


# op name → (implementation, number of leading arguments before the metadata)
_DIRECT: dict[str, tuple[Callable[..., None], int]] = {OP_NAME: (_linear, 4), SHRINK_OP: (_shrink, 3),
                                                         EXPAND_OP: (_expand, 3)}
_N_META = 9  # metadata and work-list tensors in each schema, then block_m


def _op_impl(name: str) -> Callable[..., None]:
    """The registered kernel of op ``name``: rebuilds the metadata and work list from the schema's
    flat arguments and calls the implementation (the linear op with its layer's cached launch
    config, the eager path's)."""
    impl, n_head = _DIRECT[name]

    def run(*args: object) -> None:
        tensors = args[n_head:n_head + _N_META]
        block_m = args[n_head + _N_META]
        meta, worklist = LoRABatchMeta(*tensors[:5]), RowTileWorklist(block_m, *tensors[5:])
        tail = args[n_head + _N_META + 1:]
        # the layer's cached launch config, as the eager path reads it (the traced call was eligible)
        impl(*args[:n_head], meta, worklist, *tail, config=_op_config(name, args[:n_head], tail))

    return run


def _op_config(name: str, head: tuple, tail: tuple) -> Any:
    """The cached launch config of op ``name``'s layer for these arguments (``head``: y, x and the
    weights; ``tail``: the schema's scalars). B's output widths are its shape ``[L, (1,) out, rank]``."""
    if name == SHRINK_OP:
        return _shrink_plan(head[1], head[2])[1]
    widths = tuple(b.shape[-2] for b in head[-1])
    if name == EXPAND_OP:
        return _expand_plan(head[0], head[1], head[2], widths, tail[0])[1]
    return _linear_plan(*head, widths, tail[1])[1]


def _fake(*args: object) -> None:
    """The fake (meta) kernel for torch.compile: the ops only mutate ``y`` in place."""
    return None


def _register() -> dict[str, Any]:
    """Define ``torch.ops.lorazor.<name>`` for the three ops (CPU and CUDA kernels, fake kernels).

    Runs when this module is imported, so that nothing is registered while torch.compile traces a
    forward (Dynamo refuses to trace ``torch.library.Library``). An op already defined in this
    process (the module imported again under another name) is kept."""
    global _LIB
    missing = [n for n in OP_SCHEMAS if not hasattr(torch.ops.lorazor, n)]
    if missing:
        _LIB = torch.library.Library("lorazor", "FRAGMENT")  # the ops live as long as this object
        for name in missing:
            _LIB.define(OP_SCHEMAS[name])
            for key in ("CPU", "CUDA"):
                _LIB.impl(name, _op_impl(name), key)
            torch.library.register_fake(f"lorazor::{name}", _fake, lib=_LIB)
    return {name: getattr(torch.ops.lorazor, name) for name in OP_SCHEMAS}


_LIB: torch.library.Library | None = None
_OPS = _register()
