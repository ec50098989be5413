"""One Llama-3.2-3B layer's LoRA work: vLLM 0.26's ops vs GridTrim vs the work list vs fused.

Times, as CUDA-graph replays in one process, the LoRA work of qkv (3 slices), o, gate_up
(2 slices) and down at rank 8 with 128 adapter slots, for:
- vLLM: `vllm.lora.ops.triton_ops.lora_shrink` / `lora_expand` (torch.ops.vllm custom ops),
  with the metadata of vLLM's own `LoRAKernelMeta.prepare_tensors` (lora_kernel_metadata.py:
  109-168) and `meta_args(M, specialize_active_lora=True)` (:170-205), as punica_gpu.py:90-169
  calls them (fp32 buffer `[slices, M, rank]`, add_inputs=True, scale 1.0);
- GridTrim: the paper's row-bound buckets with two-class expand, one graph per scenario;
- work list (ours): shrink + expand per op, one graph per batch size M, reused across scenarios
  after refreshing the metadata and the work list in place (the refresh is timed on its own: it
  runs once per step, not per layer);
- fused (ours): one launch per op walking the same work list (`lora_kernels.fused`), graphs as for
  the work list.
All read the very same metadata tensors (vLLM's; without `vllm` in --designs, static buffers
refreshed by `lora_kernels.metadata.build_metadata`). Each design's first replay per scenario and
config is checked against the torch reference. The floor is the bytes that must move (A and B
of the active adapters, x of the rows with an adapter, and y read + written for them) at the
measured device-to-device copy bandwidth.

Sweeps: the tile and shrink knobs, for the work list and GridTrim each (skipped by --quick, which
uses the defaults), and the fused launch's knobs, on the 128 × 2 and mixed scenarios; the main
table uses each design's best. `--breakdown` also times each kernel of the chosen work-list config
alone at 128 × 2, against the bytes that kernel must move.

    python -m benchmarks.kernels.bench_lora_ops [--out results.md [--replace]] [--quick]
        [--designs vllm gridtrim worklist fused] [--breakdown]
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
from benchmarks.kernels.lora_shapes import MODELS, OpTensors, mapping_from_groups, random_op, release, update_rel_err
from benchmarks.printed import Printed, add_out_options, check_out

from lora_kernels.expand import launch_expand
from lora_kernels.fused import FusedConfig
from lora_kernels.gridtrim import GridTrimPlan, plan_gridtrim
from lora_kernels.layout import partials_buffer
from lora_kernels.linear import LinearKnobs, add_lora_linear, linear_config
from lora_kernels.metadata import LoRABatchMeta, build_metadata
from lora_kernels.reference import expand_reference, shrink_reference
from lora_kernels.shrink import launch_shrink
from lora_kernels.worklist import PROGRAMS_PER_SM, RowTileWorklist, persistent_programs
from serve_bridge.command_line import Parser

DEVICE = "cuda"
MAX_LORAS = 128
RANK = 8
MAX_TOKENS = 2048
DTYPE = torch.bfloat16
OPS = MODELS["llama-3.2-3b"]
TOLERANCE = 1e-2
SWEEP_SCENARIOS = ("256 rows, 128 adapters x 2", "2048 rows, mixed 1792 + 127 x 2")
DESIGNS = ("vllm", "gridtrim", "worklist", "fused")
OURS = ("gridtrim", "worklist", "fused")
PERSISTENT = ("worklist", "fused")
DESIGN_NAMES = {"vllm": "vLLM", "gridtrim": "GridTrim", "worklist": "work list", "fused": "fused"}


@dataclass(frozen=True)
class LaunchConfig:
    """The unfused launches' knobs and (work list only) persistent programs per SM."""

    knobs: LinearKnobs
    programs_per_sm: int = PROGRAMS_PER_SM

    def __str__(self) -> str:
        return f"{self.knobs} per_sm={self.programs_per_sm}"


def _knobs(**changes: int) -> LinearKnobs:
    """The default knobs (`LinearKnobs()`, 256-column expand tiles at rank 8) with `changes`."""
    return dataclasses.replace(LinearKnobs(block_n=256), **changes)


