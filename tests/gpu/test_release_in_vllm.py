"""StepTrim inside vLLM (a supported line) is token-exact: stock vLLM vs the plugin on the same requests
(engines and checks: ``tests/gpu/release_engines.py``). About 2 minutes on one H200."""
from __future__ import annotations

import pytest

from tests.gpu import release_engines as engines
from tests.gpu.harness import Phase, needs_gpus, run_phases

pytestmark = pytest.mark.gpu

N_REQUESTS = 320
ENGINE_TIMEOUT_S = 400
LAYOUTS = [pytest.param((1, False), id="tp1"),  # (tensor_parallel_size, fully_sharded_loras)
           pytest.param((2, False), id="tp2", marks=needs_gpus(2)),
           pytest.param((2, True), id="tp2-fully-sharded", marks=needs_gpus(2))]


@pytest.fixture(scope="module", params=LAYOUTS)
def checks(request, vllm_env, tmp_path_factory) -> tuple[int, dict[str, tuple[bool, str]]]:
    """(tensor_parallel_size, check name → (passed, detail)), from one stock, one plugin and (at TP 1)
    one bad-bundle engine (whose process may fail: its error is what is checked), at once."""
    tp, sharded = request.param
    work = tmp_path_factory.mktemp(f"release_tp{tp}")
    out = work / "out"
    engines.prepare(work, N_REQUESTS, engines.model_for(tp))
    phases = ["stock", "plugin"] + (["badbundle"] if tp == 1 else [])  # start-up errors are checked at TP 1
    args = ["--work", str(work), "--out", str(out), "--tensor-parallel-size", str(tp)] + (
        ["--fully-sharded-loras"] if sharded else [])
    run_phases([Phase("tests.gpu.release_engines", ["--phase", phase, *args], engines.phase_env(work, vllm_env, phase),
                      work / f"{phase}.log", must_succeed=phase != "badbundle") for phase in phases],
               ENGINE_TIMEOUT_S)
    return tp, {name: (ok, detail) for name, ok, detail in engines.compare(work, out)}


def _check(checks: tuple[int, dict[str, tuple[bool, str]]], prefix: str) -> None:
    chosen = {name: r for name, r in checks[1].items() if name.startswith(prefix)}
    assert chosen, f"no check named {prefix!r}*"
    failed = [f"{name}: {detail}" for name, (ok, detail) in chosen.items() if not ok]
    assert not failed, "; ".join(failed)


def test_engines_and_requests_are_what_the_checks_assume(checks):
    for prefix in ("stock engine is", "plugin engine is", "output lengths", "adapters change outputs"):
        _check(checks, prefix)


def test_policy_off_is_stock_token_for_token(checks):
    _check(checks, "(a)")


def test_profiled_release_is_exact(checks):
    _check(checks, "(b)")


def test_learned_release_is_exact_and_one_way(checks):
    _check(checks, "(c)")


def test_a_bundle_for_another_model_fails_at_start_up(checks):
    if checks[0] != 1:
        pytest.skip("start-up errors are checked at tensor_parallel_size=1")
    _check(checks, "(d)")


def test_tensor_parallel_ranks_agree(checks):
    if checks[0] == 1:
        pytest.skip("one rank")
    _check(checks, "(e)")
