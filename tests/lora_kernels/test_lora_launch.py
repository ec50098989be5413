"""lora_kernels.launch on the CPU: the runtime classes against Triton's own specialization, and the
prepared launch's argument list against the kernel's signature (the launches themselves:
tests/gpu/test_lora_ops.py)."""
from __future__ import annotations

import itertools

import pytest
import torch
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend

from lora_kernels import expand, shrink
from lora_kernels.launch import PreparedLaunch, runtime_class
from lora_kernels.linear import linear_config


def _values(gen: torch.Generator) -> list[object]:
    """Integers around every boundary Triton specializes on, random ones, floats, bools, None, and
    tensors of three dtypes at every 2-byte offset of a 16-byte line."""
    edges = [0, 1, 2, 15, 16, 17, 32, -1, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, 2**32, -2**31, -2**31 - 16,
             2**63 - 16, 2**63, 2**64 - 16]
    rand = torch.randint(-2**40, 2**40, (24,), generator=gen).tolist()
    base = torch.zeros(64, dtype=torch.float16)
    tensors = [base[i:] for i in range(8)] + [base.float()[i:] for i in range(4)] + [base.to(torch.int32)[1:]]
    return edges + rand + [0.5, 3.0, True, False, None] + tensors


def test_runtime_class_refines_tritons_specialization(gen: torch.Generator) -> None:
    values = _values(gen)
    for a, b in itertools.combinations(values, 2):
        if runtime_class(a) == runtime_class(b) and type(runtime_class(a)) is type(runtime_class(b)):
            assert native_specialize_impl(BaseBackend, a, False, True, True) == \
                native_specialize_impl(BaseBackend, b, False, True, True), (a, b)


def test_runtime_class_refuses_other_types() -> None:
    with pytest.raises(TypeError, match="str"):
        runtime_class("x")


def _config(gen: torch.Generator):
    x = torch.randn(32, 256, generator=gen).to(torch.bfloat16)
    y = torch.zeros(32, 384, dtype=torch.bfloat16)
    a = [torch.randn(4, 1, 8, 256, generator=gen).to(torch.bfloat16) for _ in range(2)]
    b = [torch.randn(4, 1, 192, 8, generator=gen).to(torch.bfloat16) for _ in range(2)]
    return linear_config(y, x, a, b)


@pytest.mark.parametrize("half", ["shrink", "expand"])
def test_prepared_arguments_follow_the_signature(gen: torch.Generator, half: str) -> None:
    config = getattr(_config(gen), half)
    launch = config.worklist_launch
    kernel = shrink._shrink_worklist_kernel if half == "shrink" else expand._expand_worklist_kernel
    values = [torch.randint(0, 9, (3,), generator=gen) for _ in launch.dynamic]
    args = launch.arguments(values)
    given = {**launch.static, **dict(zip(launch.dynamic, values))}
    assert len(args) == len(kernel.arg_names)
    for name, arg in zip(kernel.arg_names, args):
        assert arg is given[name], name


def test_prepared_launch_refuses_a_wrong_split(gen: torch.Generator) -> None:
    config = _config(gen).shrink
    static = {**config.args, "SLICES": config.slices}
    with pytest.raises(ValueError, match="not in the signature"):
        PreparedLaunch(shrink._shrink_worklist_kernel, static, (*shrink.WORKLIST_DYNAMIC, "nope"))
    with pytest.raises(ValueError, match="given nowhere"):
        PreparedLaunch(shrink._shrink_worklist_kernel, static, shrink.WORKLIST_DYNAMIC[1:])
    with pytest.raises(ValueError, match="twice"):
        PreparedLaunch(shrink._shrink_worklist_kernel, static | {"x_ptr": None}, shrink.WORKLIST_DYNAMIC)