# The H200 runs of 2026-11-29 swept block_n 64..256, chunk_tiles 1..8, 2..8 programs per SM and
# k_chunk 1024..4096; those of 2026-11-30, shrink warps, hidden groups, pipelining stages, up to 16
# programs per SM, hidden steps of 128 and 1 shrink warp (RESULTS.md). The defaults are the work list's best: 2 shrink warps, 4 tiles of 256
# columns per expand item, hidden chunks of 1024 in steps of 256, 16 programs per SM. This sweep
# re-checks the nearest alternatives.
WORKLIST_CHOSEN = LaunchConfig(_knobs())
CONFIGS = [WORKLIST_CHOSEN,
           LaunchConfig(_knobs(block_k=128)),
           LaunchConfig(_knobs(block_k=128, shrink_stages=4)),
           LaunchConfig(_knobs(chunk_tiles=2)),
           LaunchConfig(_knobs(), programs_per_sm=8),
           LaunchConfig(_knobs(), programs_per_sm=24)]

# Fused launch. An exploration on the H200 (2026-11-29, per-op graphs, rank 8) found it no faster
# than the work list: at 128 × 2 rows 124-190 µs per layer vs 127 µs, mixed 255-390 µs vs
# 233 µs. The shrink over the whole hidden size is a serial chain of K / block_k dependent steps
# per item, so few, wide column chunks (col_chunks 2, cut evenly from the widest slice) beat one
# item per program, and batched dots over k_groups stop the warps from repeating the 16 × 16
# shrink tile. The first row is the default FusedConfig().
FUSED_CONFIGS = [
    FusedConfig(),
    FusedConfig(col_chunks=4),
    FusedConfig(block_n=256, col_chunks=4),
    FusedConfig(col_chunks=2, k_groups=8, num_warps=8, num_stages=3),
    FusedConfig(block_n=256, col_chunks=4, k_groups=1, num_warps=2, num_stages=3),
    FusedConfig(programs_per_sm=4),
]


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


Config = LaunchConfig | FusedConfig


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
        from vllm.lora.ops.triton_ops import lora_expand, lora_shrink
        m = args[0].numel()
        for t, buf in zip(self.ops, buffers):
            lora_shrink(t.x[:m], t.lora_a, buf, *args, 1.0)
            lora_expand(buf, t.lora_b, t.y[:m], *args, offset_start=0, add_inputs=True)

    def run_op(self, i: int, meta: LoRABatchMeta, schedule, m: int, cfg: Config) -> None:
        """Op i through our kernels: fused (FusedConfig) or shrink + expand (LaunchConfig)."""
        t = self.ops[i]
        if isinstance(cfg, FusedConfig):
            add_lora_linear(t.y[:m], t.x[:m], t.lora_a, t.lora_b, None, meta, schedule,
                            fused=cfg, num_programs=persistent_programs(DEVICE,
                                                                        cfg.programs_per_sm))
            return
        part = self.partials_for(cfg.knobs.k_chunk)[i]
        add_lora_linear(t.y[:m], t.x[:m], t.lora_a, t.lora_b, part[:, :, :m], meta, schedule, knobs=cfg.knobs,
                        num_programs=persistent_programs(DEVICE, cfg.programs_per_sm))

    def run_kernels(self, meta: LoRABatchMeta, schedule, m: int, cfg: Config) -> None:
        for i in range(len(self.ops)):
            self.run_op(i, meta, schedule, m, cfg)


class StaticMeta:
    """vLLM-free stand-in for `LoRAKernelMeta`: static buffers that `load` refreshes in place with
    `build_metadata`'s output, so graphs captured on them replay later batches of the same M."""

    def __init__(self) -> None:
        self.buffers = build_metadata(
            torch.full((MAX_TOKENS,), -1, dtype=torch.int32, device=DEVICE), MAX_LORAS)

    def load(self, mapping: torch.Tensor) -> LoRABatchMeta:
        fresh = build_metadata(mapping.to(DEVICE), MAX_LORAS)
        views = []
        for f in dataclasses.fields(LoRABatchMeta):
            src, dst = getattr(fresh, f.name), getattr(self.buffers, f.name)
            dst[:src.numel()].copy_(src)
            views.append(dst[:src.numel()])
        return LoRABatchMeta(*views)


