"""Release under vLLM's defaults (torch.compile in its default CUDA-graph mode, async scheduling,
prefix caching; the V2 runner of vLLM 0.33.0 and 0.34.0): stock vLLM and the plugin, both with every
default, on the token-exactness test's requests, policy off, profiled and learned (decision lag 1)
families (engines and checks: ``tests/gpu/release_engines.py``). The synchronous, eager second line,
with tensor parallelism: ``test_release_in_vllm.py``."""
from __future__ import annotations

import pytest

from tests.gpu import release_engines as engines
from tests.gpu.harness import Phase, run_phases, skip_unless_defaults_runner

pytestmark = pytest.mark.gpu

N_REQUESTS = 320
ENGINE_TIMEOUT_S = 400


@pytest.fixture(scope="module")
def checks(vllm_env, tmp_path_factory) -> dict[str, tuple[bool, str]]:
    """Check name → (passed, detail), from one stock and one plugin engine with vLLM's defaults, at once."""
    skip_unless_defaults_runner()
    work = tmp_path_factory.mktemp("release_defaults")
    out = work / "out"
    engines.prepare(work, N_REQUESTS)
    run_phases([Phase("tests.gpu.release_engines", ["--phase", phase, "--work", str(work), "--out", str(out)],
                      engines.phase_env(work, vllm_env, phase), work / f"{phase}.log")
                for phase in ("stock-defaults", "plugin-defaults")], ENGINE_TIMEOUT_S)
    return {name: (ok, detail) for name, ok, detail in engines.compare(work, out, "-defaults")}


@pytest.mark.parametrize("prefix", ["stock engine is", "plugin engine is", "output lengths", "adapters change outputs",
                                    "async:", "(a)", "(b)", "(c)"])
def test_release_is_exact_under_vllms_defaults(checks, prefix):
    chosen = {name: r for name, r in checks.items() if name.startswith(prefix)}
    assert chosen, f"no check named {prefix!r}*"
    failed = [f"{name}: {detail}" for name, (ok, detail) in chosen.items() if not ok]
    assert not failed, "; ".join(failed)
