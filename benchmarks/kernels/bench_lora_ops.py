"""One Llama-3.2-3B layer's LoRA work: vLLM 0.26's ops vs GridTrim vs the work-list launch.

Times, as CUDA-graph replays in one process, the shrink+expand of qkv (3 slices), o, gate_up
(2 slices) and down at rank 8 with 128 adapter slots, for:
- vLLM: `vllm.lora.ops.triton_ops.lora_shrink` / `lora_expand` (torch.ops.vllm custom ops),
  with the metadata of vLLM's own `LoRAKernelMeta.prepare_tensors` (lora_kernel_metadata.py:
  109-168) and `meta_args(M, specialize_active_lora=True)` (:170-205), as punica_gpu.py:90-169
  calls them (fp32 buffer `[slices, M, rank]`, add_inputs=True, scale 1.0);
- GridTrim: the paper's row-bound buckets with two-class expand, one graph per scenario;
- work list (ours): one graph per batch size M, reused across scenarios after refreshing the
  metadata and the work list in place (the refresh is timed on its own: it runs once per step,
  not per layer).
All three read the very same vLLM metadata tensors. Each design's first replay per scenario is
checked against the torch reference. The floor is the bytes that must move (A and B of the
active adapters, x of the rows with an adapter, and y read + written for them) at the measured
device-to-device copy bandwidth.

    python3 benchmarks/kernels/bench_lora_ops.py [--out results.md]
"""
from __future__ import annotations

import argparse
import datetime
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import vllm
from lora_shapes import MODELS, OpTensors, mapping_from_groups, random_op, release, update_rel_err
from vllm.lora.ops.triton_ops import LoRAKernelMeta, lora_expand, lora_shrink

from kernels.gridtrim import plan_gridtrim
from kernels.layout import partials_buffer
from kernels.linear import add_lora_linear
from kernels.metadata import LoRABatchMeta
from kernels.reference import expand_reference, shrink_reference
from kernels.worklist import RowTileWorklist, persistent_programs

DEVICE = "cuda"
MAX_LORAS = 128
RANK = 8
MAX_TOKENS = 2048
DTYPE = torch.bfloat16
OPS = MODELS["llama-3.2-3b"]
TOLERANCE = 1e-2
SWEEP_SCENARIOS = ("256 rows, 128 adapters x 2", "2048 rows, mixed 1792 + 127 x 2")


@dataclass(frozen=True)
class LaunchConfig:
    """Tile knobs: expand tile width, tiles per expand item, shrink hidden chunk, and (work
    list only) persistent programs per SM."""

    block_n: int
    chunk_tiles: int
    k_chunk: int
    programs_per_sm: int

    def __str__(self) -> str:
        return (f"block_n={self.block_n} chunk_tiles={self.chunk_tiles} k_chunk={self.k_chunk} "
                f"per_sm={self.programs_per_sm}")


# The first run of this script (2026-11-29) swept block_n 64..256, chunk_tiles 1..8 and 2..8
# programs per SM at k_chunk 1024; (256, 2, ·, 1024) at 4 per SM was best. This sweep starts
# there and tries more programs per SM and longer hidden chunks (fewer, longer shrink items).
CONFIGS = [LaunchConfig(256, 2, 1024, 4), LaunchConfig(256, 2, 1024, 8),
           LaunchConfig(256, 2, 2048, 8), LaunchConfig(256, 2, 4096, 8),
           LaunchConfig(256, 4, 2048, 8), LaunchConfig(256, 8, 4096, 8),
           LaunchConfig(128, 4, 2048, 8)]


