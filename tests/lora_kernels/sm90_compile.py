"""Compile every kernel launch of one qkv-shaped layer op, and StepTrim's decision kernel, for sm_90
without a GPU.

Run as a script (`python tests/lora_kernels/sm90_compile.py`, TRITON_INTERPRET unset): it calls the
host ops (shrink, expand, fused) on CPU tensors with the kernels' launchers replaced by
recorders, then compiles each recorded launch with Triton's ahead-of-time path for an H100/H200
target. Catches GPU codegen
errors (layouts, tl.dot shapes, pointer selects) that the interpreter does not see, and fails if
an expand kernel loads B two bytes at a time instead of in 16-byte vectors or adds to y other than
in 16-byte atomic adds. For each work-list launch (the ones a torch.compile'd forward makes under
``LORAZOR_GRIDTRIM_LAUNCH=inductor``) it also checks that torch's analysis of a user-defined Triton
kernel takes it to write its output alone: a tensor wrongly taken as written is cloned and copied
back around every compiled launch (docs/vllm_integration.md §4c).
"""
from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import triton  # noqa: E402
from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import BaseBackend, GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from lora_kernels import expand, fused, shrink, steptrim  # noqa: E402
from lora_kernels.gridtrim import plan_gridtrim  # noqa: E402
from lora_kernels.layout import partials_buffer  # noqa: E402
from lora_kernels.metadata import build_metadata  # noqa: E402
from lora_kernels.worklist import RowTileWorklist  # noqa: E402

class _Recorder:
    """Stands in for `kernel[grid]`: records the launch's keyword arguments. It has the kernel's
    `arg_names` but no `params`, so `lora_kernels.launch.PreparedLaunch` launches through it as
    through Triton's interpreter."""

    def __init__(self, fn: triton.JITFunction, launches: list) -> None:
        self.fn, self.launches = fn, launches
        self.arg_names = fn.arg_names

    def __getitem__(self, grid: tuple) -> Any:
        return lambda **kw: self.launches.append((self.fn, kw))


WRITES = {"_shrink_worklist_kernel": {"part_ptr"}, "_expand_worklist_kernel": {"y_ptr"},
          "_fused_worklist_kernel": {"y_ptr"}, "_shrink_grid_kernel": {"part_ptr"},
          "_expand_grid_kernel": {"y_ptr"}}  # what each kernel writes


class _Sm90:
    """Triton's active driver as far as torch's kernel analysis asks: an sm_90 target, no GPU."""

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)


def _written(fn: triton.JITFunction, kwargs: dict[str, Any]) -> set[str]:
    """The tensor arguments that torch.compile takes this launch to write (Inductor's TTIR analysis,
    ``identify_accessed_tensors``; every tensor when that analysis fails)."""
    from torch._higher_order_ops.triton_kernel_wrap import identify_accessed_tensors

    args = {k: v for k, v in kwargs.items() if k in fn.arg_names}
    accesses = identify_accessed_tensors(fn, args, {})
    return {dep.name for dep in accesses.read_writes.writes if isinstance(args.get(dep.name), torch.Tensor)}


def _compile(fn: triton.JITFunction, kwargs: dict[str, Any]) -> Any:
    """Compile one launch with the JIT's own specialization (ints equal to 1 become
    constexprs, 16-divisible ints and pointers get divisibility hints)."""
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(fn.params):
        value = kwargs[param.name]
        if param.is_constexpr:
            signature[param.name], constexprs[(i,)] = "constexpr", value
            continue
        kind, spec = native_specialize_impl(BaseBackend, value, False, True, True)
        signature[param.name] = kind
        if kind == "constexpr":
            constexprs[(i,)] = spec
        elif isinstance(spec, str):
            attrs[(i,)] = BaseBackend.parse_attr(spec)
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": kwargs["num_warps"],
                                   "num_stages": kwargs.get("num_stages", 3)})


