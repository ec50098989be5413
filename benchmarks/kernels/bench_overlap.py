"""What the LoRA work of one Llama-3.2-3B layer adds to its base GEMMs, run in order or overlapped.

For each batch, CUDA-graph replays (mean of 100) of the layer's four linears (qkv, o, gate_up,
down; rank 8, bf16, 128 adapter slots) as:
- base: the base GEMMs alone (`torch.mm` into y, as an unquantized vLLM linear computes them);
- in order: base, then the work-list shrink and expand of each op (what the plugin runs today);
- shrink beside: each op's shrink on a second stream while its base GEMM runs, the expand after
  both (the shrink reads only x; the expand adds into y, so it waits for the GEMM);
- shrink beside, 4/SM: the same with the second stream's shrink on 4 persistent programs per SM
  instead of 16, leaving room on every SM for the GEMM;
- vLLM dual stream: shrink and expand into a zeroed buffer on a second stream, then `y.add_`
  (the shape of vLLM 0.33's `VLLM_LORA_ENABLE_DUAL_STREAM`, lora/layers/base_linear.py:244-307,
  with our kernels).
The LoRA cost of a variant is its time minus base's. Every variant's y is compared with the
in-order one (the same kernels in another order give the same bits) and with
`lora_kernels.reference` applied to the base output.

    python -m benchmarks.kernels.bench_overlap [--out results.md [--replace]]
"""
from __future__ import annotations

import datetime
from collections import Counter
from collections.abc import Callable

import torch
import triton
from benchmarks.kernels.bench_lora_ops import DEVICE, DTYPE, MAX_LORAS, MAX_TOKENS, OPS, Bench, capture, replay_us
from benchmarks.kernels.lora_shapes import mapping_from_groups, update_rel_err
from benchmarks.printed import Printed, add_out_options, check_out

from lora_kernels.expand import launch_expand
from lora_kernels.linear import LinearConfig, LinearKnobs, linear_config
from lora_kernels.metadata import LoRABatchMeta
from lora_kernels.reference import expand_reference, shrink_reference
from lora_kernels.shrink import launch_shrink
from lora_kernels.worklist import persistent_programs
from serve_bridge.command_line import Parser

VARIANTS = ("base", "in order", "shrink beside", "shrink beside, 4/SM", "vLLM dual stream")


def label(kind: str, groups: dict[int, int]) -> str:
    """'<kind> <rows> rows, <adapters> x <rows each> + ...' for a batch of `groups` (id → rows; -1: none)."""
    sizes = Counter(n for lora, n in groups.items() if lora >= 0)
    parts = [f"{count} x {rows}" if count > 1 else str(rows) for rows, count in sorted(sizes.items(), reverse=True)]
    return f"{kind} {sum(groups.values())} rows, " + " + ".join(parts)


