"""The step profiler's arithmetic and its torch.profiler window (CPU)."""
import random

import pytest
import torch

from benchmarks.serving.step_profile import busy_time_us, profile_steps, python_profile, summarize


def test_busy_time_is_the_union_of_intervals():
    assert busy_time_us([]) == 0.0
    assert busy_time_us([(5, 7), (0, 2), (1, 3), (6, 6.5), (10, 11)]) == pytest.approx(3 + 2 + 1)
    rng = random.Random(0)
    for _ in range(50):
        ivs = [(s, s + rng.randint(1, 9)) for s in (rng.randint(0, 60) for _ in range(rng.randint(1, 12)))]
        covered = {t for s, e in ivs for t in range(s, e)}  # unit cells of integer intervals
        assert busy_time_us(ivs) == len(covered)


def test_profile_window_skips_stops_and_summarizes():
    x = torch.randn(64, 64)
    calls = []

    def step():
        calls.append(1)
        torch.relu(x @ x)

    prof, wall, done = profile_steps(step, lambda: len(calls) < 100, n_steps=5, skip=3, cuda=False)
    assert (done, len(calls)) == (5, 8) and wall > 0
    text = summarize(prof, wall, done)
    assert text.startswith("profiled steps: 5,") and "GPU busy (union of device kernels): 0.00 ms/step" in text
    host = text.split("Host time by operator (self CPU):")[1]
    mm = next(line for line in host.splitlines() if "`aten::mm`" in line)
    assert mm.split("|")[2].strip() == "1.0"  # one matmul per step
    # the work runs out inside the window
    calls.clear()
    _, _, done = profile_steps(step, lambda: len(calls) < 6, n_steps=5, skip=3, cuda=False)
    assert done == 3


def test_python_profile_names_the_step_functions():
    calls = []

    def step_function_under_test():
        calls.append(sorted(range(200), key=lambda v: -v))

    text, done = python_profile(step_function_under_test, lambda: len(calls) < 4, n_steps=10)
    assert done == 4 and text.startswith("cProfile: 4 steps,")
    assert "by cumulative time:" in text and "by tottime time:" in text
    assert "step_function_under_test" in text.split("by tottime time:")[0]
