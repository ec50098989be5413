"""benchmarks/serving/sweep_plot.py: the series it draws are the harnesses' own verdicts and goodput
rates; the picture goes beside the table, never over an earlier one without --replace."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from benchmarks.serving import chat, goodput, sweep_plot
from benchmarks.serving.goodput import Slo

ROOT = Path(__file__).resolve().parents[2]
CHAT = ROOT / "benchmarks/results/2026-12-05-vllm-defaults/chat512/chat.json"  # measured, before `step ms`
SLO = Slo()


def row(rate, ttft, tpot=20.0, completed=100, **extra):
    return {"rate": rate, "prompts": 100, "completed": completed, "ttft_p90_ms": ttft, "tpot_p90_ms": tpot, **extra}


def test_the_series_are_the_harnesses_verdicts():
    doc = {"modes": {
        "a": {"rows": [row(None, 5000.0), row(40.0, 300.0), row(20.0, 100.0), row(60.0, 2000.0), row(50.0, 900.0),
                       row(55.0, 800.0, completed=99)]},
        "b": {"rows": [row(10.0, 1200.0)]}}}
    series = sweep_plot.sweep(doc, SLO)
    points, best = series["a"]
    assert [p.rate for p in points] == [20.0, 40.0, 50.0, 55.0, 60.0]  # the probe has no rate: left out
    assert [p.met for p in points] == [True, True, True, False, False]  # 55: a request not completed
    assert best == 50.0 == goodput.goodput_rate(goodput.points_of(doc["modes"]["a"], SLO))[0]
    assert series["b"] == ([sweep_plot.Point(10.0, 1200.0, 20.0, None, False)], None)
    strict = sweep_plot.sweep(doc, Slo(ttft_ms=500.0))["a"]
    assert strict[1] == 40.0 and [p.met for p in strict[0]][:3] == [True, True, False]


def test_the_engine_step_of_each_kind_of_row():
    recorded = row(80.0, 100.0, duration_s=15.0, server_metrics={"engine_steps": 2000, "decode_batch": 36.0})
    assert sweep_plot.step_of(recorded) == pytest.approx(7.5) == chat.step_ms(recorded)
    earlier = row(80.0, 100.0, duration_s=15.0, output_throughput=4683.0, server_metrics={"decode_batch": 36.03})
    assert sweep_plot.step_of(earlier) == pytest.approx(1e3 * 36.03 / 4683.0)
    assert sweep_plot.step_of(row(80.0, 100.0)) is None  # a goodput table's row: no server metrics


def test_the_picture_goes_beside_the_table_and_keeps_an_earlier_one(tmp_path, capsys):
    table = tmp_path / "chat.json"
    shutil.copy(CHAT, table)
    assert sweep_plot.main([str(table)]) == 0
    png = tmp_path / "chat.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    png.write_bytes(b"mine")
    with pytest.raises(SystemExit) as exit_:
        sweep_plot.main([str(table)])
    assert exit_.value.code == 2 and png.read_bytes() == b"mine"
    assert "exists; choose a new path, or pass --replace" in capsys.readouterr().err
    assert sweep_plot.main([str(table), "--replace", "--ttft-slo-ms", "500"]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG" and sorted(p.name for p in tmp_path.iterdir()) == ["chat.json",
                                                                                                  "chat.png"]


def test_the_measured_chat_table_reads_as_its_summary():
    doc = json.loads(CHAT.read_text())
    series = sweep_plot.sweep(doc, SLO)
    assert {m: best for m, (_, best) in series.items()} == {"lorazor": 80.8, "stock": 42.7}
    assert all(p.step_ms is not None for points, _ in series.values() for p in points)