class Bench:
    """Holds the static metadata buffers, the work list and the per-M graphs of our launches."""

    def __init__(self, gen: torch.Generator, with_vllm: bool) -> None:
        self.layer = Layer(gen)
        if with_vllm:
            from vllm.lora.ops.triton_ops import LoRAKernelMeta
            self.vmeta = LoRAKernelMeta.make(MAX_LORAS, MAX_TOKENS, device=DEVICE)
        else:
            self.vmeta, self.static_meta = None, StaticMeta()
        self.worklist = RowTileWorklist.allocate(MAX_TOKENS, MAX_LORAS + 1, DEVICE)
        self.ours: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.worklist_graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def load(self, mapping: torch.Tensor) -> tuple[tuple | None, LoRABatchMeta, int]:
        """Write a batch's metadata into the static buffers (vLLM's per-step preparation) and
        refresh the work list. Returns vLLM's meta_args (None without vLLM), the metadata and
        the number of slots a GridTrim grid covers (vLLM's num_active_loras)."""
        if self.vmeta is None:
            meta = self.static_meta.load(mapping)
            args, active = None, meta.num_slots
        else:
            self.vmeta.prepare_tensors(mapping.to(DEVICE))
            args = self.vmeta.meta_args(mapping.numel(), True)
            meta, active = LoRABatchMeta.from_vllm_meta_args(args), int(args[6].item())
        self.worklist.update(meta)
        return args, meta, active

    def time_ours(self, mapping: torch.Tensor, meta: LoRABatchMeta, cfg: Config,
                  refs: list[torch.Tensor]) -> tuple[float, float]:
        """(µs, max error) of the whole layer through our kernels with `cfg`."""
        m = mapping.numel()
        if (m, cfg) not in self.ours:
            self.ours[m, cfg] = capture(
                lambda: self.layer.run_kernels(meta, self.worklist, m, cfg))
        return self.check_and_time(self.ours[m, cfg], mapping, refs)

    def time_gridtrim(self, mapping: torch.Tensor, meta: LoRABatchMeta, plan: GridTrimPlan, cfg: LaunchConfig,
                      refs: list[torch.Tensor]) -> tuple[float, float]:
        """(µs, max error) of the whole layer through GridTrim's launch with `cfg` and the batch's
        `plan` (one graph per batch: the plan's grid depends on it)."""
        m = mapping.numel()
        return self.check_and_time(capture(lambda: self.layer.run_kernels(meta, plan, m, cfg)), mapping, refs)

    def time_ops(self, mapping: torch.Tensor, meta: LoRABatchMeta, cfg: Config) -> list[float]:
        """µs of each op alone (its own graph) through our kernels with `cfg`."""
        m = mapping.numel()
        out = []
        for i in range(len(OPS)):
            if (m, cfg, i) not in self.ours:
                self.ours[m, cfg, i] = capture(
                    lambda i=i: self.layer.run_op(i, meta, self.worklist, m, cfg))
            out.append(replay_us(self.ours[m, cfg, i]))
        return out

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


def measured(fn: Callable[[], tuple]) -> tuple:
    """fn()'s (µs, error, ...), or NaNs with the traceback printed if it fails, so one broken
    design does not hide the others' numbers."""
    try:
        return fn()
    except Exception:  # noqa: BLE001 - reported in the table as NaN, traceback in the log
        traceback.print_exc()
        return float("nan"), float("nan")


