"""Where an engine step's time goes: a torch-profiler window over ``LLMEngine.step()`` calls.

The benchmark harness (``python -m benchmarks.serving.bench --profile-steps N``) uses it after the timed
run, on a fresh copy of the workload, so the profiler's own overhead never touches the timed
numbers. The summary answers one question first: is the step bound by the GPU or by the host?

- *GPU busy*: the union of all device-kernel intervals inside the window, over the window's wall
  time. Well below 1 means the GPU waits on the host (Python, kernel launches, scheduling).
- Kernels ranked by their device time, and host operators ranked by their self CPU time, each
  per profiled step.

Profiler wall times include its own overhead on the host (every operator is recorded); device
kernel durations are not affected.

:func:`python_profile` is the host-side complement: ``cProfile`` over further steps, for the
Python functions (vLLM's runner, the plugin's hooks, the scheduler) that the operator table
cannot name. cProfile slows Python calls down, so its times are only compared within a window.

:func:`trace_summary` reads the same question off a server: the Chrome trace that vLLM's own
profiler (``--profiler-config``, ``POST /start_profile``; ``vllm/profiler/wrapper.py``, docs/vllm_integration.md
§12b) writes for its engine-core worker. The worker marks each ``execute_model`` with a
``user_annotation`` named ``execute_context_C(c)_generation_G(g)``:
C prefill requests of c tokens, G decoding requests of g tokens. Between two of them the engine core
schedules, samples and hands out the previous step's output.
"""
from __future__ import annotations

import cProfile
import gzip
import io
import json
import pstats
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

_STEP = re.compile(r"execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)")
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")  # a Chrome trace's device-side events
LORA_OP = "lorazor::gridtrim_lora_linear"  # GridTrim's LoRA linear as a compiled graph calls it (serve_bridge.gridtrim)
# LoRA kernels by name: GridTrim's (lora_kernels: _shrink_/_expand_worklist_kernel, _grid_kernel) and vLLM's
# (_lora_shrink_kernel, _lora_expand_kernel)
LORA_KERNEL = re.compile(r"shrink|expand", re.IGNORECASE)


def busy_time_us(intervals: Sequence[tuple[float, float]]) -> float:
    """Length of the union of half-open ``[start, end)`` intervals (any unit, any order)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def _device_events(events: Sequence[Any]) -> list[Any]:
    """Kernel and memcpy/memset events (or their averages) that ran on a device, not host operators
    (whose ``self_device_time_total`` repeats the time of the kernels they launched)."""
    return [e for e in events if str(getattr(e, "device_type", "")).endswith(("CUDA", "PrivateUse1"))]


def _table(title: str, rows: list[tuple[str, int, float]], n_steps: int, total_us: float, top: int) -> list[str]:
    out = [f"{title}", "| name | calls/step | ms/step | share |", "|---|---|---|---|"]
    for name, calls, us in sorted(rows, key=lambda r: -r[2])[:top]:
        short = name if len(name) <= 90 else name[:87] + "..."
        out.append(f"| `{short}` | {calls / n_steps:.1f} | {us / n_steps / 1e3:.3f} | "
                   f"{us / total_us if total_us else 0.0:.1%} |")
    return out


def summarize(prof: Any, wall_s: float, n_steps: int, top: int = 20) -> str:
    """A Markdown summary of a finished ``torch.profiler.profile`` over ``n_steps`` engine steps
    that took ``wall_s`` seconds under the profiler: GPU busy fraction, then the top device kernels
    and the top host operators (self CPU time), each per step."""
    events = prof.events()
    dev = _device_events(events)
    busy_us = busy_time_us([(e.time_range.start, e.time_range.end) for e in dev])
    wall_us = wall_s * 1e6
    lines = [f"profiled steps: {n_steps}, wall {wall_s * 1e3 / max(n_steps, 1):.2f} ms/step under the profiler",
             f"GPU busy (union of device kernels): {busy_us / max(n_steps, 1) / 1e3:.2f} ms/step, "
             f"{busy_us / wall_us if wall_us else 0.0:.1%} of the wall time", ""]
    averages = prof.key_averages()
    on_device = set(map(id, _device_events(averages)))
    kernels = [(a.key, a.count, a.self_device_time_total) for a in averages if id(a) in on_device]
    host = [(a.key, a.count, a.self_cpu_time_total) for a in averages
            if id(a) not in on_device and a.self_cpu_time_total > 0]
    lines += _table("Device time by kernel:", kernels, max(n_steps, 1), sum(k[2] for k in kernels), top)
    lines.append("")
    lines += _table("Host time by operator (self CPU):", host, max(n_steps, 1), sum(h[2] for h in host), top)
    return "\n".join(lines) + "\n"


def profile_steps(step: Callable[[], Any], has_work: Callable[[], bool], n_steps: int, skip: int = 0,
                  cuda: bool = True) -> tuple[Any, float, int]:
    """Call ``step()`` ``skip`` times unprofiled, then up to ``n_steps`` times under the profiler
    (CPU, and CUDA when ``cuda``), stopping early when ``has_work()`` turns false. Returns the
    profiler, the profiled wall time in seconds (synchronized before and after) and the number of
    profiled steps."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(skip):
        if not has_work():
            break
        step()
    sync = torch.cuda.synchronize if cuda and torch.cuda.is_available() else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda and torch.cuda.is_available() else [])
    done = 0
    with profile(activities=activities) as prof:
        sync()
        start = time.perf_counter()
        while done < n_steps and has_work():
            step()
            done += 1
        sync()
        wall = time.perf_counter() - start
    return prof, wall, done


