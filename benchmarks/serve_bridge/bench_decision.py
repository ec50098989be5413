"""Per-step cost of StepTrim release decisions in the serving runtime (target: p95 ≤ 0.05 ms per
step at 256 requests with 128 learned heads). torch only, no vLLM.

    python -m benchmarks.serve_bridge.bench_decision --out DIR            # on the GPU (--replace: over an earlier run)
    python -m benchmarks.serve_bridge.bench_decision --out DIR --device cpu --steps 20

For 128 learned heads at hidden size 3072, each row count (32, 128, 256 tracked requests, all
decided every step: the heads never fire) and each mode, it builds a
:class:`serve_bridge.runtime.ReleaseRuntime` and simulates the engine for ``--steps`` steps
after a warm-up:

    begin_step (vLLM: set_active_loras in _prepare_inputs) · enqueue a ~1 ms dummy GPU
    workload (the forward) · decide(hidden) · synchronize (vLLM's sampler sync) · resolve

so the decision's GPU work queues behind the forward, as in vLLM, and its two events time the
GPU work itself, not host launch gaps (as long as decide() takes less host time than the forward).

Modes: ``graph`` (the runtime as shipped: StepTrim's kernel replayed as a CUDA graph),
``eager`` (the same buffers and kernel, launched directly) and ``old`` (the runtime before
the launcher existed: per-step ``torch.tensor(...).pin_memory()`` metadata and the former
~20-op StepTrim).
Profiled policies launch no decision: ``begin_step`` applies k on the host as it plans a step, so
their per-step cost is ``begin_step``'s (``benchmarks.serve_bridge.bench_step_host``).
Columns: host time of the engine thread in decide() and in resolve() (perf_counter), their
sum per step, and the GPU time between the decision's two CUDA events (off CUDA, and for
host-side decisions, the host time of decide()), in µs over the timed steps.

It also checks the decisions: on random inputs with firing rows, the runtime's launcher
(graph and eager) gives the same fired rows and scores, bit for bit, as StepTrim on the same
device, and the same fired rows as StepTrim on the CPU except rows whose score is within 1e-4
of τ (the GPU kernel's float32 row sum may round differently from the CPU's).
"""
from __future__ import annotations

import datetime as dt
import json
import platform
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np
import torch

from benchmarks.printed import add_out_dir_options, check_out
from serve_bridge.bundle import AdapterEntry, Bundle
from serve_bridge.command_line import Parser, number
from serve_bridge.decision import DecisionLauncher
from serve_bridge.runtime import ReleaseRuntime, _Pending
from serve_bridge.safe_write import write_atomic
from serve_bridge.steptrim import LearnedPolicy, ProfiledPolicy, StepTrim

PROMPT = 64
MODES = ("graph", "eager", "old")
OUT_FILES = ("bench_decision.md", "bench_decision.json")


def make_runtime(heads: int, hidden: int, device: str, mode: str, max_rows: int, seed: int = 0,
                 policy: str = "learned") -> ReleaseRuntime:
    """A runtime over an in-memory bundle of ``heads`` adapters that never fire: learned heads,
    or with ``policy="profiled"`` a k no response reaches (``bench_step_host``'s serving case)."""
    g = torch.Generator().manual_seed(seed)
    entries, policies = {}, {}
    for i in range(heads):
        name = f"a{i:03d}"
        if policy == "learned":
            w = torch.randn(hidden, generator=g) / hidden ** 0.5
            entries[name] = AdapterEntry(name, "0" * 64, "learned", tau=-1e30, weight=w.numpy(), bias=0.1)
        else:
            entries[name] = AdapterEntry(name, "0" * 64, "profiled", k=1 << 20)
        policies[name] = entries[name].to_policy()
    bundle = Bundle(Path("(in memory)"), 1, "bench", "bench", hidden, "0" * 64, entries, policies)
    names = sorted(entries)
    steptrim = StepTrim([policies[n] for n in names], hidden, device)
    cls = OldRuntime if mode == "old" else ReleaseRuntime
    return cls(bundle, steptrim, names, verified={n: f"/bench/{n}" for n in names}, log_interval_s=0,
               max_rows=max_rows, cuda_graphs=mode == "graph", latency_window=1 << 20)