def fmt(value: float | None, spec: str) -> str:
    """A table cell: '–' for a design that was not run."""
    return "–" if value is None else format(value, spec)


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    add_out_options(parser, "the tables")
    parser.add_argument("--quick", action="store_true",
                        help="skip the knob sweep (use the defaults); the fused sweep and the "
                             "main table still run")
    parser.add_argument("--designs", nargs="+", choices=DESIGNS, default=list(DESIGNS),
                        help="designs to time (default: all); without vllm no vLLM import")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time each kernel of the chosen work-list config alone at 128 × 2")
    args = parser.parse_args()
    check_out(args)
    designs = [d for d in DESIGNS if d in args.designs]
    emit = Printed()

    start = time.time()
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        bandwidth = copy_bandwidth()
        bench = Bench(torch.Generator(device=DEVICE).manual_seed(0), "vllm" in designs)
        batches = scenarios(gen)
        vllm_version = "not run"
        if "vllm" in designs:
            import vllm
            vllm_version = vllm.__version__
        emit(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton "
             f"{triton.__version__} | vllm {vllm_version} | "
             f"{datetime.date.today().isoformat()} | copy bandwidth {bandwidth / 1e12:.2f} TB/s | "
             f"VLLM_LORA_ENABLE_DUAL_STREAM={os.environ.get('VLLM_LORA_ENABLE_DUAL_STREAM', '')}"
             f" | designs {' '.join(designs)}{' | --quick' if args.quick else ''}")
        emit()
        refs = {name: bench.layer.references(batches[name].to(DEVICE)) for name in SWEEP_SCENARIOS}
        floors = {name: floor_bytes(m) / bandwidth * 1e6 for name, m in batches.items()}
        swept = [d for d in ("worklist", "gridtrim") if d in designs]
        best = {d: WORKLIST_CHOSEN for d in swept}
        if not args.quick and swept:
            best = knob_sweep(bench, batches, refs, swept, emit)
        elif swept:
            emit(f"Work list / GridTrim tile knobs (no sweep, --quick): {WORKLIST_CHOSEN}")
            emit()
        configs: dict[str, Config | None] = dict(best)
        if "fused" in designs:
            configs["fused"] = launch_sweep(bench, batches, refs, floors, emit, "fused", FUSED_CONFIGS)
        emit(f"Main table ({time.time() - start:.0f} s so far): µs per layer, graph replay; "
             "× = speedup over vLLM; / floor = ratio to the bytes floor.")
        emit()
        results = main_table(bench, batches, designs, configs, floors, emit)
        emit()
        targets(results, floors, emit)
        if args.breakdown and "worklist" in designs:
            emit()
            measured(lambda: (breakdown(bench, batches["256 rows, 128 adapters x 2"], best["worklist"], bandwidth,
                                        emit), 0.0))
        emit()
        emit(f"Total {time.time() - start:.0f} s.")
    emit.write(args.out)


def knob_sweep(bench: Bench, batches: dict[str, torch.Tensor], refs: dict[str, list[torch.Tensor]],
               designs: list[str], emit: Callable[[str], None]) -> dict[str, LaunchConfig]:
    """Time every `CONFIGS` entry with each of `designs` (work list, GridTrim) on the sweep
    scenarios; return each design's config of smallest total µs among those that passed the check."""
    emit("Knob sweep (µs per layer, graph replay; max rel err):")
    emit()
    emit("| config | " + " | ".join(f"{DESIGN_NAMES[d]}: {name}" for d in designs for name in SWEEP_SCENARIOS) + " |")
    emit("|---|" + "---|" * (len(designs) * len(SWEEP_SCENARIOS)))
    totals: dict[str, dict[LaunchConfig, float]] = {d: {} for d in designs}
    for cfg in CONFIGS:
        row = []
        for design in designs:
            for name in SWEEP_SCENARIOS:
                mapping = batches[name]
                _, meta, active = bench.load(mapping)
                if design == "worklist":
                    fn = lambda: bench.time_ours(mapping, meta, cfg, refs[name])  # noqa: E731
                else:
                    plan = plan_gridtrim(meta, mapping.numel(), active)
                    fn = lambda: bench.time_gridtrim(mapping, meta, plan, cfg, refs[name])  # noqa: E731
                us, err = measured(fn)
                row.append(f"{us:.1f} ({err:.1e})")
                ok = err < TOLERANCE  # NaN (failed) compares False
                totals[design][cfg] = totals[design].get(cfg, 0.0) + (us if ok else float("inf"))
        emit(f"| {cfg} | " + " | ".join(row) + " |")
    emit()
    best = {d: min(totals[d], key=totals[d].get) for d in designs}
    for d in designs:
        emit(f"Chosen for {DESIGN_NAMES[d]}: {best[d]}")
    emit()
    return best


