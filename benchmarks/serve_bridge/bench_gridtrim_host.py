"""Host time of one GridTrim LoRA linear call in eager mode, up to the Triton launches. No GPU.

    python -m benchmarks.serve_bridge.bench_gridtrim_host [--calls 2000] [--repeats 3]

What vLLM's eager mixed steps pay per LoRA linear besides the launches themselves:
``serve_bridge.gridtrim.add_lora_linear`` (views, the per-layer eligibility and launch-config
cache, the metadata, the partials buffer) and ``lora_kernels``' shrink and expand down to their
Triton kernels, whose launch (``kernel[grid](**args)``) is replaced by a no-op that takes the
same arguments. One Llama-3.2-3B qkv layer's shapes, rank 8, 128 adapters, 256 rows, on CPU
tensors. A 28-layer model makes 4 such calls per layer per step (qkv, o, gate_up, down).
Reports the best of ``--repeats`` means, in µs per call.
"""
from __future__ import annotations

import time

import torch


import lora_kernels.expand
import lora_kernels.shrink
from lora_kernels.metadata import build_metadata
from lora_kernels.worklist import RowTileWorklist
from serve_bridge import gridtrim
from serve_bridge.command_line import Parser, number


class _NoLaunch:
    """Stands in for a ``triton.jit`` kernel: ``kernel[grid](**args)`` accepts and drops the call."""

    def __getitem__(self, grid: tuple) -> object:
        return lambda *args, **kwargs: None


ROWS, HIDDEN, SLICE, RANK, ADAPTERS = 256, 3072, 1024, 8, 128


def main() -> None:
    ap = Parser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=number("positive_int"), default=2000)
    ap.add_argument("--repeats", type=number("positive_int"), default=3)
    args = ap.parse_args()
    lora_kernels.shrink._shrink_worklist_kernel = lora_kernels.expand._expand_worklist_kernel = _NoLaunch()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, HIDDEN, generator=g).to(torch.bfloat16)
    y = torch.zeros(ROWS, 3 * SLICE, dtype=torch.bfloat16)
    lora_a = tuple(torch.randn(ADAPTERS, 1, RANK, HIDDEN, generator=g).to(torch.bfloat16) for _ in range(3))
    lora_b = tuple(torch.randn(ADAPTERS, 1, SLICE, RANK, generator=g).to(torch.bfloat16) for _ in range(3))
    meta = build_metadata(torch.randint(-1, ADAPTERS, (ROWS,), generator=g), ADAPTERS)
    # vLLM's meta_args order (lora_kernel_metadata.py:197-205); the last two are not read
    meta_args = (meta.token_lora_mapping, meta.token_indices_sorted, meta.num_tokens_per_slot, meta.slot_start_loc,
                 meta.slot_lora_ids, None, None)
    worklist = RowTileWorklist.allocate(ROWS, ADAPTERS + 1, "cpu")
    gridtrim.refresh_worklist(worklist, meta_args)

    def mean_us(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            assert gridtrim.add_lora_linear(y, x, lora_a, lora_b, 0.5, (SLICE,) * 3, meta_args, worklist,
                                            num_programs=1056)  # an H200's 132 SMs × 8
        return (time.perf_counter() - start) / n * 1e6

    mean_us(50)  # warm-up: eligibility and launch-config cache
    best = min(mean_us(args.calls) for _ in range(args.repeats))
    print(f"gridtrim.add_lora_linear host path up to the Triton launches: {best:.1f} µs per call "
          f"({best * 4 * 28 / 1e3:.1f} ms per eager step of a 28-layer model; torch {torch.__version__})")


if __name__ == "__main__":
    main()
