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
"""
from __future__ import annotations

import cProfile
import io
import pstats
import time
from collections.abc import Callable, Sequence
from typing import Any


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