class _OldStepTrim:
    """StepTrim's tensor ops before this change (stacked kind/k/w/b/tau, ~20 ops a step)."""

    def __init__(self, st: StepTrim) -> None:
        n = len(st.policies)
        self.kind = torch.zeros(n + 1, dtype=torch.long)
        self.k = torch.zeros(n + 1, dtype=torch.long)
        self.w = torch.zeros(n + 1, st.hidden_size)
        self.b, self.tau = torch.zeros(n + 1), torch.zeros(n + 1)
        for i, p in enumerate(st.policies):
            if isinstance(p, ProfiledPolicy):
                self.kind[i], self.k[i] = 1, p.k
            elif isinstance(p, LearnedPolicy):
                self.kind[i], self.w[i], self.b[i], self.tau[i] = 2, p.weight.float(), p.bias, p.tau
        self.kind, self.k, self.w, self.b, self.tau = (x.to(st.device) for x in
                                                       (self.kind, self.k, self.w, self.b, self.tau))
        self.needs_hidden = st.needs_hidden

    def step(self, slots, t, released, hidden):
        idx = torch.where(slots < 0, torch.full_like(slots, self.kind.numel() - 1), slots)
        kind = self.kind[idx]
        fire = (kind == 1) & (t >= self.k[idx])
        if self.needs_hidden:
            s = (hidden.float() * self.w[idx]).sum(-1) + self.b[idx]
            fire |= (kind == 2) & (s < self.tau[idx])
        return released | fire


