"""Profiled release under vLLM's async scheduling (the V2 runner of vLLM 0.33.0 and 0.34.0, the plugin's
default: ``LORAZOR_ASYNC_SCHEDULING`` unset): stock vLLM and the plugin, both scheduling asynchronously, on the
token-exactness test's requests (engines and checks: ``tests/gpu/release_engines.py``). About 2 minutes on one H200."""
from __future__ import annotations

import pytest

from tests.gpu import release_engines as engines
from tests.gpu.harness import run_phase

pytestmark = pytest.mark.gpu

N_REQUESTS = 320
ENGINE_TIMEOUT_S = 400


@pytest.fixture(scope="module")
def checks(vllm_env, tmp_path_factory) -> dict[str, tuple[bool, str]]:
    """Check name → (passed, detail), from one stock and one plugin engine with async scheduling."""
    from serve_bridge.vllm import versions

    if versions.current().RUNNER != "V2":
        pytest.skip("async scheduling with a bundle runs in the V2 runner only (vLLM 0.33 and 0.34)")
    work = tmp_path_factory.mktemp("release_async")
    out = work / "out"
    engines.prepare(work, N_REQUESTS)
    for phase in ("stock-async", "plugin-async"):
        run_phase("tests.gpu.release_engines", ["--phase", phase, "--work", str(work), "--out", str(out)],
                  engines.phase_env(work, vllm_env, phase), work / f"{phase}.log", ENGINE_TIMEOUT_S)
    return {name: (ok, detail) for name, ok, detail in engines.compare(work, out, "-async")}


@pytest.mark.parametrize("prefix", ["stock engine is", "plugin engine is", "output lengths", "adapters change outputs",
                                    "async:", "(a)", "(b)"])
def test_profiled_release_is_exact_under_async_scheduling(checks, prefix):
    chosen = {name: r for name, r in checks.items() if name.startswith(prefix)}
    assert chosen, f"no check named {prefix!r}*"
    failed = [f"{name}: {detail}" for name, (ok, detail) in chosen.items() if not ok]
    assert not failed, "; ".join(failed)
