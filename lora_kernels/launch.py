"""Triton launches without the JIT's per-call work (needs Triton).

``kernel[grid](**kwargs)`` binds every argument, computes the call's specialization and cache key,
checks the kernel's globals and only then launches: about 19 µs of host time per launch on an
H100 host (Triton 3.6, 2026-12-07, benchmarks/results/2026-12-07-chat512-h100-ceiling.md). That
is paid wherever no CUDA graph replays the launch: eager engines, and the steps of a compiled
engine that exceed its largest graph, where GridTrim makes two launches per LoRA linear.

:class:`PreparedLaunch` holds a kernel's arguments that never change (the layer's weights,
strides, tile sizes) and takes the others per call. The first call of each specialization goes
through the JIT, which compiles or finds the kernel and launches it; later calls of that
specialization launch the same compiled kernel through Triton's ``CompiledKernel[grid]`` runner
(8–13 µs there). Semantics: a call launches exactly what ``kernel[grid](**static, **dynamic)``
launches, on the current stream; Triton's launch hooks (``knobs.runtime.launch_enter_hook``, a
profiler's) run as on the JIT's launches, the kernel's own pre-run hooks (none on ours) only on
the JIT's.

The specialization of an argument that changes between calls is the class
:func:`runtime_class` gives it, a refinement of Triton's own (its ``native_specialize_impl``:
a tensor's dtype and 16-byte alignment; an integer's width, divisibility by 16 and whether it is
1), so two calls of one class never need different compiled kernels; a changing ``constexpr``
argument is keyed by its value. The runners are used on Triton versions whose JIT launches with
every argument in signature order (3.6 and later, read in 3.6 and 3.8: ``runtime/jit.py``,
``JITFunction.run``, and ``compiler/compiler.py``, ``CompiledKernel.__getitem__``); elsewhere, and
under Triton's interpreter (``TRITON_INTERPRET=1``), every call goes through ``kernel[grid]``.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import Any, ClassVar

import torch
import triton

RUNNERS = tuple(int(p) for p in triton.__version__.split(".")[:2]) >= (3, 6)


def runtime_class(value: Any) -> Any:
    """What Triton's specialization of a non-constexpr argument depends on, for ``value``."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, bool):  # before int: a bool is an int
        return value
    if isinstance(value, int):
        return value == 1, value % 16 == 0, -2**31 <= value < 2**31, value < 2**63
    if isinstance(value, float):
        return float
    if value is None:
        return None
    raise TypeError(f"no runtime class for a kernel argument of type {type(value).__name__}")


class PreparedLaunch:
    """``kernel`` with ``static`` arguments (and Triton options such as ``num_warps``) fixed; a call
    ``launch(grid, *values)`` gives the ``dynamic`` arguments, in that order (module doc)."""

    def __init__(self, kernel: Any, static: Mapping[str, Any], dynamic: Sequence[str]) -> None:
        names = list(kernel.arg_names)
        unknown = [d for d in dynamic if d not in names]
        missing = [n for n in names if n not in static and n not in dynamic]
        if unknown or missing or set(static) & set(dynamic):
            raise ValueError(f"{getattr(kernel, '__name__', kernel)}: dynamic arguments not in the signature "
                             f"{unknown}, arguments given nowhere {missing}, or given twice")
        self.kernel = kernel
        self.static = dict(static)
        self.dynamic = tuple(dynamic)
        self._template = [self.static.get(n) for n in names]
        self._positions = [names.index(d) for d in self.dynamic]
        params = getattr(kernel, "params", None)  # a JITFunction's; the interpreter's kernels have none
        self.runners = RUNNERS and params is not None
        constexpr = {p.name for p in params or () if p.is_constexpr}
        self._by_value = [d in constexpr for d in self.dynamic]
        self._runners: dict[tuple, Any] = {}

    @property
    def compiled_variants(self) -> int:
        """Specializations launched through a runner so far (each was first launched by the JIT)."""
        return len(self._runners)

    def key(self, grid: tuple[int, ...], values: Sequence[Any]) -> tuple:
        """The call's cache key: the device, the grid, and each dynamic value's class (its value
        for a constexpr)."""
        return (torch.cuda.current_device(), grid,
                *[v if by_value else runtime_class(v) for v, by_value in zip(values, self._by_value)])

    def arguments(self, values: Sequence[Any]) -> list[Any]:
        """Every kernel argument in signature order, ``values`` being the dynamic ones."""
        args = self._template.copy()
        for i, v in zip(self._positions, values):
            args[i] = v
        return args

    def __call__(self, grid: tuple[int, ...], *values: Any) -> None:
        if self.runners:
            key = self.key(grid, values)
            if (runner := self._runners.get(key)) is not None:
                runner(*self.arguments(values))
                return
        compiled = self.kernel[grid](**self.static, **dict(zip(self.dynamic, values)))
        if self.runners and compiled is not None:
            self._runners[key] = compiled[tuple(grid) + (1,) * (3 - len(grid))]


class PreparedKernel:
    """Mixin for a frozen kernel config: a work-list kernel (``kernel``) with the arguments
    ``fixed_arguments()`` gives, launched with the per-call ones named ``DYNAMIC``.

    Semantics: ``launch(grid, *values)`` launches ``kernel[grid](**fixed, **dict(zip(DYNAMIC,
    values)))``. In eager mode (CUDA-graph capture included) through a cached
    :class:`PreparedLaunch`; while torch.compile traces, as that plain call, which Dynamo records
    as a user-defined Triton kernel and Inductor then launches from its own generated code (a
    PreparedLaunch's cache is not traceable)."""

    DYNAMIC: ClassVar[tuple[str, ...]]

    @property
    def kernel(self) -> Any:
        """The Triton kernel (looked up at each use, so that a replaced module attribute is seen)."""
        raise NotImplementedError

    def fixed_arguments(self) -> dict[str, Any]:
        raise NotImplementedError

    @cached_property
    def worklist_launch(self) -> PreparedLaunch:
        """The kernel with :meth:`fixed_arguments` fixed; a call gives ``DYNAMIC``."""
        return PreparedLaunch(self.kernel, self.fixed_arguments(), self.DYNAMIC)

    def launch(self, grid: tuple[int, ...], *values: Any) -> None:
        if torch.compiler.is_compiling():
            self.kernel[grid](**self.fixed_arguments(), **dict(zip(self.DYNAMIC, values)))
        else:
            self.worklist_launch(grid, *values)