def main() -> None:
    launches: list = []
    for mod, names in ((shrink, ("_shrink_worklist_kernel", "_shrink_grid_kernel")),
                       (expand, ("_expand_worklist_kernel", "_expand_grid_kernel")),
                       (fused, ("_fused_worklist_kernel",)), (steptrim, ("_steptrim_kernel",))):
        for name in names:
            setattr(mod, name, _Recorder(getattr(mod, name), launches))
    m, loras = 64, 4
    mapping = torch.tensor([0] * 40 + [1, 2, 3, -1] * 6, dtype=torch.int32)
    meta = build_metadata(mapping, loras)
    worklist = RowTileWorklist.allocate(m, meta.num_slots, "cpu")
    # Llama-3.2-3B qkv at rank 8 (bf16), and SmolLM2-135M qkv (one column chunk per kv slice,
    # so chunk counts of 1 become constexprs) at rank 64 (fp16).
    for hidden, widths, rank, dtype in (((3072, (3072, 1024, 1024), 8, torch.bfloat16)),
                                        ((576, (576, 192, 192), 64, torch.float16))):
        a = [torch.zeros(loras, 1, rank, hidden, dtype=dtype) for _ in widths]
        b = [torch.zeros(loras, 1, n, rank, dtype=dtype) for n in widths]
        x = torch.zeros(m, hidden, dtype=dtype)
        y = torch.zeros(m, sum(widths), dtype=dtype)
        part = partials_buffer(len(widths), m, rank, hidden, "cpu")
        for schedule in (worklist, plan_gridtrim(meta, m, meta.num_slots)):
            shrink.lora_shrink(x, a, part, meta, schedule, k_groups=2, num_programs=8)
            expand.lora_expand(part, b, y, meta, schedule, chunk_tiles=3, num_programs=8)
        fused.lora_fused(x, a, b, y, worklist, num_programs=8)
    # StepTrim at Llama-3.2-3B's hidden size (bf16 and fp16 hidden states; learned and profiled
    # only) and at SmolLM2-135M's (float32).
    meta = torch.zeros(3, 8, dtype=torch.int64)
    src = torch.zeros(2, dtype=torch.int64)
    score, fire = torch.zeros(8), torch.zeros(8, dtype=torch.bool)
    for hidden, dtype, learned in ((3072, torch.bfloat16, True), (3072, torch.float16, True),
                                   (576, torch.float32, True), (3072, torch.bfloat16, False)):
        table = torch.zeros(loras + 1, steptrim.COLUMNS + (hidden if learned else 0))
        steptrim.launch_steptrim(meta, src, dtype, table, learned, score, fire)
    triton.runtime.driver.set_active(_Sm90())
    for fn, kwargs in launches:
        if fn.__name__ in WRITES:
            written = _written(fn, kwargs)
            assert written == WRITES[fn.__name__], f"{fn.__name__}: torch.compile takes it to write {sorted(written)}"
        compiled = _compile(fn, kwargs)
        if "expand" in fn.__name__ or "fused" in fn.__name__:
            # B must load in 16-byte vectors (lora_kernels/expand.py), not two bytes at a time, and y
            # must be added to with 16-byte atomic adds of 8 halves (tiles.store_y_tile).
            assert "ld.global.b16" not in compiled.asm["ptx"], f"{fn.__name__}: B loaded in scalar 2-byte loads"
            assert not kwargs["ADD_INPUTS"] or re.search(r"atom\.global\.\w+\.relaxed\.add\.noftz\.v8\.b?f16",
                                                         compiled.asm["ptx"]), f"{fn.__name__}: y not added in vectors"
        block = kwargs.get("BLOCK_R", kwargs.get("BLOCK_H"))
        print(f"{fn.__name__} block {block}: {len(compiled.asm['cubin'])} B cubin, "
              f"{compiled.metadata.shared} B shared memory")


if __name__ == "__main__":
    main()
