"""The runtime's decision path (decide → resolve through the launcher), its latency counters, and
benchmarks/serve_bridge/bench_decision.py, bench_step_host.py, bench_mapping_host.py and
bench_slot_image.py run on the CPU with tiny sizes."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from benchmarks.serve_bridge import bench_decision as bench
from benchmarks.serve_bridge import bench_mapping_host, bench_slot_image, bench_step_host


def _step(rt, req_ids, computed, scheduled, lora):
    tokens = tuple(np.repeat(lora, scheduled).tolist())
    return rt.begin_step(req_ids, computed, scheduled, computed + scheduled, tokens, tuple(lora.tolist()))


def test_decisions_apply_from_the_next_step_and_latency_is_counted():
    rt = bench.make_runtime(heads=3, hidden=8, device="cpu", mode="graph", max_rows=8)
    names = sorted(rt.slot_of)
    rows = 5
    req_ids = [f"r{i}" for i in range(rows)]
    for i, r in enumerate(req_ids):
        rt.add(r, names[i % 3], f"/bench/{names[i % 3]}", 4)
    # make request r1 fire after its second forward (t = 1): a head that scores below τ on the
    # hidden row we feed it at that step
    slot = rt.states["r1"].slot
    table = rt._launcher.steptrim.table
    table[slot, 1] = 0.0  # τ = 0; score = h·w + b with the row's h chosen below
    lora = np.array([1 + i % 3 for i in range(rows)])
    computed, scheduled = np.zeros(rows, np.int64), np.full(rows, 4, np.int64)
    for step in range(4):
        m = _step(rt, req_ids, computed, scheduled, lora)
        sampled = np.asarray(m.sampled_mapping)
        assert sampled[1] == (0 if step >= 2 else lora[1])  # released after t = 1: off from forward 2 on
        hidden = torch.zeros(rows, 8)
        w = table[slot, 3:]
        hidden[1] = -w * (10.0 if step == 1 else -10.0)  # s < 0 only at t = 1 (b is 0.1)
        rt.decide(hidden)
        computed, scheduled = computed + scheduled, np.ones(rows, np.int64)
    rt.resolve()
    # r4 shares r1's adapter; its h gives s = b > 0
    assert {r: rt.states[r].release for r in req_ids} == {r: 1 if r == "r1" else None for r in req_ids}
    c = rt.counters()
    assert c["decision_steps"] == 4 and c["latency_samples"] == 4 and c["decision_mode"] == "cpu"
    for key in ("decide_host", "resolve_host", "decision_host", "decision_gpu"):
        for q in ("p50", "p95", "p99", "mean"):
            assert c[f"{key}_ms_{q}"] >= 0.0
    assert c["decision_host_ms_p95"] >= c["decide_host_ms_p50"] > 0.0
    assert c["decision_ms_mean"] == pytest.approx(c["decision_ms_total"] / 4)
    assert c == rt.counters()  # no NaN: equal on a second read
    assert "host decide+resolve p50/p95" in rt.summary()
    rt.reset_latency()
    assert rt.latency()["latency_samples"] == 0 and rt.latency()["decision_gpu_ms_p95"] == 0.0


def test_latency_window_is_bounded():
    rt = bench.make_runtime(heads=2, hidden=4, device="cpu", mode="graph", max_rows=8)
    rt._lat_decide = type(rt._lat_decide)(maxlen=3)
    rt._lat_resolve = type(rt._lat_resolve)(maxlen=3)
    rt._lat_gpu = type(rt._lat_gpu)(maxlen=3)
    names = sorted(rt.slot_of)
    rt.add("a", names[0], f"/bench/{names[0]}", 2)
    computed, scheduled = np.zeros(1, np.int64), np.full(1, 2, np.int64)
    for _ in range(5):
        _step(rt, ["a"], computed, scheduled, np.array([1]))
        rt.decide(torch.zeros(1, 4))
        computed, scheduled = computed + scheduled, np.ones(1, np.int64)
    c = rt.counters()
    assert c["decision_steps"] == 5 and c["latency_samples"] == 3


def test_bench_decision_runs_on_cpu(tmp_path):
    results = bench.main(["--out", str(tmp_path), "--device", "cpu", "--steps", "3", "--warmup", "1",
                          "--rows", "4", "9", "--heads", "3", "--hidden", "16"])
    got = {(r["rows"], r["mode"]) for r in results}
    assert got == {(n, m) for n in (4, 9) for m in ("graph", "old")}
    md = (tmp_path / "bench_decision.md").read_text()
    lines = [ln for ln in md.splitlines() if ln.startswith("| ") and not ln.startswith("| rows")]
    assert len(lines) == 4
    assert all(len(ln.split("|")) == 14 for ln in lines)  # 12 columns
    assert "| 9 | 3 | graph | cpu |" in md and "| 4 | 3 | old | cpu |" in md
    assert "bit for bit, and on the CPU): cpu: same device ok, vs CPU ok" in md
    data = json.loads((tmp_path / "bench_decision.json").read_text())
    assert len(data["results"]) == 4 and data["checks"] == ["cpu: same device ok, vs CPU ok"]


def test_bench_step_host_runs_on_cpu(tmp_path):
    bench_step_host.main(["--rows", "8", "--steps", "14", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "step_host.json").read_text())
    assert [r["case"] for r in results] == ["serving", "calibration ON pass", "calibration sweep"]
    assert all(r["rows"] == 8 and 0 < r["median_ms"] <= r["p95_ms"] for r in results)
    assert "| serving | 8 |" in (tmp_path / "step_host.md").read_text()


def test_bench_slot_image_runs_on_cpu(capsys):
    bench_slot_image.main(["--layers", "1", "--adapters", "3"])
    row = capsys.readouterr().out.strip().splitlines()[-1].split("|")
    # one Llama-3.2-3B layer at rank 8: 434,176 bf16 values (qkv 114,688, o 49,152, gate_up 180,224, down 90,112)
    assert row[1].strip() == "0.9" and float(row[2]) > 0 and float(row[3]) > 0


@pytest.mark.parametrize("version", ["tuples", "numpy + ints"])
def test_bench_mapping_host_runs_on_cpu(version):
    times = bench_mapping_host.run(version, rows=8, tokens=32, steps=3)
    assert set(times) == {"hand-over", "id loop", "torch.tensor"} and all(v > 0 for v in times.values())
