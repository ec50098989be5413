"""Stock vLLM and GridTrim sharing one vLLM cache (one ``VLLM_CACHE_ROOT``, as one user's servers
do) each run their own compiled model: a GridTrim engine started after a stock engine of the same
model and settings compiles its own instead of loading stock's, and a second GridTrim engine loads
that one and still gives stock's outputs (docs/vllm_integration.md §4b, §4c: the warm start is where
a forward whose kernels Inductor launches, ``LORAZOR_GRIDTRIM_LAUNCH=inductor``, could go wrong).
The engines of ``tests/gpu/gridtrim_engines.py`` with vLLM's defaults, one after the other; about
4 minutes on one H200."""
from __future__ import annotations

import pytest

from serve_bridge.vllm.settings import gridtrim_launch_from_env
from tests.gpu import gridtrim_engines as engines
from tests.gpu import release_engines
from tests.gpu.harness import run_phases

pytestmark = pytest.mark.gpu

N_REQUESTS = 64
ENGINE_TIMEOUT_S = 400
# vLLM's log lines for a compiled model taken from the cache, and for one whose loading failed
# (compilation/decorators.py:327 and :339 of 0.33.0)
LOADED = "Directly load AOT compilation"
LOAD_FAILED = "Compiling model again due to a load failure"


def _lines(log: str, needle: str) -> list[str]:
    return [line for line in log.splitlines() if needle in line]


def test_gridtrim_after_stock_compiles_its_own_model_and_loads_it_warm(vllm_env, tmp_path):
    release_engines.prepare(tmp_path, N_REQUESTS, release_engines.model_for(1))
    cache = tmp_path / "vllm-cache"
    env = vllm_env | {"VLLM_CACHE_ROOT": str(cache)}
    stock_name, grid_name = engines.phases(defaults=True)
    stock, gridtrim = (engines.phase(name, tmp_path, env, N_REQUESTS) for name in (stock_name, grid_name))
    run_phases([stock], ENGINE_TIMEOUT_S)
    assert len(engines.aot_keys(cache)) == 1, "stock saved no compiled model: vLLM's AOT compile cache is off"
    run_phases([gridtrim], ENGINE_TIMEOUT_S)
    log = gridtrim.log.read_text(errors="replace")
    assert not _lines(log, LOADED), _lines(log, LOADED)
    assert len(engines.aot_keys(cache)) == 2, engines.aot_keys(cache)
    text, ok = engines.report(tmp_path / "out", N_REQUESTS, engines.TOLERANCE, True)
    print(f"cold GridTrim engine against stock:\n{text}", flush=True)
    assert ok, text

    warm = engines.phase(grid_name, tmp_path, env, N_REQUESTS, run="-warm")
    run_phases([warm], ENGINE_TIMEOUT_S)
    log = warm.log.read_text(errors="replace")
    assert _lines(log, LOADED) and not _lines(log, LOAD_FAILED), (
        "the second GridTrim engine did not load its compiled model: " + repr(_lines(log, LOAD_FAILED)))
    launch = gridtrim_launch_from_env(warm.env)
    assert _lines(log, f"compiled launches: {launch})"), _lines(log, "LoRazor GridTrim active")
    assert len(engines.aot_keys(cache)) == 2, engines.aot_keys(cache)
    text, ok = engines.report(tmp_path / "out", N_REQUESTS, engines.TOLERANCE, True, grid_out=tmp_path / "out-warm")
    print(f"warm GridTrim engine ({launch} launch) against stock:\n{text}", flush=True)
    assert ok, text
