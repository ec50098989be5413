"""The step profiler's arithmetic and its torch.profiler window (CPU)."""
import gzip
import json
import random
import time

import pytest
import torch

from benchmarks.serving.step_profile import busy_time_us, profile_steps, python_profile, summarize, trace_line
from benchmarks.serving.step_profile import trace_summary as summarize_trace


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


def _execute_trace(tmp_path, steps, gzipped):
    """A Chrome trace that torch.profiler writes on this CPU: ``steps`` annotated execute_model
    calls (vLLM's worker annotation) with a sleep between them."""
    x = torch.randn(64, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for ctx, gen in steps:
            with torch.profiler.record_function(f"execute_context_{len(ctx)}({sum(ctx)})_generation_{gen}({gen})"):
                torch.relu(x @ x)
            time.sleep(0.002)
    path = tmp_path / "worker.pt.trace.json"
    prof.export_chrome_trace(str(path))
    if gzipped:
        gz = path.with_suffix(".json.gz")
        gz.write_bytes(gzip.compress(path.read_bytes()))
        path.unlink()
        path = gz
    return path


@pytest.mark.parametrize("gzipped", [False, True])
def test_trace_summary_reads_vllms_step_annotations(tmp_path, gzipped):
    rng = random.Random(gzipped)
    steps = [([rng.randint(1, 300) for _ in range(rng.randint(0, 3))], rng.randint(1, 64)) for _ in range(7)]
    summary = summarize_trace(_execute_trace(tmp_path, steps, gzipped))
    assert summary["steps"] == 7 and summary["gpu_busy"] is None  # no device on this CPU
    assert summary["tokens"] == pytest.approx(sum(sum(c) + g for c, g in steps) / 7)
    assert summary["decoding"] == pytest.approx(sum(g for _, g in steps) / 7)
    # a 2 ms sleep lies between each step and the next, outside execute_model
    assert summary["outside_ms"] >= 2.0 - 1e-6 and summary["step_ms"] == pytest.approx(
        summary["execute_ms"] + summary["outside_ms"])
    line = trace_line(summary)
    assert line.startswith("7 steps of ") and "GPU busy — (0 device events per step)" in line


def test_trace_summary_counts_device_time_inside_the_window(tmp_path):
    steps = [{"ph": "X", "cat": "user_annotation", "name": "execute_context_0(0)_generation_4(4)", "ts": t, "dur": 3}
             for t in (100, 110, 120)]
    kernels = [{"ph": "X", "cat": "kernel", "name": "k", "ts": s, "dur": d}
               for s, d in ((90, 15), (112, 4), (114, 4), (121, 100))]  # clipped to [100, 123): 5 + 6 + 2
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": steps + kernels}))
    summary = summarize_trace(path)
    assert summary["steps"] == 3 and summary["step_ms"] == pytest.approx(0.010)
    assert summary["gpu_busy"] == pytest.approx(13 / 23) and summary["device_events"] == pytest.approx(4 / 3)


def test_trace_summary_splits_steps_at_the_largest_graph_and_times_lora(tmp_path):
    """Steps of more tokens than the largest CUDA graph apart from the others; GridTrim's op calls
    (host µs each) and the LoRA kernels' device time per step, in the window only."""
    step = "execute_context_{}({})_generation_{}({})"
    steps = [{"ph": "X", "cat": "user_annotation", "name": step.format(c, ct, g, g), "ts": t, "dur": d}
             for t, d, c, ct, g in ((100, 10, 1, 500, 12), (200, 40, 2, 600, 12), (300, 6, 0, 0, 16),
                                    (400, 8, 0, 0, 16))]
    ops = [{"ph": "X", "cat": "cpu_op", "name": "lorazor::gridtrim_lora_linear", "ts": t, "dur": d}
           for t, d in ((50, 99), (205, 10), (215, 14), (225, 12))]  # the first before the window
    kernels = [{"ph": "X", "cat": "kernel", "name": n, "ts": t, "dur": 4}
               for n, t in (("_shrink_worklist_kernel", 110), ("_expand_worklist_kernel", 120),
                            ("_lora_shrink_kernel", 230), ("nvjet_gemm", 130), ("_expand_worklist_kernel", 500))]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": steps + ops + kernels}))
    summary = summarize_trace(path, graph_tokens=512)
    assert summary["past_graphs"] == 1 and summary["past_execute_ms"] == pytest.approx(0.040)
    assert summary["within_execute_ms"] == pytest.approx((10 + 6 + 8) / 3 / 1e3)
    assert summary["op_calls"] == pytest.approx(3 / 4) and summary["op_us"] == pytest.approx(12.0)
    assert summary["lora_kernel_ms"] == pytest.approx(12 / 4 / 1e3)  # the last kernel lies past the window
    line = trace_line(summary)
    assert line.endswith("; past the 512-token graph: 1 steps of 0.04 ms in execute_model, within: 0.01 ms; "
                         "LoRA kernels 0.00 ms per step; lorazor::gridtrim_lora_linear 0.8 calls per step, "
                         "12 µs of host each")
    plain = summarize_trace(path)
    assert "past_graphs" not in plain and "graph" not in trace_line(plain)


@pytest.mark.parametrize("content", ["not json", json.dumps({"traceEvents": []})])
def test_trace_summary_refuses_what_is_no_step_trace(tmp_path, content):
    path = tmp_path / "t.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=str(path)):
        summarize_trace(path)
