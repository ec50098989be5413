"""How busy a server's GPU was during a run: ``nvidia-smi``'s ``utilization.gpu`` sampled every
100 ms (the share of the last sample period in which a kernel ran), averaged over the run's
steady part.

Semantics: :class:`BusySampler` runs ``nvidia-smi --query-gpu=utilization.gpu -lms 100 -i GPU``
beside a client run and keeps each sample with the monotonic time it arrived. :meth:`BusySampler.
mean` averages the samples of a window; :func:`steady_window` is the window of a ``vllm bench
serve`` run: the middle 80% of its benchmark duration, taken to end when the client exits (its
result saved and printed within :data:`EXIT_S`), so that neither the client's start-up nor its
drain counts. A step time well above the GPU's busy share of it points at the host (scheduling,
input preparation, the plugin's per-step work); near 100% at the GPU. Without ``nvidia-smi``, or
when it fails, the share is None and the run goes on: a diagnostic never stops a benchmark.
"""
from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO

from benchmarks.serving.placement import Gpu, visible_gpus

PERIOD_MS = 100
EXIT_S = 2.0  # from the end of the benchmark's requests to the client's exit (metrics, result file)
STEADY = (0.1, 0.9)  # the share of the duration averaged: its middle 80%


def command(gpu: Gpu, environ: Mapping[str, str] = os.environ) -> list[str]:
    """The sampling command for ``gpu`` (a CUDA_VISIBLE_DEVICES entry, as nvidia-smi's -i takes it;
    None, a mode not placed: the first GPU ``environ`` lets the server see, else GPU 0)."""
    target = gpu if gpu is not None else next(iter(visible_gpus(environ)), "0")
    return ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-lms", str(PERIOD_MS),
            "-i", target]


def parse_sample(line: str) -> float | None:
    """A sample line's utilization in percent (0–100), or None for anything else."""
    text = line.strip()
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0.0 <= value <= 100.0 else None


def steady_window(exit_time: float, duration_s: float) -> tuple[float, float]:
    """(start, end) in monotonic time of the steady part of a run whose client exited at
    ``exit_time`` after ``duration_s`` of benchmark (module doc)."""
    end = exit_time - EXIT_S
    return end - (1.0 - STEADY[0]) * duration_s, end - (1.0 - STEADY[1]) * duration_s


class BusySampler:
    """``with BusySampler(cmd) as busy: ...`` samples while the block runs (module doc)."""

    def __init__(self, cmd: Sequence[str]) -> None:
        self.cmd = list(cmd)
        self.samples: list[tuple[float, float]] = []
        self._proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> BusySampler:
        try:
            self._proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            return self  # no sampler: mean() is None
        assert self._proc.stdout is not None
        self._reader = threading.Thread(target=self._read, args=(self._proc.stdout,), daemon=True)
        self._reader.start()
        return self

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            value = parse_sample(line)
            if value is not None:
                self.samples.append((time.monotonic(), value))

    def __exit__(self, *exc: object) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=5)

    def mean(self, start: float, end: float) -> float | None:
        """The mean utilization (%) of the samples that arrived in [start, end]; None without any."""
        values = [v for t, v in self.samples if start <= t <= end]
        return sum(values) / len(values) if values else None
