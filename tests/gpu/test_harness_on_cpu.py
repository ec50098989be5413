"""The parts of the GPU tests' harness that need no GPU, run on the CPU: the requests the
README-command test's servers are sent (``tests/gpu/readme_serve.py``), how release points and most
likely tokens are matched to them, and how engine processes are run at once
(``tests/gpu/harness.run_phases``). Unmarked, so CI runs them; ``pytest -m gpu tests/gpu`` deselects them."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.gpu import readme_serve as rs
from tests.gpu.harness import Phase, run_phases
from tests.gpu.real_engines import backbone_dir


def test_the_servers_requests_are_the_demos_and_enough_for_the_stock_comparison():
    model = backbone_dir(None)
    test = rs.requests(model, ("test",))
    every = rs.requests(model, ("train", "validation", "test"))
    assert set(test["prompts"]) == set(rs.ADAPTERS.values())
    for reqs in (test, every):
        assert reqs["stop_ids"] and all(isinstance(t, int) for t in reqs["stop_ids"])
        for adapter, prompts in reqs["prompts"].items():
            assert prompts and len(prompts) == len(reqs["uids"][adapter])
            assert all(p and all(isinstance(t, int) for t in p) for p in prompts)
            assert reqs["max_tokens"][adapter] > 0
    assert sum(map(len, every["prompts"].values())) >= 320  # test_policy_off_is_stock_under_vllms_defaults
    assert len(set(every["uids"]["counter-a"])) == len(every["uids"]["counter-a"])


def test_release_points_are_matched_to_their_calls():
    """vLLM names prompt i of completion call C ``C-i-<8 characters>``; one prompt per call here."""
    records = [{"req_id": "cmpl-b-0-1a2b3c4d", "release": 7}, {"req_id": "cmpl-a-0-deadbeef", "release": None},
               {"req_id": "cmpl-c-0-00000000", "release": 3}]
    assert rs.releases(records, ["cmpl-a", "cmpl-b", "cmpl-c", "cmpl-d"]) == [None, 7, 3, None]


def test_most_likely_tokens_are_read_as_ids():
    """vLLM's completion logprobs with ``return_tokens_as_token_ids``: one dict per position (None
    where it has none), keys ``token_id:<id>``; the sampled token may repeat among them."""
    top = [{"token_id:39": -0.01, "token_id:1232": -4.6}, None, {"token_id:7": -0.7, "token_id:33": -0.71}]
    assert rs.top_token_ids(top) == [[39, 1232], [], [7, 33]]


# A stand-in engine process: it announces itself in DIR, waits up to 60 s for WAIT others to have
# done so, prints its vLLM cache root and exits with CODE.
PROBE = """import os, sys, time
directory, wait, code = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
open(os.path.join(directory, str(os.getpid())), "w").close()
t0 = time.monotonic()
while len(os.listdir(directory)) < wait and time.monotonic() - t0 < 60:
    time.sleep(0.05)
print("peers", len(os.listdir(directory)), "cache", os.environ.get("VLLM_CACHE_ROOT"))
sys.exit(code)
"""


def _probe(tmp_path: Path, name: str, wait: int, code: int = 0, must_succeed: bool = True) -> Phase:
    (tmp_path / "probe_phase.py").write_text(PROBE)
    (tmp_path / "met").mkdir(exist_ok=True)
    env = dict(os.environ) | {"PYTHONPATH": str(tmp_path)}
    return Phase("probe_phase", [str(tmp_path / "met"), str(wait), str(code)], env, tmp_path / f"{name}.log",
                 must_succeed)


def test_phases_run_at_once_each_with_its_own_vllm_cache(tmp_path):
    phases = [_probe(tmp_path, f"p{i}", wait=3) for i in range(3)]
    run_phases(phases, timeout_s=30)  # one after another, the first would wait for peers that never come
    logs = [p.log.read_text().split() for p in phases]
    assert all(words[:2] == ["peers", "3"] for words in logs)
    assert sorted(words[3] for words in logs) == [str(tmp_path / "vllm-cache" / f"p{i}") for i in range(3)]


def test_one_phase_keeps_the_callers_vllm_cache(tmp_path):
    phase = _probe(tmp_path, "only", wait=1)
    run_phases([phase], timeout_s=30)
    assert phase.log.read_text().split()[3] == str(os.environ.get("VLLM_CACHE_ROOT"))


def test_a_failed_or_stopped_phase_fails_the_test_with_its_log(tmp_path):
    ok, bad = _probe(tmp_path, "ok", wait=1), _probe(tmp_path, "bad", wait=1, code=3)
    allowed = _probe(tmp_path, "allowed", wait=1, code=4, must_succeed=False)
    with pytest.raises(pytest.fail.Exception, match=r"(?s)exited with 3:\n.*peers") as e:
        run_phases([ok, bad, allowed], timeout_s=30)
    assert "exited with 4" not in str(e.value)
    run_phases([ok, allowed], timeout_s=30)  # a phase allowed to fail does not fail the test
    stuck = _probe(tmp_path, "stuck", wait=99)
    with pytest.raises(pytest.fail.Exception, match="exited with no code: stopped after 2 s"):
        run_phases([stuck], timeout_s=2)
