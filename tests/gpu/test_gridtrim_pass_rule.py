"""The GridTrim GPU test's pass rule (``tests/gpu/gridtrim_engines.report``), on hand-made engine
outputs (no GPU)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.gpu import gridtrim_engines as check


def _response(first: int, top5: dict[int, float]) -> dict:
    return {"tokens": [first, 7], "logprobs": [{str(t): lp for t, lp in top5.items()}, {"7": -1.0}]}


def _write(out: Path, stock: list[dict], grid: list[dict]) -> None:
    classes = {"stock": {"runner": "GPUModelRunner", "punica_wrapper": "PunicaWrapperGPU"},
               "gridtrim": {"runner": "GPUModelRunner", "punica_wrapper": "GridTrimPunicaWrapper"}}
    for mode, mixed in (("stock", stock), ("gridtrim", grid)):
        (out / f"{mode}.json").write_text(json.dumps({"mixed": mixed, "base": stock, "classes": classes[mode],
                                                      "startup_s": 1.0, "mixed_s": 1.0}))


TOP = {1: -10.0, 2: -10.1, 3: -10.2, 4: -10.3, 5: -10.4}
N = check.BASE_EVERY  # requests 0..N-2 have an adapter, N-1 has none
FILL = [_response(1, TOP)] * (N - 1)  # identical on both sides


@pytest.mark.parametrize("tie_gap, passes", [(0.0, True), (0.01, True), (0.2, False)])
def test_a_first_token_outside_gridtrims_top5_fails_only_when_the_top5_proves_a_large_difference(
        tmp_path, tie_gap, passes):
    # request 0: stock picks token 9 at -10.4 + tie_gap; gridtrim's top 5 lack it (its 5th best is -10.4),
    # so gridtrim's logprob of 9 is below -10.4 and |Δ| ≥ tie_gap.
    stock = [_response(9, {9: -10.4 + tie_gap, **{t: lp for t, lp in TOP.items() if t != 5}})] + FILL
    grid = [_response(1, TOP)] + FILL
    _write(tmp_path, stock, grid)
    text, ok = check.report(tmp_path, N, tol=0.05)
    assert ok is passes
    lora = json.loads((tmp_path / "results.json").read_text())["gridtrim_vs_stock_lora"]
    assert lora["first_missing"] == 1 and lora["first_missing_bound"] == pytest.approx(tie_gap)
    assert ("| first-token logprob, gridtrim vs stock | PASS" in text) is passes


def test_a_present_first_token_with_a_large_difference_fails(tmp_path):
    stock = [_response(1, TOP)] + FILL
    grid = [_response(1, {**TOP, 1: -10.2})] + FILL
    _write(tmp_path, stock, grid)
    _, ok = check.report(tmp_path, N, tol=0.05)
    assert not ok


def test_the_defaults_line_reads_its_own_engines_files(tmp_path):
    # the second line's files pass; the defaults line's engines differ on request 0: only it fails
    _write(tmp_path, FILL + [_response(1, TOP)], FILL + [_response(1, TOP)])
    for mode, mixed in (("stock", [_response(1, TOP)] + FILL), ("gridtrim", [_response(1, {**TOP, 1: -10.2})] + FILL)):
        data = json.loads((tmp_path / f"{mode}.json").read_text()) | {"mixed": mixed}
        (tmp_path / f"{mode}{check.DEFAULTS}.json").write_text(json.dumps(data))
    assert check.report(tmp_path, N, tol=0.05)[1]
    text, ok = check.report(tmp_path, N, tol=0.05, defaults=True)
    assert not ok and "vLLM defaults" in text


def test_the_defaults_line_runs_vllms_defaults_and_the_second_line_its_own_settings():
    for mode in check.MODES:
        opts = check.options(mode, defaults=True, tp=1, fully_sharded=False)
        assert "compilation_config" not in opts and "specialize_active_lora" not in opts
        assert opts["async_scheduling"] and opts["enable_prefix_caching"]
        second = check.options(mode, defaults=False, tp=1, fully_sharded=False)
        assert second["compilation_config"]["mode"] == 0 and not second["async_scheduling"]
        assert second["specialize_active_lora"] is (mode == "stock")
    assert check.phases(True) == ["stock-defaults", "gridtrim-defaults"]


@pytest.mark.parametrize("version, asynchronous", [("0.34.0", True), ("0.33.0", True), ("0.26.0", False)])
def test_the_defaults_line_schedules_as_the_plugin_serves_each_line(monkeypatch, version, asynchronous):
    """0.26's V1 runner is served synchronously (docs/serving.md); the V2 lines asynchronously, vLLM's default."""
    from serve_bridge.vllm import versions

    monkeypatch.setattr(versions, "installed_version", lambda: version)
    assert check.options("gridtrim", defaults=True, tp=1, fully_sharded=False)["async_scheduling"] is asynchronous


def test_each_phase_runs_its_engine_with_its_switch(tmp_path):
    for defaults in (False, True):
        stock, grid = (check.phase(name, tmp_path, {"BASE": "1"}, 64, tp=2, fully_sharded=True)
                       for name in check.phases(defaults))
        assert "LORAZOR_GRIDTRIM" not in stock.env and grid.env["LORAZOR_GRIDTRIM"] == "1"
        assert stock.env["BASE"] == grid.env["BASE"] == "1" and "VLLM_TUNED_CONFIG_FOLDER" in grid.env
        assert grid.module == "tests.gpu.gridtrim_engines" and grid.log == tmp_path / f"{check.phases(defaults)[1]}.log"
        assert grid.args[:2] == ["--phase", check.phases(defaults)[1]] and grid.args[-3:] == [
            "--tensor-parallel-size", "2", "--fully-sharded-loras"]