def launch_sweep(bench: Bench, batches: dict[str, torch.Tensor],
                 refs: dict[str, list[torch.Tensor]], floors: dict[str, float],
                 emit: Callable[[str], None], design: str,
                 candidates: list[Config]) -> Config | None:
    """Time one design's `candidates` on the sweep scenarios (the layer, and each op alone);
    return the config with the smallest Σ layer µs / floor µs over them (each scenario counts as
    much), None if none passed the check."""
    emit(f"{DESIGN_NAMES[design].capitalize()} launch sweep (µs per layer, graph replay, "
         "[qkv / o / gate_up / down alone]; max rel err):")
    emit()
    emit("| config | " + " | ".join(SWEEP_SCENARIOS) + " | Σ µs / floor µs |")
    emit("|---|" + "---|" * (len(SWEEP_SCENARIOS) + 1))
    scores: dict[Config, float] = {}
    per_op: dict[str, list[list[float]]] = {name: [] for name in SWEEP_SCENARIOS}
    for cfg in candidates:
        row, score = [], 0.0
        for name in SWEEP_SCENARIOS:
            mapping = batches[name]
            _, meta, _ = bench.load(mapping)
            us, err = measured(lambda: bench.time_ours(mapping, meta, cfg, refs[name]))
            ops, _ = measured(lambda: (bench.time_ops(mapping, meta, cfg), 0.0))
            ops = ops if isinstance(ops, list) else [float("nan")] * len(OPS)
            per_op[name].append(ops)
            row.append(f"{us:.1f} [{' / '.join(f'{u:.1f}' for u in ops)}] ({err:.1e})")
            score += us / floors[name] if err < TOLERANCE else float("inf")
        scores[cfg] = score
        emit(f"| {cfg} | " + " | ".join(row) + f" | {score:.2f} |")
    emit()
    finite = {cfg: v for cfg, v in scores.items() if v < float("inf")}
    if not finite:
        emit(f"{DESIGN_NAMES[design].capitalize()}: no config passed the check.")
        emit()
        return None
    chosen = min(finite, key=finite.get)
    emit(f"Chosen: {chosen}")
    for name in SWEEP_SCENARIOS:
        best_ops = [min(u[i] for u in per_op[name]) for i in range(len(OPS))]
        emit(f"- {name}: each op with its own fastest config would sum to "
             f"{sum(best_ops):.1f} µs ({' / '.join(f'{u:.1f}' for u in best_ops)}; ops alone, "
             "without the layer graph's overlap)")
    emit()
    return chosen


def main_table(bench: Bench, batches: dict[str, torch.Tensor], designs: list[str],
               configs: dict[str, Config | None], floors: dict[str, float],
               emit: Callable[[str], None]) -> dict[str, dict]:
    """Every scenario × design, each of ours with its config in `configs` (a design whose sweep
    found no passing config is skipped); returns {scenario: {design: µs}} (designs not run are
    absent)."""
    timed = [d for d in DESIGNS if d in designs and (d == "vllm" or configs.get(d) is not None)]
    emit("Designs: " + "; ".join(f"{DESIGN_NAMES[d]} with {configs.get(d)}" for d in OURS) + ".")
    emit()
    emit("| scenario | adapters | rows | R | " + " | ".join(
        f"{DESIGN_NAMES[d]} µs" for d in DESIGNS) + " | " + " | ".join(
        f"{DESIGN_NAMES[d]} ×" for d in OURS) + " | floor µs | " + " | ".join(
        f"{DESIGN_NAMES[d]} / floor" for d in OURS) + " | work list build µs | max rel err "
        + " / ".join(DESIGN_NAMES[d] for d in DESIGNS) + " |")
    emit("|---|" + "---|" * (4 + len(DESIGNS) + 2 * len(OURS) + 2))
    results: dict[str, dict] = {}
    for name, mapping in batches.items():
        m = mapping.numel()
        vargs, meta, active = bench.load(mapping)
        ref = bench.layer.references(mapping.to(DEVICE))
        plan = plan_gridtrim(meta, m, active)
        us: dict[str, float] = {}
        err: dict[str, float] = {}
        for design in timed:
            if design == "vllm":
                vbufs = [torch.empty(len(op.widths), m, RANK, dtype=torch.float32,
                                     device=DEVICE) for op in OPS]
                fn = lambda: bench.check_and_time(  # noqa: E731
                    capture(lambda: bench.layer.run_vllm(vargs, vbufs)), mapping, ref)
            elif design == "gridtrim":
                fn = lambda: bench.time_gridtrim(mapping, meta, plan, configs["gridtrim"], ref)  # noqa: E731
            else:
                fn = lambda cfg=configs[design]: bench.time_ours(mapping, meta, cfg, ref)  # noqa: E731
            us[design], err[design] = measured(fn)
        wl_us, _ = measured(lambda: (bench.worklist_us(meta, m), 0.0))
        floor = floors[name]
        vllm_us = us.get("vllm")
        adapters = torch.unique(mapping[mapping >= 0]).numel()
        emit(f"| {name} | {adapters} | {int((mapping >= 0).sum())} | {plan.row_bound}"
             f"{'' if plan.large_slots is None else ' (2-class)'} | "
             + " | ".join(fmt(us.get(d), ".1f") for d in DESIGNS) + " | "
             + " | ".join(fmt(None if vllm_us is None or d not in us else vllm_us / us[d], ".1f")
                          for d in OURS)
             + f" | {floor:.1f} | "
             + " | ".join(fmt(us[d] / floor if d in us else None, ".2f") for d in OURS)
             + f" | {wl_us:.1f} | " + " / ".join(fmt(err.get(d), ".1e") for d in DESIGNS) + " |")
        results[name] = us
    return results


