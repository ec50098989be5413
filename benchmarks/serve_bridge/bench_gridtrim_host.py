"""Host time of one GridTrim LoRA linear call, up to the Triton launches, on the two paths a step
takes. No GPU.

    python -m benchmarks.serve_bridge.bench_gridtrim_host [--calls 2000] [--repeats 3]

What a step pays per LoRA linear besides the launches themselves, where no CUDA graph replays it:

- **eager** (``--enforce-eager``, and CUDA-graph capture): ``serve_bridge.gridtrim.add_lora_linear``
  (views, the per-layer eligibility and launch-config cache, the metadata, the partials buffer)
  and ``lora_kernels``' shrink and expand down to their Triton kernels;
- **compiled, past the graphs** (vLLM's default torch.compile, a step of more tokens than its
  largest CUDA graph): the compiled graph's call of ``torch.ops.lorazor.gridtrim_lora_linear``
  with its flat arguments, through torch's dispatcher into the registered kernel, which rebuilds
  the metadata and looks the launch config up before the same launches.

Each work-list launch (``lora_kernels.launch.PreparedLaunch``, which picks the compiled kernel
and launches it) is replaced by a no-op that takes the same arguments;
``python -m benchmarks.kernels.bench_launch_host`` times the launches themselves on a GPU. One
Llama-3.2-3B qkv layer's shapes, rank 8, 128 adapters, 256 rows, on CPU tensors.
A 28-layer model makes 4 such calls per layer per step (qkv, o, gate_up, down). Reports the best
of ``--repeats`` means, in µs per call.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

from lora_kernels.launch import PreparedLaunch
from lora_kernels.metadata import LoRABatchMeta, build_metadata
from lora_kernels.worklist import RowTileWorklist
from serve_bridge import gridtrim
from serve_bridge.command_line import Parser, number


def _no_launch(self: PreparedLaunch, grid: tuple[int, ...], *values: object) -> None:
    """Stands in for :meth:`PreparedLaunch.__call__`: accepts and drops the launch."""


ROWS, HIDDEN, SLICE, RANK, ADAPTERS = 256, 3072, 1024, 8, 128


def main() -> None:
    ap = Parser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=number("positive_int"), default=2000)
    ap.add_argument("--repeats", type=number("positive_int"), default=3)
    args = ap.parse_args()
    PreparedLaunch.__call__ = _no_launch  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, HIDDEN, generator=g).to(torch.bfloat16)
    y = torch.zeros(ROWS, 3 * SLICE, dtype=torch.bfloat16)
    lora_a = tuple(torch.randn(ADAPTERS, 1, RANK, HIDDEN, generator=g).to(torch.bfloat16) for _ in range(3))
    lora_b = tuple(torch.randn(ADAPTERS, 1, SLICE, RANK, generator=g).to(torch.bfloat16) for _ in range(3))
    meta = build_metadata(torch.randint(-1, ADAPTERS, (ROWS,), generator=g), ADAPTERS)
    # vLLM's meta_args order (lora_kernel_metadata.py:197-205); the last two are not read
    meta_args = (*meta.vllm_meta_args(), None, None)
    worklist = RowTileWorklist.allocate(ROWS, ADAPTERS + 1, "cpu")
    gridtrim.refresh_worklist(worklist, meta_args)

    programs = 1056  # an H200's 132 SMs × 8
    op = getattr(torch.ops.lorazor, gridtrim.OP_NAME)
    flat = gridtrim.op_arguments((y, x, lora_a, lora_b), LoRABatchMeta.from_vllm_meta_args(meta_args), worklist,
                                 (0.5, 0, True, programs))

    def eager() -> None:
        assert gridtrim.add_lora_linear(y, x, lora_a, lora_b, 0.5, (SLICE,) * 3, meta_args, worklist,
                                        num_programs=programs)

    def compiled() -> None:
        op(*flat)

    def mean_us(call: Callable[[], None], n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            call()
        return (time.perf_counter() - start) / n * 1e6

    print(f"GridTrim LoRA linear, host time up to the Triton launches (torch {torch.__version__}):")
    for label, call in (("eager (add_lora_linear)", eager),
                        ("compiled, past the graphs (torch.ops.lorazor)", compiled)):
        mean_us(call, 50)  # warm-up: eligibility and launch-config cache
        best = min(mean_us(call, args.calls) for _ in range(args.repeats))
        print(f"  {label}: {best:.1f} µs per call ({best * 4 * 28 / 1e3:.1f} ms per step of a 28-layer model)")


if __name__ == "__main__":
    main()