def python_profile(step: Callable[[], Any], has_work: Callable[[], bool], n_steps: int,
                   top: int = 30) -> tuple[str, int]:
    """Up to ``n_steps`` calls of ``step()`` under ``cProfile`` (stopping when ``has_work()`` turns
    false). Returns the ``top`` functions by cumulative time and by own time, as text, and the
    number of steps profiled."""
    prof = cProfile.Profile()
    done = 0
    start = time.perf_counter()
    while done < n_steps and has_work():
        prof.enable()
        step()
        prof.disable()
        done += 1
    wall = time.perf_counter() - start
    out = io.StringIO()
    out.write(f"cProfile: {done} steps, {wall * 1e3 / max(done, 1):.2f} ms/step under cProfile\n")
    stats = pstats.Stats(prof, stream=out).strip_dirs()
    for key in ("cumulative", "tottime"):
        out.write(f"\nby {key} time:\n")
        stats.sort_stats(key).print_stats(top)
    return out.getvalue(), done


def trace_summary(path: Path, graph_tokens: int | None = None) -> dict[str, float | int | None]:
    """Per-step figures of a vLLM worker's Chrome trace (``.json`` or ``.json.gz``), over the window
    from the first step's start to the last step's end:

    - ``steps``; ``step_ms``: the mean time from one step's start to the next;
    - ``execute_ms``: the mean host time inside ``execute_model`` (input preparation, launches, the
      plugin's hooks) of the same steps, every one but the last; ``outside_ms`` = ``step_ms`` −
      ``execute_ms``, the mean time from a step's end to the next one's start, the engine core's share;
    - ``gpu_busy``: the union of device events over the window, as a share (None without any), and
      ``device_events`` per step (what CUPTI recorded: a step replayed from a CUDA graph shows
      its kernels only where the profiler traces graph nodes);
    - ``tokens``, ``decoding``: mean scheduled tokens and decoding requests per step;
    - ``lora_kernel_ms``: device time per step of the LoRA kernels (:data:`LORA_KERNEL`; None without
      device events); ``op_calls`` per step and ``op_us``, the mean host µs per call, of
      :data:`LORA_OP` (the calls a compiled engine makes where no CUDA graph replays the step;
      ``op_us`` None without calls);
    - with ``graph_tokens`` (the server's largest CUDA graph): ``past_graphs``, the steps of more
      tokens, which run without a graph, and the mean ``execute_model`` ms of those
      (``past_execute_ms``) and of the others (``within_execute_ms``; None for an empty group).

    Raises ValueError for a file that is not such a trace or holds fewer than two steps."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt") as f:
            events = json.load(f)
    except (OSError, EOFError, ValueError) as e:
        raise ValueError(f"{path}: not a readable Chrome trace ({e})") from None
    events = events.get("traceEvents", []) if isinstance(events, dict) else events
    steps, device, lora, ops = [], [], [], []
    for e in events:
        if not isinstance(e, dict) or e.get("ph") != "X" or "ts" not in e or "dur" not in e:
            continue
        start, end, name = float(e["ts"]), float(e["ts"]) + float(e["dur"]), str(e.get("name", ""))
        m = _STEP.fullmatch(name)
        if e.get("cat") == "user_annotation" and m:
            steps.append((start, end, int(m[2]) + int(m[4]), int(m[3])))
        elif e.get("cat") in DEVICE_CATEGORIES:
            device.append((start, end))
            if LORA_KERNEL.search(name):
                lora.append((start, end))
        elif e.get("cat") == "cpu_op" and name == LORA_OP:
            ops.append((start, end))
    if len(steps) < 2:
        raise ValueError(f"{path}: {len(steps)} execute_model step(s) in the trace, at least 2 needed")
    steps.sort()
    n, (first, last) = len(steps), (steps[0][0], max(s[1] for s in steps))
    step_ms = (steps[-1][0] - first) / (n - 1) / 1e3
    execute_ms = sum(s[1] - s[0] for s in steps[:-1]) / (n - 1) / 1e3

    def clip(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
        return [(max(s, first), min(e, last)) for s, e in intervals if e > first and s < last]

    def mean_ms(group: list[tuple[float, float, int, int]]) -> float | None:
        return sum(s[1] - s[0] for s in group) / len(group) / 1e3 if group else None

    clipped, calls = clip(device), [e - s for s, e in ops if first <= s < last]
    summary: dict[str, float | int | None] = {
        "steps": n, "step_ms": step_ms, "execute_ms": execute_ms, "outside_ms": step_ms - execute_ms,
        "gpu_busy": busy_time_us(clipped) / (last - first) if device else None, "device_events": len(clipped) / n,
        "tokens": sum(s[2] for s in steps) / n, "decoding": sum(s[3] for s in steps) / n,
        "lora_kernel_ms": sum(e - s for s, e in clip(lora)) / n / 1e3 if device else None,
        "op_calls": len(calls) / n, "op_us": sum(calls) / len(calls) if calls else None}
    if graph_tokens is not None:
        past = [s for s in steps if s[2] > graph_tokens]
        summary |= {"graph_tokens": graph_tokens, "past_graphs": len(past), "past_execute_ms": mean_ms(past),
                    "within_execute_ms": mean_ms([s for s in steps if s[2] <= graph_tokens])}
    return summary


def trace_line(summary: dict[str, float | int | None]) -> str:
    """One line of :func:`trace_summary`'s figures (those it has)."""
    busy = summary["gpu_busy"]
    line = (f"{summary['steps']} steps of {summary['step_ms']:.2f} ms: "
            f"{summary['execute_ms']:.2f} ms in execute_model, "
            f"{summary['outside_ms']:.2f} ms outside it; GPU busy {'—' if busy is None else f'{busy:.0%}'} "
            f"({summary['device_events']:.0f} device events per step); "
            f"{summary['tokens']:.1f} tokens and {summary['decoding']:.1f} decoding requests per step")

    def ms(key: str) -> str:
        value = summary[key]
        return "—" if value is None else f"{value:.2f}"

    if summary.get("graph_tokens") is not None:
        line += (f"; past the {summary['graph_tokens']}-token graph: {summary['past_graphs']} steps of "
                 f"{ms('past_execute_ms')} ms in execute_model, within: {ms('within_execute_ms')} ms")
    if summary.get("lora_kernel_ms") is not None:
        line += f"; LoRA kernels {summary['lora_kernel_ms']:.2f} ms per step"
    if summary.get("op_us") is not None:
        line += f"; {LORA_OP} {summary['op_calls']:.1f} calls per step, {summary['op_us']:.0f} µs of host each"
    return line
