"""The ratio lines of an offline table (benchmarks/serving/bench_ratios.py), one per vLLM install."""
from __future__ import annotations

import json

import pytest

from benchmarks.serving import bench_ratios


def row(mode: str, req_per_s: float, vllm: str | None = None, **extra) -> dict:
    return {"mode": mode, "req_per_s": req_per_s, "adapters": 512, "skewed": False} | (
        {"vllm": vllm} if vllm else {}) | extra


def test_one_vllm_gives_boths_ratios_and_gridtrims_to_stock():
    rows = [row("both", 60.0), row("gridtrim", 40.0), row("stock", 25.0), row("nolora", 80.0)]
    assert bench_ratios.ratio_lines("uniform512", rows) == [
        "slot-bound uniform512: both/gridtrim = 1.50, both/stock = 2.40, both/nolora = 0.75, gridtrim/stock = 1.60"]


def test_each_vllm_gets_its_own_line_from_its_own_rows():
    rows = [row("gridtrim", 40.0, "0.33.0"), row("stock", 20.0, "0.33.0"),
            row("gridtrim", 33.0, "0.34.0"), row("stock", 30.0, "0.34.0")]
    assert bench_ratios.ratio_lines("uniform512", rows) == [
        "vLLM 0.33.0 slot-bound uniform512: gridtrim/stock = 2.00",
        "vLLM 0.34.0 slot-bound uniform512: gridtrim/stock = 1.10",
        "vLLM 0.34.0 over 0.33.0 slot-bound uniform512, each mode in the same rounds: gridtrim = 0.82, stock = 1.50"]
    stock_only = [r for r in rows if r["mode"] == "stock"]  # a mode's call of its own still compares the lines
    assert bench_ratios.ratio_lines("uniform512", stock_only)[-1].endswith("each mode in the same rounds: stock = 1.50")


def test_error_rows_are_left_out_and_missing_pairs_named():
    rows = [row("both", 60.0), row("stock", 0.0, error="timed out"),
            row("gridtrim", 1.0, settings={"graphs": "full", "async_scheduling": False})]
    line, = bench_ratios.ratio_lines("uniform512", rows)
    assert line == "slot-bound uniform512: both/gridtrim = 60.00"
    assert bench_ratios.ratio_lines("x", [row("stock", 1.0)]) == ["slot-bound x: rows missing (['stock'] finished)"]
    assert bench_ratios.ratio_lines("x", [row("stock", 1.0, error="failed")]) == ["slot-bound x: no row finished"]


def test_a_table_not_written_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        bench_ratios.main(["uniform512", str(tmp_path / "bench.json")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "was not written" in err
    (tmp_path / "bench.json").write_text(json.dumps({"rows": [row("both", 2.0), row("stock", 1.0)]}))
    assert bench_ratios.main(["uniform512", str(tmp_path / "bench.json")]) == 0
    assert capsys.readouterr().out == "slot-bound uniform512: both/stock = 2.00\n"
