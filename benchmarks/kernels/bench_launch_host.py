"""Host time of one GridTrim LoRA linear where no CUDA graph replays it, on a GPU.

    python -m benchmarks.kernels.bench_launch_host [--calls 3000] [--repeats 3]

One Llama-3.2-3B qkv layer, rank 8, 128 adapters, 256 rows, in two batches: no adapter rows (the
kernels exit at once, so the GPU never holds the host back) and every row with an adapter. Per
call, best of ``--repeats`` means over ``--calls`` calls, synchronizing once per mean:

- **JIT**: ``launch_linear`` with both work-list launches through Triton's JIT
  (``kernel[grid](**kwargs)``, ``PreparedLaunch.runners`` off), as every launch went before
  ``lora_kernels.launch``;
- **prepared**: ``lora_kernels.linear.launch_linear``, whose launches go through
  ``lora_kernels.launch.PreparedLaunch`` (the compiled kernels' runners after the first call);
- **no launches**: ``launch_linear`` with ``PreparedLaunch.__call__`` a no-op (the Python around
  the launches);
- **torch.ops**: ``torch.ops.lorazor.gridtrim_lora_linear``, the call a compiled engine's step past
  its largest CUDA graph makes with ``LORAZOR_GRIDTRIM_LAUNCH=ops`` (dispatcher, argument rebuild,
  launch config lookup, prepared launches);
- **compiled, ops** and **compiled, inductor**: a ``torch.compile``'d function (one graph, the
  token dimension dynamic as vLLM marks it) that takes the base layer's output as an intermediate
  and runs ``COMPILED_LINEARS`` of ``serve_bridge.gridtrim.add_lora_linear`` on it, with each
  ``compiled_launch``; per linear, the call's time over ``COMPILED_LINEARS`` (the compiled call's
  own overhead shared as a model's graph shares it). The device kernels other than ours that each
  compiled call runs are listed (a copy of ``y`` or of the work list around the launches would show
  there).

A 28-layer model makes 4 such calls per layer per step. In each batch the prepared launches'
output is checked against the JIT's and the compiled ops' against eager, bit for bit (an error);
Inductor compiles the kernels itself, so its output's difference from eager is printed (elements
that differ, the largest difference); the exit code is 1 if any compiled output differs.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch
import triton

from lora_kernels.launch import PreparedLaunch
from lora_kernels.layout import partials_buffer
from lora_kernels.linear import launch_linear, linear_config
from lora_kernels.metadata import LoRABatchMeta, build_metadata
from lora_kernels.worklist import RowTileWorklist
from serve_bridge import gridtrim
from serve_bridge.command_line import Parser, fail, number

ROWS, HIDDEN, SLICE, RANK, ADAPTERS, PROGRAMS = 256, 3072, 1024, 8, 128, 2112
COMPILED_LINEARS = 28
OUR_KERNELS = ("_shrink_worklist_kernel", "_expand_worklist_kernel")


def best_us(call: Callable[[], None], calls: int, repeats: int) -> float:
    """Best mean host µs per call over ``repeats`` runs of ``calls`` calls (one sync per run)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def lora_linears(x: torch.Tensor, y0: torch.Tensor, lora_a: tuple, lora_b: tuple, meta_args: tuple,
                 worklist: RowTileWorklist, launch: str) -> torch.Tensor:
    """:data:`COMPILED_LINEARS` LoRA linears on an intermediate copy of ``y0`` (as a base layer's output is
    in a forward), with ``compiled_launch=launch``."""
    y = y0 * 1
    for _ in range(COMPILED_LINEARS):
        gridtrim.add_lora_linear(y, x, lora_a, lora_b, 1.0, (SLICE,) * 3, meta_args, worklist, num_programs=PROGRAMS,
                                 compiled_launch=launch)
    return y


