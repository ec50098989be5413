"""Failed and killed re-runs of the pipeline, damaged outputs, and user mistakes on the command
line, starting from the finished tiny run: each ends in the correct result, or in one error line
on stderr with exit code 2 and the run directory and every user file unchanged. Settings that
only a later stage reads, and the engines the run needs on this machine, fail before any stage."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from benchmarks.robustness.kill_resume import KILL_CONFIG
from calibrate.context import Context
from calibrate.errors import ConfigError, UserError
from calibrate.pipeline import run_pipeline
from calibrate.rundir import RunDir
from labeling.engines.auto import MachineFacts
from labeling.engines.vllm.options import SUPPORTED_VLLM
from labeling.tasks import TaskError
from tests.calibrate.test_pipeline import TINY, cli, compose_cfg, run
from tests.conftest import DEMO_ADAPTER
from tests.robustness.helpers import digest, write_jsonl


class Killed(BaseException):
    """Stands in for SIGKILL: not an Exception, so nothing on the way catches it."""


def _copy(finished: tuple[Path, dict], tmp_path: Path) -> Path:
    return Path(shutil.copytree(finished[0], tmp_path / "run"))


def test_export_killed_mid_publish_with_another_rule(tmp_path: Path, tiny_run, monkeypatch, capsys) -> None:
    """The failure the issue saw: a P25 re-export killed after the bundle was replaced must not
    leave a P25 bundle under the default rule's marker; the next default run serves the default again."""
    run_dir = _copy(tiny_run, tmp_path)
    original = digest(run_dir / "bundle")
    real_replace = os.replace

    def kill_at_marker(src, dst):
        if str(dst).endswith(os.path.join("stages", "export.json")):
            raise Killed
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", kill_at_marker)
    with pytest.raises(Killed):
        run(run_dir, [*TINY, "export.rule=P25", "stages=[export]"])
    monkeypatch.undo()
    assert not (run_dir / "stages" / "export.json").exists()  # the default's marker went before the bundle moved
    summaries = run(run_dir, TINY)
    out = capsys.readouterr().out
    assert "[export] finished publishing" in out and "[export] running" in out and "[export] cached" not in out
    assert summaries["export"]["rule"] == tiny_run[1]["export"]["rule"] != "P25"
    assert digest(run_dir / "bundle") == original
    assert "[test] cached" in out  # the bundle is byte-identical, so the test stage's input is unchanged


@pytest.mark.parametrize("damaged,stage", [("labels/points.parquet", "labels"), ("labels/features.npy", "labels"),
                                           ("bundle/heads.safetensors", "export"), ("bundle/manifest.json", "export"),
                                           ("heads/candidates.json", "heads"), ("data/train.jsonl", "data")])
def test_truncated_output_is_recomputed_not_cached(tmp_path: Path, tiny_run, capsys, damaged: str, stage: str) -> None:
    run_dir = _copy(tiny_run, tmp_path)
    before = digest(run_dir, skip=(".hydra", "stages"))  # the recomputed stage's marker has a new time
    path = run_dir / damaged
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    stages = ["data", "labels", "heads", "sweep", "export"]
    run(run_dir, [*TINY, f"stages=[{','.join(stages[: stages.index(stage) + 1])}]"])
    out = capsys.readouterr().out
    assert f"[{stage}] recomputing: {damaged} differs from the sha256 its marker recorded" in out
    assert digest(run_dir, skip=(".hydra", "stages")) == before  # byte-identical (labels from the intact shards)


def test_data_stage_failing_midway_leaves_the_previous_split_files(tmp_path: Path, tiny_run, monkeypatch) -> None:
    run_dir = _copy(tiny_run, tmp_path)
    before = digest(run_dir)
    ctx = Context(compose_cfg([*TINY, "task.options.seed=5", "stages=[data]"]), RunDir(run_dir))
    real = ctx.task.load_split

    def failing(split: str):
        if split == "test":
            raise TaskError("task 'arith': the test split broke")
        return real(split)

    monkeypatch.setattr(ctx.task, "load_split", failing)
    with pytest.raises(TaskError, match="test split broke"):
        run_pipeline(ctx)
    assert digest(run_dir) == before
    assert not (run_dir / ".scratch").exists()


def test_stage_without_its_input_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="stage 'heads' needs the output of stage 'labels', which has none "
                                          r"\(not run yet\); add 'labels' to `stages`"):
        run(tmp_path / "run", [*TINY, "stages=[heads]"])
    assert not (tmp_path / "run" / "stages").exists()


# --- the command line: one line on stderr, exit code 2, nothing changed -------------------

def _bad_adapter(tmp: Path, how: str) -> list[str]:
    d = Path(shutil.copytree(DEMO_ADAPTER, tmp / "user-lora"))
    cfg = json.loads((d / "adapter_config.json").read_text())
    if how == "r0":
        (d / "adapter_config.json").write_text(json.dumps({**cfg, "r": 0}))
    elif how == "truncated":
        w = d / "adapter_model.safetensors"
        w.write_bytes(w.read_bytes()[:100_000])
    elif how == "other_base":
        other = {**cfg, "base_model_name_or_path": "mistralai/Mistral-7B-v0.3"}
        (d / "adapter_config.json").write_text(json.dumps(other))
    elif how == "rank_pattern_list":
        (d / "adapter_config.json").write_text(json.dumps({**cfg, "rank_pattern": [8]}))
    return [f"adapter.adapters=[{{name: arith-a, path: {d}}}]"]


