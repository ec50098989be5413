"""GridTrim inside vLLM (a supported line) gives stock vLLM's outputs: stock vs ``LORAZOR_GRIDTRIM=1`` on the
same requests, both with vLLM's defaults (torch.compile, async scheduling, prefix caching; not on
0.26's V1 runner, which the plugin serves synchronously) and, with tensor parallelism, on the
eager, synchronous second line (engines and pass rule: ``tests/gpu/gridtrim_engines.py``). About
1.5 minutes per line on one H200."""
from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.serving.placement import compile_cache
from tests.gpu import gridtrim_engines as engines
from tests.gpu import release_engines
from tests.gpu.harness import needs_gpus, run_phases, skip_unless_defaults_runner

pytestmark = pytest.mark.gpu

N_REQUESTS = 128
ENGINE_TIMEOUT_S = 400


@pytest.mark.parametrize("tp, sharded, defaults", [
    pytest.param(1, False, True, id="defaults"),
    pytest.param(1, False, False, id="tp1"),
    pytest.param(2, True, False, id="tp2-fully-sharded", marks=needs_gpus(2))])
def test_gridtrim_logprobs_match_stock(tp, sharded, defaults, vllm_env, tmp_path):
    if defaults:
        skip_unless_defaults_runner()
    release_engines.prepare(tmp_path, N_REQUESTS, release_engines.model_for(tp))
    run_phases([engines.phase(phase, tmp_path, vllm_env, N_REQUESTS, tp, sharded)
                for phase in engines.phases(defaults)], ENGINE_TIMEOUT_S)
    text, ok = engines.report(tmp_path / "out", N_REQUESTS, engines.TOLERANCE, defaults)
    assert ok, text
    if defaults:  # each engine saved its compiled model under vLLM's AOT key; GridTrim's is not stock's
        keys = {phase: engines.aot_keys(Path(compile_cache(tmp_path, phase)["VLLM_CACHE_ROOT"]))
                for phase in engines.phases(defaults)}
        assert all(keys.values()) and not set.intersection(*keys.values()), keys
