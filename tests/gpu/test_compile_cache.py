"""Stock vLLM and GridTrim sharing one vLLM cache (one ``VLLM_CACHE_ROOT``, as one user's servers
do) each run their own compiled model: a GridTrim engine started after a stock engine of the same
model and settings compiles its own instead of loading stock's (docs/vllm_integration.md §4b).
The engines of ``tests/gpu/gridtrim_engines.py`` with vLLM's defaults, one after the other; about
3 minutes on one H200."""
from __future__ import annotations

import pytest

from tests.gpu import gridtrim_engines as engines
from tests.gpu import release_engines
from tests.gpu.harness import run_phases

pytestmark = pytest.mark.gpu

N_REQUESTS = 64
ENGINE_TIMEOUT_S = 400
LOADED = "Directly load AOT compilation"  # vLLM's log line for a compiled model taken from the cache


def test_gridtrim_after_stock_compiles_its_own_model(vllm_env, tmp_path):
    release_engines.prepare(tmp_path, N_REQUESTS, release_engines.model_for(1))
    cache = tmp_path / "vllm-cache"
    env = vllm_env | {"VLLM_CACHE_ROOT": str(cache)}
    stock, gridtrim = (engines.phase(name, tmp_path, env, N_REQUESTS) for name in engines.phases(defaults=True))
    run_phases([stock], ENGINE_TIMEOUT_S)
    assert len(engines.aot_keys(cache)) == 1, "stock saved no compiled model: vLLM's AOT compile cache is off"
    run_phases([gridtrim], ENGINE_TIMEOUT_S)
    log = gridtrim.log.read_text(errors="replace")
    assert LOADED not in log, [line for line in log.splitlines() if LOADED in line]
    assert len(engines.aot_keys(cache)) == 2, engines.aot_keys(cache)
    text, ok = engines.report(tmp_path / "out", N_REQUESTS, engines.TOLERANCE, True)
    assert ok, text