def scenarios(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Token→adapter mappings of the benchmarked batches."""
    def decode(adapters: int, rows: int) -> torch.Tensor:
        return mapping_from_groups({i: rows // adapters for i in range(adapters)}, gen)

    full = decode(128, 256)
    return {
        "256 rows, 8 adapters x 32": decode(8, 256),
        "256 rows, 32 adapters x 8": decode(32, 256),
        "256 rows, 64 adapters x 4": decode(64, 256),
        "256 rows, 128 adapters x 2": full,
        "32 rows, 8 adapters x 4": decode(8, 32),
        "256 rows, 128 x 2, half rows released": release(full, 0.5, gen),
        "256 rows, 128 x 2, half adapters released": full.masked_fill(full >= 64, -1),
        "2048 rows, mixed 1792 + 127 x 2": mapping_from_groups(
            {-1: 2, 0: 1792} | {i: 2 for i in range(1, 128)}, gen),
    }


def floor_bytes(mapping: torch.Tensor) -> int:
    """Bytes the layer's LoRA work must move for this batch (see module docstring)."""
    adapters = torch.unique(mapping[mapping >= 0]).numel()
    rows = int((mapping >= 0).sum())
    size = DTYPE.itemsize
    total = 0
    for op in OPS:
        out = sum(op.widths)
        total += adapters * RANK * size * (op.hidden * len(op.widths) + out)
        total += rows * size * (op.hidden + 2 * out)
    return total


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write of a 2 GiB buffer)."""
    src = torch.empty(2**30, dtype=torch.int16, device=DEVICE)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 10 * 2 * src.numel() * src.element_size() / (start.elapsed_time(end) / 1e3)


def capture(fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """Run `fn` once eagerly (compiles, fills vLLM's pointer caches), then capture it."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def replay_us(graph: torch.cuda.CUDAGraph, iters: int = 100) -> float:
    """Mean time of one replay in µs."""
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


class Layer:
    """The four ops' weights, inputs and outputs (y is reset before each checked replay)."""

    def __init__(self, gen: torch.Generator) -> None:
        self.ops: list[OpTensors] = [
            random_op(op, MAX_LORAS, RANK, MAX_TOKENS, DTYPE, DEVICE, gen) for op in OPS]
        self.y0 = [t.y.clone() for t in self.ops]
        self.partials: dict[int, list[torch.Tensor]] = {}

    def partials_for(self, k_chunk: int) -> list[torch.Tensor]:
        """Shrink partials of every op for hidden chunks of `k_chunk` (allocated once)."""
        if k_chunk not in self.partials:
            self.partials[k_chunk] = [
                partials_buffer(len(op.widths), MAX_TOKENS, RANK, op.hidden, DEVICE, k_chunk)
                for op in OPS]
        return self.partials[k_chunk]

    def reset(self) -> None:
        for t, y0 in zip(self.ops, self.y0):
            t.y.copy_(y0)

    def references(self, mapping: torch.Tensor) -> list[torch.Tensor]:
        m = mapping.numel()
        return [expand_reference(shrink_reference(t.x[:m], t.lora_a, mapping), t.lora_b,
                                 y0[:m], mapping) for t, y0 in zip(self.ops, self.y0)]

    def max_error(self, mapping: torch.Tensor, refs: list[torch.Tensor]) -> float:
        m = mapping.numel()
        mapped = mapping >= 0
        errs = []
        for t, y0, ref in zip(self.ops, self.y0, refs):
            if not torch.equal(t.y[:m][~mapped], y0[:m][~mapped]):
                return float("nan")
            errs.append(update_rel_err(t.y[:m][mapped], ref[mapped], y0[:m][mapped]))
        return max(errs)

    def run_vllm(self, args: tuple, buffers: list[torch.Tensor]) -> None:
        m = args[0].numel()
        for t, buf in zip(self.ops, buffers):
            lora_shrink(t.x[:m], t.lora_a, buf, *args, 1.0)
            lora_expand(buf, t.lora_b, t.y[:m], *args, offset_start=0, add_inputs=True)

    def run_kernels(self, meta: LoRABatchMeta, schedule, m: int, cfg: LaunchConfig) -> None:
        for t, part in zip(self.ops, self.partials_for(cfg.k_chunk)):
            add_lora_linear(t.y[:m], t.x[:m], t.lora_a, t.lora_b, part[:, :, :m], meta, schedule,
                            block_n=cfg.block_n, chunk_tiles=cfg.chunk_tiles, k_chunk=cfg.k_chunk,
                            num_programs=persistent_programs(DEVICE, cfg.programs_per_sm))


class Bench:
    """Holds the static metadata buffers, the work list and the per-M graphs of our launch."""

    def __init__(self, gen: torch.Generator) -> None:
        self.layer = Layer(gen)
        self.vmeta = LoRAKernelMeta.make(MAX_LORAS, MAX_TOKENS, device=DEVICE)
        self.worklist = RowTileWorklist.allocate(MAX_TOKENS, MAX_LORAS + 1, DEVICE)
        self.ours: dict[tuple[int, LaunchConfig], torch.cuda.CUDAGraph] = {}
        self.worklist_graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def load(self, mapping: torch.Tensor) -> tuple[tuple, LoRABatchMeta]:
        """Write a batch's metadata into the static buffers (vLLM's per-step preparation)."""
        self.vmeta.prepare_tensors(mapping.to(DEVICE))
        args = self.vmeta.meta_args(mapping.numel(), True)
        meta = LoRABatchMeta.from_vllm_meta_args(args)
        self.worklist.update(meta)
        return args, meta

    def time_ours(self, mapping: torch.Tensor, meta: LoRABatchMeta, cfg: LaunchConfig,
                  refs: list[torch.Tensor]) -> tuple[float, float]:
        m = mapping.numel()
        if (m, cfg) not in self.ours:
            self.ours[m, cfg] = capture(
                lambda: self.layer.run_kernels(meta, self.worklist, m, cfg))
        return self.check_and_time(self.ours[m, cfg], mapping, refs)

    def worklist_us(self, meta: LoRABatchMeta, m: int) -> float:
        if m not in self.worklist_graphs:
            self.worklist_graphs[m] = capture(lambda: self.worklist.update(meta))
        return replay_us(self.worklist_graphs[m])

    def check_and_time(self, graph: torch.cuda.CUDAGraph, mapping: torch.Tensor,
                       refs: list[torch.Tensor]) -> tuple[float, float]:
        self.layer.reset()
        graph.replay()
        torch.cuda.synchronize()
        err = self.layer.max_error(mapping.to(DEVICE), refs)
        return replay_us(graph), err


def measured(fn: Callable[[], tuple[float, float]]) -> tuple[float, float]:
    """(µs, error) of one design, or (NaN, NaN) with the traceback printed if it fails, so one
    broken design does not hide the others' numbers."""
    try:
        return fn()
    except Exception:  # noqa: BLE001 - reported in the table as NaN, traceback in the log
        traceback.print_exc()
        return float("nan"), float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the tables (markdown) to this file")
    args = parser.parse_args()
    lines: list[str] = []

    def emit(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        bandwidth = copy_bandwidth()
        bench = Bench(torch.Generator(device=DEVICE).manual_seed(0))
        batches = scenarios(gen)
        emit(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton "
             f"{triton.__version__} | vllm {vllm.__version__} | "
             f"{datetime.date.today().isoformat()} | copy bandwidth {bandwidth / 1e12:.2f} TB/s | "
             f"VLLM_LORA_ENABLE_DUAL_STREAM={os.environ.get('VLLM_LORA_ENABLE_DUAL_STREAM', '')}")
        emit()
        emit("Work-list launch sweep (µs per layer, graph replay; max rel err):")
        emit()
        emit("| config | " + " | ".join(SWEEP_SCENARIOS) + " |")
        emit("|---|" + "---|" * len(SWEEP_SCENARIOS))
        totals: dict[LaunchConfig, float] = {}
        refs = {name: bench.layer.references(batches[name].to(DEVICE)) for name in SWEEP_SCENARIOS}
        for cfg in CONFIGS:
            row = []
            for name in SWEEP_SCENARIOS:
                mapping = batches[name]
                _, meta = bench.load(mapping)
                us, err = measured(lambda: bench.time_ours(mapping, meta, cfg, refs[name]))
                row.append(f"{us:.1f} ({err:.1e})")
                ok = err < TOLERANCE  # NaN (failed) compares False
                totals[cfg] = totals.get(cfg, 0.0) + (us if ok else float("inf"))
            emit(f"| {cfg} | " + " | ".join(row) + " |")
        best = min(totals, key=totals.get)
        emit()
        emit(f"Chosen: {best} (GridTrim uses the same tile knobs; only the launch differs)")
        emit()
        emit("| scenario | adapters | rows | R | vLLM µs | GridTrim µs | ours µs | "
             "ours × vs vLLM | GridTrim × vs vLLM | floor µs | ours / floor | GridTrim / floor | "
             "work list build µs | max rel err vLLM / GridTrim / ours |")
        emit("|---|" + "---|" * 13)
        for name, mapping in batches.items():
            m = mapping.numel()
            vargs, meta = bench.load(mapping)
            ref = refs.get(name) or bench.layer.references(mapping.to(DEVICE))
            vbufs = [torch.empty(len(op.widths), m, RANK, dtype=torch.float32, device=DEVICE)
                     for op in OPS]
            v_us, v_err = measured(lambda: bench.check_and_time(
                capture(lambda: bench.layer.run_vllm(vargs, vbufs)), mapping, ref))
            plan = plan_gridtrim(meta, m, int(vargs[6].item()))
            g_us, g_err = measured(lambda: bench.check_and_time(
                capture(lambda: bench.layer.run_kernels(meta, plan, m, best)), mapping, ref))
            o_us, o_err = measured(lambda: bench.time_ours(mapping, meta, best, ref))
            wl_us, _ = measured(lambda: (bench.worklist_us(meta, m), 0.0))
            floor = floor_bytes(mapping) / bandwidth * 1e6
            adapters = torch.unique(mapping[mapping >= 0]).numel()
            emit(f"| {name} | {adapters} | {int((mapping >= 0).sum())} | {plan.row_bound}"
                 f"{'' if plan.large_slots is None else ' (2-class)'} | {v_us:.0f} | "
                 f"{g_us:.0f} | {o_us:.1f} | {v_us / o_us:.1f} | {v_us / g_us:.1f} | "
                 f"{floor:.1f} | {o_us / floor:.2f} | {g_us / floor:.2f} | {wl_us:.1f} | "
                 f"{v_err:.1e} / {g_err:.1e} / {o_err:.1e} |")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