def targets(results: dict[str, dict], floors: dict[str, float],
            emit: Callable[[str], None]) -> None:
    """The issue's targets for our persistent designs (– where a design was not run)."""
    full, mixed = "256 rows, 128 adapters x 2", "2048 rows, mixed 1792 + 127 x 2"
    half_rows, half_ads = ("256 rows, 128 x 2, half rows released",
                           "256 rows, 128 x 2, half adapters released")

    def cell(design: str, value: Callable[[dict], float], spec: str) -> str:
        try:
            return format(value(design), spec)
        except (KeyError, ZeroDivisionError):
            return "–"

    def ratio(name: str) -> Callable[[str], float]:
        return lambda d: results[name][d] / results[full][d]

    rows = [
        (f"{full}: ≤ 3 × floor", lambda d: results[full][d] / floors[full], ".2f"),
        (f"{full}: ≥ 10 × vLLM", lambda d: results[full]["vllm"] / results[full][d], ".1f"),
        (f"half rows released: time / full (floor {floors[half_rows] / floors[full]:.2f})",
         ratio(half_rows), ".2f"),
        (f"half adapters released: time / full (floor {floors[half_ads] / floors[full]:.2f})",
         ratio(half_ads), ".2f"),
        (f"{mixed}: ≥ 5 × vLLM", lambda d: results[mixed]["vllm"] / results[mixed][d], ".1f"),
        ("never slower than vLLM: smallest × over scenarios",
         lambda d: min(r["vllm"] / r[d] for r in results.values()), ".1f"),
    ]
    emit("| target | " + " | ".join(DESIGN_NAMES[d] for d in PERSISTENT) + " |")
    emit("|---|" + "---|" * len(PERSISTENT))
    for label, value, spec in rows:
        emit(f"| {label} | " + " | ".join(cell(d, value, spec) for d in PERSISTENT) + " |")


def breakdown(bench: Bench, mapping: torch.Tensor, cfg: LaunchConfig, bandwidth: float,
              emit: Callable[[str], None]) -> None:
    """Each kernel of the layer alone (its own graph) for `mapping` with `cfg`, against the bytes
    that kernel must move: shrink reads A of the active adapters and x of the mapped rows and
    writes their fp32 partials; expand reads those partials and B, and reads and writes y."""
    m = mapping.numel()
    _, meta, _ = bench.load(mapping)
    adapters = torch.unique(mapping[mapping >= 0]).numel()
    rows = int((mapping >= 0).sum())
    size = DTYPE.itemsize
    programs = persistent_programs(DEVICE, cfg.programs_per_sm)
    emit(f"Per kernel, alone (own graph), {adapters} adapters × {rows} rows, {cfg}:")
    emit()
    emit("| op | kernel | µs | floor µs | / floor |")
    emit("|---|---|---|---|---|")
    total = 0.0
    for i, (op, t) in enumerate(zip(OPS, bench.layer.ops)):
        x, y = t.x[:m], t.y[:m]
        config = linear_config(y, x, t.lora_a, t.lora_b, knobs=cfg.knobs)
        part = bench.layer.partials_for(cfg.knobs.k_chunk)[i][:, :, :m]
        out = sum(op.widths)
        partial_bytes = part.shape[0] * part.shape[1] * rows * RANK * 4
        kernels = {
            "shrink": (lambda: launch_shrink(config.shrink, x, part, meta, bench.worklist, num_programs=programs),
                       adapters * len(op.widths) * RANK * op.hidden * size + rows * op.hidden * size + partial_bytes),
            "expand": (lambda: launch_expand(config.expand, part, y, meta, bench.worklist, num_programs=programs),
                       adapters * RANK * out * size + 2 * rows * out * size + partial_bytes),
        }
        for kind, (fn, nbytes) in kernels.items():
            us = replay_us(capture(fn))
            floor = nbytes / bandwidth * 1e6
            total += us
            emit(f"| {op.name} | {kind} | {us:.1f} | {floor:.1f} | {us / floor:.2f} |")
    emit()
    emit(f"Sum of the kernels alone: {total:.1f} µs.")


if __name__ == "__main__":
    main()
