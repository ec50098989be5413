"""Bounded work: every loop a user's number drives has a bound or a check before it starts. Engine
limits of zero or less (which served nothing, forever), arrivals or lengths past the capacity
model's bounds, and a response limit at or past the backbone's context are refused before any work;
each case runs under a time limit, so work that would not end fails instead of hanging."""
from __future__ import annotations

from pathlib import Path

import pytest

from calibrate.context import Context
from calibrate.errors import ConfigError
from calibrate.rundir import RunDir
from calibrate.validate import validate
from serve_bridge import capacity
from tests.calibrate.test_pipeline import TINY, compose_cfg
from tests.robustness.helpers import assert_one_error_line, exit_code, time_limit, write_jsonl
from tests.robustness.test_battery_commands import QUICK, ROW, SMALL, run_train_adapter, tiny_bundle

LIMIT_S = 30

UNBOUNDED = {  # name: (arguments besides --bundle and QUICK, message fragment)
    "max_num_seqs_zero": (["--max-num-seqs", "0"], "--max-num-seqs=0: use a positive integer"),
    "max_num_seqs_negative": (["--max-num-seqs", "-3"], "--max-num-seqs=-3"),
    "token_budget_zero": (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens=0"),
    "token_budget_negative": (["--max-num-batched-tokens", "-1"], "--max-num-batched-tokens=-1"),
    "arrivals_past_the_bound": (["--rate", "1e-12", "--step-ms", "1"], "--rate=1e-12: the last of 40 requests"),
    "output_past_the_bound": (["--output-len", "1", "1000000000"], "--output-len=1000000000: use at most"),
    "requests_past_the_bound": (["--requests", "2000000", "--prompt-len", "100", "300", "--output-len", "20", "100"],
                                "--requests=2000000: use at most"),
    "forwards_past_the_bound": (["--requests", "1048576", "--prompt-len", "1000", "1000", "--output-len", "1000",
                                 "1000"], "a simulation may serve 2097152000 token forwards"),
}


@pytest.mark.parametrize("case", sorted(UNBOUNDED))
def test_capacity_refuses_unbounded_work(tmp_path: Path, capsys, case: str) -> None:
    args, fragment = UNBOUNDED[case]
    argv = ["--bundle", str(tiny_bundle(tmp_path / "bundle")), "--adapters", "8", *QUICK, *args]
    with time_limit(LIMIT_S):
        assert exit_code(lambda: capacity.main(argv)) == 2
    assert_one_error_line(capsys.readouterr().err, fragment)


@pytest.mark.parametrize("limits", [(0, 4, 64), (2, 0, 64), (2, 4, 0)], ids=["max_loras", "max_num_seqs", "budget"])
def test_simulate_refuses_a_limit_that_serves_nothing(limits: tuple[int, int, int]) -> None:
    reqs = capacity.draw_requests(5, [capacity.ReleaseDistribution.point(2)], 4, prompt_len=(2, 4),
                                  output_len=(2, 4))
    with time_limit(LIMIT_S), pytest.raises(ValueError, match="must be ≥ 1"):
        capacity.simulate(reqs, limits[0], max_num_seqs=limits[1], token_budget=limits[2])


def test_simulate_serves_every_request_with_the_smallest_limits() -> None:
    reqs = capacity.draw_requests(20, [capacity.ReleaseDistribution.point(1)], 5, prompt_len=(2, 6),
                                  output_len=(1, 5), seed=3)
    with time_limit(LIMIT_S):
        result = capacity.simulate(reqs, 1, max_num_seqs=1, token_budget=1)
    assert result.steps == int((reqs.prompt + reqs.output - 1).sum())  # one request, one token per step


def test_calibrate_refuses_a_response_limit_past_the_context(tmp_path: Path) -> None:
    ctx = Context(compose_cfg([*TINY, "task.options.max_new_tokens=8192"]), RunDir(tmp_path / "run"))
    with time_limit(LIMIT_S), pytest.raises(ConfigError, match="max_new_tokens=8192 .* is not below the context of "
                                                             "backbone 'smollm2' \\(8192 tokens\\)"):
        validate(ctx)
    assert not (tmp_path / "run").exists()


def test_train_adapter_refuses_a_response_limit_past_the_context(tmp_path: Path, monkeypatch, capsys) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", [ROW])
    argv = ["train", "--data", str(data), "--out", str(tmp_path / "adapter"), *SMALL, "--n-eval", "0",
            "--max-new-tokens", "8192"]
    with time_limit(LIMIT_S):
        assert run_train_adapter(monkeypatch, *argv) == 2
    assert_one_error_line(capsys.readouterr().err, "--max-new-tokens=8192: use fewer than the backbone's context")
    assert not (tmp_path / "adapter").exists()