def _bad_gsm8k(tmp: Path, second_row: bytes = b'{"question": "caf\xe9", "answer": "1"}') -> list[str]:
    src = tmp / "user-gsm8k"
    src.mkdir()
    (src / "train.jsonl").write_bytes(b'{"question": "q", "answer": "#### 1"}\n' + second_row + b"\n")
    write_jsonl(src / "test.jsonl", [{"question": "q", "answer": "#### 1"}])
    return ["task=gsm8k", f"task.options.source={src}", "task.sizes.train=1", "task.sizes.validation=1",
            "task.sizes.test=1"]


CLI_CASES = {  # name: (overrides builder, stderr fragment)
    "negative_budget": (lambda t: ["export.budget=-1"], "export.budget=-1"),
    "unknown_rule": (lambda t: ["export.rule=P0"], "export.rule='P0'"),
    "non_numeric_size": (lambda t: ["task.sizes.train=abc"], "task.sizes.train"),
    "negative_points": (lambda t: ["labeling.points=[-1,2]"], "labeling.points=[-1, 2]"),
    "unknown_stage": (lambda t: ["stages=[data,typo]"], "unknown stage(s) ['typo']"),
    "adapter_r0": (lambda t: _bad_adapter(t, "r0"), "r=0"),
    "adapter_truncated": (lambda t: _bad_adapter(t, "truncated"), "not a complete safetensors file"),
    "adapter_other_base": (lambda t: _bad_adapter(t, "other_base"), "names base model 'mistralai/Mistral-7B-v0.3'"),
    "data_not_utf8": (lambda t: _bad_gsm8k(t), "train.jsonl:2: not valid UTF-8"),
    "data_duplicate_key": (lambda t: _bad_gsm8k(t, b'{"question": "q", "answer": "#### 1", "answer": "2"}'),
                           "train.jsonl:2: not valid JSON (duplicate key 'answer'"),
    "adapter_rank_pattern_list": (lambda t: _bad_adapter(t, "rank_pattern_list"), "rank_pattern=[8]"),
    "task_options_not_a_group": (lambda t: ["task.options=5"], "task.options=5"),
}


@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_cli_user_error_is_one_line_and_changes_nothing(tmp_path: Path, tiny_run, case: str) -> None:
    run_dir = _copy(tiny_run, tmp_path)
    build, fragment = CLI_CASES[case]
    overrides = build(tmp_path)
    user_files = {p: digest(p) for p in tmp_path.glob("user-*")}
    before = digest(run_dir)
    proc = cli(run_dir, *TINY, *overrides)
    _, err = proc.communicate(timeout=600)
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], err
    assert digest(run_dir) == before
    assert {p: digest(p) for p in user_files} == user_files


# --- settings a later stage reads, and the machine: checked before the first stage --------------
CPU = MachineFacts(cuda=False, gpus=0, gpu_memory=0, vllm_version=None)
ONE_GPU = MachineFacts(cuda=True, gpus=1, gpu_memory=80 << 30, vllm_version=SUPPORTED_VLLM[0])
BEFORE_ANY_STAGE = [  # (overrides, machine, message fragment)
    ("engine=hf;engine.device=tpu", CPU, "engine.device='tpu': not a device"),
    ("engine=hf;engine.device=cuda", CPU, "engine.device='cuda': this machine has no CUDA GPU"),
    ("engine=hf;engine.device=cuda:3", ONE_GPU, "engine.device='cuda:3': this machine has 1 visible GPU(s)"),
    ("engine=hf;engine.device=mps", CPU, "engine.device='mps': torch has no MPS device here"),
    ("engine=vllm", CPU, f"engine=vllm needs vLLM ({' or '.join(SUPPORTED_VLLM)}) and a GPU, this machine has no vllm and "
                         "no CUDA GPU"),
    ("engine=vllm;engine.tensor_parallel_size=2", ONE_GPU, "needs 2 GPUs, this machine has 1"),
    ("agreement=true", CPU, f"agreement=true needs vLLM ({' or '.join(SUPPORTED_VLLM)}) and a GPU"),
    ("backbone.gguf_dir=/nowhere", CPU,
     "/nowhere/SmolLM2-135M-Instruct.Q4_1.gguf not found (backbone.gguf_dir='/nowhere')"),
]


@pytest.mark.parametrize("overrides,facts,fragment", BEFORE_ANY_STAGE, ids=[c[0] for c in BEFORE_ANY_STAGE])
def test_setting_a_later_stage_reads_fails_before_any_stage(tmp_path: Path, small_run, overrides: str,
                                                            facts: MachineFacts, fragment: str) -> None:
    """On the finished small run every stage but the one reading the setting could be cached (or
    a cached conversion would let the run go on without gguf_dir): the run still stops first."""
    run_dir = _copy(small_run, tmp_path)
    before = digest(run_dir)
    ctx = Context(compose_cfg([*KILL_CONFIG, *overrides.split(";")]), RunDir(run_dir), facts=facts)
    with pytest.raises(UserError) as info:
        run_pipeline(ctx)
    assert fragment in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert digest(run_dir) == before


@pytest.mark.parametrize("budget,rule", [("0.00001", "budget=1e-05"), ("1e20", "budget=1e+20")])
def test_budget_in_exponent_notation_exports(tmp_path: Path, small_run, capsys, budget: str, rule: str) -> None:
    run_dir = _copy(small_run, tmp_path)
    summaries = run(run_dir, [*KILL_CONFIG, f"export.budget={budget}", "stages=[export]"])
    assert summaries["export"]["rule"] == rule
    out = capsys.readouterr().out  # and the run says what the backbone loads from
    assert "backbone smollm2: " in out and "SmolLM2-135M-Instruct.Q4_1.gguf, read from its conversion cached at" in out
