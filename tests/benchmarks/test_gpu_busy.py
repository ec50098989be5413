"""The GPU busy share (benchmarks/serving/gpu_busy.py): its samples, its window, and a real
sampling process (a Python stand-in for nvidia-smi's output stream: this machine has no GPU)."""
from __future__ import annotations

import sys
import time

import pytest

from benchmarks.serving import gpu_busy


def test_command_and_samples():
    assert gpu_busy.command("3")[-2:] == ["-i", "3"]
    assert gpu_busy.command(None, {"CUDA_VISIBLE_DEVICES": "2,1"})[-2:] == ["-i", "2"]  # where the server runs
    assert gpu_busy.command(None, {"CUDA_VISIBLE_DEVICES": ""})[-2:] == ["-i", "0"]
    assert "--query-gpu=utilization.gpu" in gpu_busy.command(None)
    assert [gpu_busy.parse_sample(x) for x in ("87\n", " 100 ", "0", "[N/A]", "", "101", "-1")] == \
        [87.0, 100.0, 0.0, None, None, None, None]


def test_steady_window_is_the_middle_of_the_run_before_the_exit():
    start, end = gpu_busy.steady_window(exit_time=1000.0, duration_s=20.0)
    end_of_requests = 1000.0 - gpu_busy.EXIT_S
    assert start == pytest.approx(end_of_requests - 18.0) and end == pytest.approx(end_of_requests - 2.0)


def test_sampler_keeps_timed_samples_and_stops_its_process():
    script = ("import time\nfor v in (10, 'x', 30, 50):\n    print(v, flush=True)\n    time.sleep(0.05)\n"
              "time.sleep(60)")
    t0 = time.monotonic()
    with gpu_busy.BusySampler([sys.executable, "-c", script]) as busy:
        deadline = time.monotonic() + 30
        while len(busy.samples) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
    assert [v for _, v in busy.samples] == [10.0, 30.0, 50.0]  # 'x' is not a sample
    assert busy._proc is not None and busy._proc.poll() is not None  # terminated, not left running
    assert busy.mean(t0, time.monotonic()) == pytest.approx(30.0)
    assert busy.mean(busy.samples[1][0], busy.samples[2][0]) == pytest.approx(40.0)
    assert busy.mean(0.0, t0) is None


def test_no_sampler_means_no_share():
    with gpu_busy.BusySampler(["/no/such/nvidia-smi"]) as busy:
        pass
    assert busy.samples == [] and busy.mean(0.0, time.monotonic()) is None