def compiled_times(times: dict[str, float], x: torch.Tensor, lora_a: tuple, lora_b: tuple, meta: LoRABatchMeta,
                   worklist: RowTileWorklist, gen: torch.Generator, calls: int,
                   repeats: int) -> tuple[dict[str, str], bool]:
    """Add each ``compiled, <launch>`` host µs per linear to ``times``; return the other device kernels
    per compiled call by launch (or why it did not compile, or how its output differs from eager),
    and whether any compiled output differs from eager (the custom ops': an error)."""
    y0 = torch.randn(ROWS, 3 * SLICE, device=x.device, generator=gen).to(torch.bfloat16)
    meta_args = meta.vllm_meta_args()
    linears = (x, y0, lora_a, lora_b, meta_args, worklist)
    for t in (x, y0, *meta_args[:2]):
        torch._dynamo.mark_dynamic(t, 0)  # the token dimension, as vLLM marks its inputs'
    compiled = torch.compile(lora_linears, fullgraph=True)
    kernels, any_differ = {}, False
    with torch.inference_mode():
        reference = lora_linears(*linears, "ops")
        for mode in gridtrim.COMPILED_LAUNCHES:
            def call(mode: str = mode) -> torch.Tensor:
                return compiled(*linears, mode)

            try:
                first = call()
            except Exception as err:  # noqa: BLE001 - this torch/Triton cannot compile it: say so, time the rest
                kernels[mode] = f"not compiled ({type(err).__name__}: {str(err).splitlines()[0][:200]})"
                continue
            differ = int((first != reference).sum())
            if differ and mode == "ops":
                fail("the compiled LoRA linears with compiled_launch=ops differ from eager")
            times[f"compiled, {mode}"] = best_us(call, max(calls // COMPILED_LINEARS, 1), repeats) / COMPILED_LINEARS
            kernels[mode] = other_kernels(call)
            if differ:
                any_differ = True
                kernels[mode] += (f"; OUTPUT DIFFERS from eager in {differ} of {first.numel()} elements, "
                                  f"max |Δ| {(first.float() - reference.float()).abs().max().item():.3g} "
                                  f"(eager's largest |y| {reference.float().abs().max().item():.3g})")
    return kernels, any_differ


def other_kernels(call: Callable[[], object], calls: int = 10) -> str:
    """The device kernels besides ours per call of ``call``, by name, from torch's profiler."""
    call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    counts: dict[str, int] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and not event.name.startswith(OUR_KERNELS):
            counts[event.name[:48]] = counts.get(event.name[:48], 0) + 1
    return ", ".join(f"{name} ×{n / calls:g}" for name, n in sorted(counts.items())) or "none"


def main() -> None:
    ap = Parser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=number("positive_int"), default=3000)
    ap.add_argument("--repeats", type=number("positive_int"), default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        fail("bench_launch_host needs an NVIDIA GPU (CUDA)")
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(ROWS, HIDDEN, device=dev, generator=gen).to(torch.bfloat16)
    y = torch.zeros(ROWS, 3 * SLICE, device=dev, dtype=torch.bfloat16)
    lora_a = tuple(torch.randn(ADAPTERS, 1, RANK, HIDDEN, device=dev, generator=gen).to(torch.bfloat16) * 0.02
                   for _ in range(3))
    lora_b = tuple(torch.randn(ADAPTERS, 1, SLICE, RANK, device=dev, generator=gen).to(torch.bfloat16) * 0.3
                   for _ in range(3))
    config = linear_config(y, x, lora_a, lora_b)
    launches = (config.shrink.worklist_launch, config.expand.worklist_launch)
    usable = all(launch.runners for launch in launches)  # Triton ≥ 3.6 (lora_kernels.launch)
    print(f"GridTrim LoRA linear, host µs per call ({torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"Triton {triton.__version__}; {ROWS} rows, rank {RANK}, {ADAPTERS} adapters):")
    batches = (("no adapter rows", torch.full((ROWS,), -1, device=dev)),
               ("every row with an adapter", torch.randint(0, ADAPTERS, (ROWS,), device=dev, generator=gen)))
    differs = False
    for label, mapping in batches:
        meta = build_metadata(mapping, ADAPTERS)
        worklist = RowTileWorklist.allocate(8192, ADAPTERS + 1, dev)
        worklist.update(meta)

        def partials() -> torch.Tensor:
            return partials_buffer(3, ROWS, RANK, HIDDEN, dev, k_chunk=config.shrink.args["K_CHUNK"])

        def prepared() -> None:
            launch_linear(config, y, x, partials(), meta, worklist, 1.0, num_programs=PROGRAMS)

        flat = gridtrim.op_arguments((y, x, lora_a, lora_b), meta, worklist, (1.0, 0, True, PROGRAMS))
        op = getattr(torch.ops.lorazor, gridtrim.OP_NAME)

        def via_op() -> None:
            op(*flat)

        outputs, times = [], {}
        for name, runners in (("JIT", False), ("prepared", usable)):  # JIT: every launch as before the runners
            for launch in launches:
                launch.runners = runners
            prepared()  # compiles or finds the kernels (and, with runners, caches them)
            y.zero_()
            prepared()
            outputs.append(y.clone())
            times[name] = best_us(prepared, args.calls, args.repeats)
        if not torch.equal(*outputs):
            fail("the prepared launches' output differs from the JIT's")
        via_op()
        times["torch.ops"] = best_us(via_op, args.calls, args.repeats)
        real_call = PreparedLaunch.__call__
        PreparedLaunch.__call__ = lambda self, grid, *values: None  # type: ignore[method-assign]
        try:
            times["no launches"] = best_us(prepared, args.calls, args.repeats)
        finally:
            PreparedLaunch.__call__ = real_call  # type: ignore[method-assign]
        kernels, batch_differs = compiled_times(times, x, lora_a, lora_b, meta, worklist, gen, args.calls, args.repeats)
        differs = differs or batch_differs
        print(f"  {label}: " + ", ".join(f"{k} {v:.1f}" for k, v in times.items())
              + f"  (per 28-layer step past the graphs: JIT {times['JIT'] * 0.112:.1f} ms, prepared "
              f"{times['prepared'] * 0.112:.1f} ms, torch.ops {times['torch.ops'] * 0.112:.1f} ms)")
        for mode, names in kernels.items():
            print(f"    other device kernels per compiled call ({mode}): {names}")
    if differs:
        sys.exit(1)


if __name__ == "__main__":
    main()