def batches(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Token→adapter mappings: decode-only, prefill-only and the mixed steps a server runs."""
    specs = [
        ("decode", {i: 2 for i in range(32)}),
        ("decode", {i: 2 for i in range(128)}),
        ("mixed", {i: 192 for i in range(4)} | {i: 2 for i in range(4, 128)} | {-1: 1024 - 4 * 192 - 2 * 124}),
        ("mixed", {-1: 2, 0: 1792} | {i: 2 for i in range(1, 128)}),
        ("prefill", {i: 256 for i in range(8)}),
    ]
    return {label(kind, groups): mapping_from_groups(groups, gen) for kind, groups in specs}


class Overlap:
    """The kernel benchmark's layer, metadata and work list (:class:`Bench`, without vLLM), the base
    weights, and each variant's step."""

    def __init__(self, gen: torch.Generator) -> None:
        self.bench = Bench(gen, with_vllm=False)
        self.layer, self.worklist = self.bench.layer, self.bench.worklist
        self.weights = [(torch.randn(sum(op.widths), op.hidden, device=DEVICE, generator=gen)
                         * op.hidden ** -0.5).to(DTYPE) for op in OPS]
        self.aux = torch.cuda.Stream()
        self.events = [(torch.cuda.Event(), torch.cuda.Event()) for _ in OPS]
        self.delta = [torch.empty(MAX_TOKENS, sum(op.widths), dtype=DTYPE, device=DEVICE) for op in OPS]

    def load(self, mapping: torch.Tensor) -> LoRABatchMeta:
        """The batch's metadata in the static buffers, the work list refreshed (:meth:`Bench.load`)."""
        return self.bench.load(mapping)[1]

    def step(self, variant: str, meta: LoRABatchMeta, m: int) -> Callable[[], None]:
        """One replayable layer of `variant` for the first m rows."""
        per_sm = 4 if variant.endswith("4/SM") else None
        programs = persistent_programs(DEVICE)
        aux_programs = persistent_programs(DEVICE, per_sm) if per_sm else programs
        parts = self.layer.partials_for(LinearKnobs().k_chunk)
        ops = []
        for i, t in enumerate(self.layer.ops):
            x, y = t.x[:m], t.y[:m]
            ops.append((x, y, self.weights[i], linear_config(y, x, t.lora_a, t.lora_b), parts[i][:, :, :m],
                        self.delta[i][:m], self.events[i]))

        def shrink(cfg: LinearConfig, x: torch.Tensor, part: torch.Tensor, n: int) -> None:
            launch_shrink(cfg.shrink, x, part, meta, self.worklist, num_programs=n)

        def expand(cfg: LinearConfig, part: torch.Tensor, y: torch.Tensor, add: bool = True) -> None:
            launch_expand(cfg.expand, part, y, meta, self.worklist, add_inputs=add, num_programs=programs)

        def run() -> None:
            main = torch.cuda.current_stream()
            for x, y, w, cfg, part, delta, (forked, joined) in ops:
                if variant in ("base", "in order"):
                    torch.mm(x, w.t(), out=y)
                    if variant == "in order":
                        shrink(cfg, x, part, programs)
                        expand(cfg, part, y)
                    continue
                forked.record(main)
                with torch.cuda.stream(self.aux):
                    self.aux.wait_event(forked)
                    if variant == "vLLM dual stream":
                        delta.zero_()
                        shrink(cfg, x, part, programs)
                        expand(cfg, part, delta, add=False)
                    else:
                        shrink(cfg, x, part, aux_programs)
                    joined.record(self.aux)
                torch.mm(x, w.t(), out=y)
                main.wait_event(joined)
                if variant == "vLLM dual stream":
                    y.add_(delta)
                else:
                    expand(cfg, part, y)
        return run

    def outputs(self, fn: Callable[[], None], m: int) -> list[torch.Tensor]:
        fn()
        torch.cuda.synchronize()
        return [t.y[:m].clone() for t in self.layer.ops]

    def reference(self, mapping: torch.Tensor) -> list[torch.Tensor]:
        """Each op's base output with the LoRA update of `lora_kernels.reference` added, first m rows."""
        m = mapping.numel()
        mapping = mapping.to(DEVICE)
        return [expand_reference(shrink_reference(t.x[:m], t.lora_a, mapping), t.lora_b, t.x[:m] @ w.t(), mapping)
                for t, w in zip(self.layer.ops, self.weights)]


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    add_out_options(parser, "the table")
    args = parser.parse_args()
    check_out(args)
    emit = Printed()

    with torch.inference_mode():
        bench = Overlap(torch.Generator(device=DEVICE).manual_seed(0))
        emit(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
             f"{datetime.date.today().isoformat()} | Llama-3.2-3B layer, rank 8, {MAX_LORAS} slots, bf16")
        emit()
        emit("µs per layer (graph replay, mean of 100); LoRA = variant − base; saved = 1 − LoRA / in-order LoRA.")
        emit()
        columns = ["batch", *(f"{v} µs" for v in VARIANTS), "LoRA in order",
                   *(f"LoRA {v} (saved)" for v in VARIANTS[2:]), "max err vs reference", "same bits as in order"]
        emit("| " + " | ".join(columns) + " |")
        emit("|" + "---|" * len(columns))
        for name, mapping in batches(torch.Generator().manual_seed(0)).items():
            m = mapping.numel()
            meta = bench.load(mapping)
            full = bench.reference(mapping)
            us, outs = {}, {}
            for variant in VARIANTS:
                fn = bench.step(variant, meta, m)
                outs[variant] = bench.outputs(fn, m)
                us[variant] = replay_us(capture(fn))
            base_out = outs["base"]
            err = max(update_rel_err(o, r, b) for v in VARIANTS[1:] for o, r, b in zip(outs[v], full, base_out))
            same = all(torch.equal(o, r) for v in VARIANTS[2:4] for o, r in zip(outs[v], outs["in order"]))
            lora = {v: us[v] - us["base"] for v in VARIANTS[1:]}
            emit(f"| {name} | " + " | ".join(f"{us[v]:.1f}" for v in VARIANTS) + f" | {lora['in order']:.1f} | "
                 + " | ".join(f"{lora[v]:.1f} ({1 - lora[v] / lora['in order']:+.0%})" for v in VARIANTS[2:])
                 + f" | {err:.1e} | {'yes' if same else 'NO'} |")
    emit.write(args.out)


if __name__ == "__main__":
    main()