class OldRuntime(ReleaseRuntime):
    """decide()/resolve() as they were before this change, with the same latency records."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._old = _OldStepTrim(self.steptrim)
        self._old_launches: deque = deque()  # (fired, events) of each unread launch, oldest first

    def decide(self, hidden: torch.Tensor) -> None:
        plan, self._plan = self._plan, None
        if plan is None:
            return
        start = time.perf_counter()
        events = None
        if hidden.is_cuda:
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        meta = torch.tensor([plan.rows, [s.slot for s in plan.states], plan.forwards], dtype=torch.long)
        if hidden.is_cuda:
            meta = meta.pin_memory()
        meta = meta.to(hidden.device, non_blocking=True)
        released = torch.zeros(len(plan.rows), dtype=torch.bool, device=hidden.device)
        rows_hidden = hidden.index_select(0, meta[0]) if self._old.needs_hidden else None
        fired = self._old.step(meta[1], meta[2], released, rows_hidden).to("cpu", non_blocking=True)
        if events is not None:
            events[1].record()
        self._old_launches.append((fired, events))
        self._pending.append(_Pending(plan.states, plan.forwards, plan.req_ids, (time.perf_counter() - start) * 1e3))

    def _apply(self, p: _Pending) -> None:
        start = time.perf_counter()
        fired, events = self._old_launches.popleft()
        if events is not None:
            events[1].synchronize()
            ms = events[0].elapsed_time(events[1])
        else:
            ms = p.host_ms
        for st, t, fire in zip(p.states, p.forwards, fired.tolist()):
            if fire:
                st.release = t
                self.adapters[st.adapter].released += 1
        self.decision_steps += 1
        self.decided_rows += len(p.states)
        self.decision_ms += ms
        self._lat_gpu.append(ms)
        self._lat_decide.append(p.host_ms)
        self._lat_resolve.append((time.perf_counter() - start) * 1e3)


def _forward(device: torch.device, cycles: int) -> None:
    """The dummy forward: keeps the GPU busy for about --forward-ms."""
    if device.type == "cuda" and cycles > 0:
        torch.cuda._sleep(cycles)


def _calibrate_sleep(device: torch.device, forward_ms: float) -> int:
    if device.type != "cuda" or forward_ms <= 0:
        return 0
    probe = 1 << 20
    torch.cuda._sleep(probe)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(probe)
    b.record()
    b.synchronize()
    return int(probe * forward_ms / max(a.elapsed_time(b), 1e-3))


def run_case(rows: int, mode: str, args, device: torch.device, cycles: int) -> dict:
    rt = make_runtime(args.heads, args.hidden, str(device), mode, max(args.rows))
    names = sorted(rt.slot_of)
    req_ids = [f"r{i}" for i in range(rows)]
    lora_ids = np.array([1 + i % len(names) for i in range(rows)])
    for i, r in enumerate(req_ids):
        name = names[i % len(names)]
        rt.add(r, name, f"/bench/{name}", PROMPT)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(1)
    hiddens = torch.randn(4, rows, args.hidden, generator=g, device=device).to(dtype)
    computed = np.zeros(rows, dtype=np.int64)
    scheduled = np.full(rows, PROMPT, dtype=np.int64)
    sampled = tuple(lora_ids.tolist())
    total = args.warmup + args.steps
    for step in range(total):
        if step == args.warmup:
            rt.reset_latency()
        tokens = tuple(np.repeat(lora_ids, scheduled).tolist()) if step == 0 else sampled
        rt.begin_step(req_ids, computed, scheduled, computed + scheduled, tokens, sampled)
        _forward(device, cycles)
        rt.decide(hiddens[step % 4])
        if device.type == "cuda":
            torch.cuda.synchronize()
        rt.resolve()
        computed = computed + scheduled
        scheduled = np.ones(rows, dtype=np.int64)
    c = rt.counters()
    assert c["decision_steps"] == total and c["decided_rows"] == total * rows, c  # every row, every step
    assert c["released_requests"] == 0
    us = {k: v * 1e3 for k, v in c.items() if k.endswith(("_p50", "_p95", "_p99", "_mean")) and "_ms_" in k}
    return {"rows": rows, "heads": args.heads, "hidden": args.hidden, "mode": mode,
            "runs_on": rt._launcher.mode if mode != "old" else ("cuda-eager" if device.type == "cuda" else "cpu"),
            "steps": args.steps, "us": us, "mapping_ms_mean": c["mapping_ms_total"] / total}


def check_decisions(device: torch.device, args) -> list[str]:
    """Launcher (each mode) on random inputs with firing rows against StepTrim on the same device
    (fired rows and, on CUDA, scores: bit for bit, the one-release-semantics rule) and against
    StepTrim on the CPU (fired rows, except within 1e-4 of τ: another device's float32 row sum)."""
    g = torch.Generator().manual_seed(7)
    H, n = args.hidden, args.heads
    pols = []
    for i in range(n):
        r = i % 3
        if r == 0:
            pols.append(LearnedPolicy(torch.randn(H, generator=g) / H ** 0.5, 0.05 * (i % 5),
                                      float(torch.randn(1, generator=g))))
        else:
            pols.append(ProfiledPolicy(i % 7) if r == 1 else None)
    cpu = StepTrim(pols, H)
    same = StepTrim(pols, H, device)
    out = []
    for cuda_graphs in ((True, False) if device.type == "cuda" else (False,)):
        launcher = DecisionLauncher(StepTrim(pols, H, device), max_rows=64, cuda_graphs=cuda_graphs)
        bad_same = bad_cpu = 0
        for trial in range(6):
            rows_total = [5, 37, 64, 200, 3, 256][trial]
            hidden = torch.randn(rows_total, H, generator=g)
            m = int(torch.randint(1, rows_total + 1, (1,), generator=g))
            rows = torch.randperm(rows_total, generator=g)[:m].sort().values
            slots = torch.randint(0, n, (m,), generator=g)
            t = torch.randint(0, 10, (m,), generator=g)
            hd = hidden.to(device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
            launcher.launch(rows.tolist(), slots.tolist(), t.tolist(), hd)
            fired, _ = launcher.result()
            h_same = hd[rows.to(device)]
            want = same.fires(slots.to(device), t.to(device), h_same).cpu().numpy()
            bad_same += int((fired != want).sum())
            if device.type == "cuda":
                bad_same += int((launcher.last_scores() != same.scores(slots.to(device), h_same)).sum())
            h_ref = hd.float().cpu()[rows]
            ref = cpu.fires(slots, t, h_ref).numpy()
            near = ((cpu.scores(slots, h_ref) - cpu.table[slots, 1]).abs() < 1e-4).numpy()
            bad_cpu += int(((fired != ref) & ~near).sum())
        out.append(f"{launcher.mode}: same device {'ok' if bad_same == 0 else f'{bad_same} values DIFFER'}, "
                   f"vs CPU {'ok' if bad_cpu == 0 else f'{bad_cpu} rows DIFFER'}")
    return out


def table(results: list[dict]) -> str:
    head = ("| rows | heads | mode | runs on | decide p50 | decide p95 | decide p99 | resolve p50 | "
            "resolve p95 | decide+resolve p95 | GPU p50 | GPU p95 |")
    lines = [head, "|" + "|".join(["---"] * 12) + "|"]
    for r in results:
        u = r["us"]
        lines.append(f"| {r['rows']} | {r['heads']} | {r['mode']} | {r['runs_on']} | "
                     f"{u['decide_host_ms_p50']:.1f} | {u['decide_host_ms_p95']:.1f} | {u['decide_host_ms_p99']:.1f} | "
                     f"{u['resolve_host_ms_p50']:.1f} | {u['resolve_host_ms_p95']:.1f} | "
                     f"{u['decision_host_ms_p95']:.1f} | {u['decision_gpu_ms_p50']:.1f} | "
                     f"{u['decision_gpu_ms_p95']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = Parser(description=__doc__.split("\n\n")[0])
    add_out_dir_options(ap, OUT_FILES, required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=number("positive_int"), default=None, help="timed steps (500 on CUDA, 20 on CPU)")
    ap.add_argument("--warmup", type=number("non_negative_int"), default=20)
    ap.add_argument("--rows", type=number("positive_int"), nargs="+", default=[32, 128, 256])
    ap.add_argument("--heads", type=number("positive_int"), default=128)
    ap.add_argument("--hidden", type=number("positive_int"), default=3072)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--forward-ms", type=number("non_negative_number"), default=1.0)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if args.steps is None:
        args.steps = 500 if device.type == "cuda" else 20
    check_out(args, OUT_FILES)
    cycles = _calibrate_sleep(device, args.forward_ms)
    results = []
    for rows in args.rows:
        for mode in args.modes:
            if mode == "eager" and device.type != "cuda":
                continue  # identical to graph there: the runtime does not use graphs
            r = run_case(rows, mode, args, device, cycles)
            results.append(r)
            u = r["us"]
            print(f"rows={rows:4d} {mode:5s}: decide p50/p95 {u['decide_host_ms_p50']:.1f}/"
                  f"{u['decide_host_ms_p95']:.1f} µs, resolve p95 {u['resolve_host_ms_p95']:.1f} µs, "
                  f"GPU p50/p95 {u['decision_gpu_ms_p50']:.1f}/{u['decision_gpu_ms_p95']:.1f} µs", flush=True)
    checks = check_decisions(device, args)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    cmd = " ".join(argv if argv is not None else sys.argv[1:])
    md = "\n".join([
        f"# StepTrim decision latency ({dt.date.today().isoformat()}, {name}, torch {torch.__version__})", "",
        f"Command: `python -m benchmarks.serve_bridge.bench_decision {cmd}`",
        f"{args.steps} timed steps after {args.warmup} warm-up steps; dummy forward {args.forward_ms} ms; "
        f"hidden size {args.hidden}; all times in µs.", "",
        table(results), "",
        "Decision check (launcher vs StepTrim on the same device, bit for bit, and on the CPU): "
        + "; ".join(checks), ""])
    print(md)
    write_atomic(args.out / OUT_FILES[0], md)
    write_atomic(args.out / OUT_FILES[1], json.dumps({"device": name, "torch": torch.__version__, "checks": checks,
                                                      "results": results}, indent=1))
    return results


if __name__ == "__main__":
    main()
