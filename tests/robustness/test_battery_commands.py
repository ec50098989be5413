"""Every user-facing command keeps `python -m calibrate`'s contract (serve_bridge/command_line.py): a
user mistake is one line on stderr naming the argument or file:line, exit code 2, before any model
loads and before anything is written. The capacity model's command and scripts/train_adapter.py run
in process through their ``main``; `python -m calibrate` as a process, where Hydra creates the run
directory before LoRazor's code runs."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from serve_bridge import capacity
from serve_bridge.bundle import AdapterEntry, write_bundle
from tests.conftest import ROOT
from tests.robustness.helpers import assert_one_error_line, digest, exit_code, write_jsonl

H = 8


def tiny_bundle(path: Path, release_points: object = None) -> Path:
    """A bundle of a profiled adapter ``p`` (k = 3; ``release_points`` in its stats if given) and a
    learned one ``l``."""
    stats = {} if release_points is None else {"release_points": release_points}
    entries = [AdapterEntry("p", "0" * 64, "profiled", k=3, stats=stats),
               AdapterEntry("l", "1" * 64, "learned", tau=0.0, weight=np.zeros(H, np.float32), bias=0.0)]
    return write_bundle(path, backbone="m", hidden_size=H, config_fingerprint="c", adapters=entries)


# --- python -m serve_bridge.capacity ---------------------------------------------------------

QUICK = ["--requests", "40", "--prompt-len", "5", "9", "--output-len", "3", "9"]  # a case's own arguments win
CAPACITY_MISTAKES = {  # name: (arguments besides --bundle and QUICK, message fragment)
    "adapters_not_a_number": (["--adapters", "x"], "argument --adapters: invalid int value: 'x'"),
    "adapters_missing": ([], "the following arguments are required: --adapters"),
    "unknown_argument": (["--adapters", "8", "--colour", "red"], "unrecognized arguments: --colour red"),
    "requests_zero": (["--adapters", "8", "--requests", "0"], "--requests=0: use a positive integer"),
    "requests_negative": (["--adapters", "8", "--requests", "-5"], "--requests=-5: use a positive integer"),
    "tolerance_nan": (["--adapters", "8", "--tolerance", "nan"], "--tolerance=nan: use a number in [0, 1)"),
    "tolerance_above_one": (["--adapters", "8", "--tolerance", "1.5"], "--tolerance=1.5"),
    "tolerance_negative": (["--adapters", "8", "--tolerance", "-0.1"], "--tolerance=-0.1"),
    "seed_negative": (["--adapters", "8", "--seed", "-1"], "--seed=-1: use an integer from 0"),
    "graph_tokens_negative": (["--adapters", "8", "--graph-tokens", "-1"], "--graph-tokens=-1: use a non-negative integer"),
    "skew_over_one_adapter": (["--adapters", "1", "--skew", "0.5"], "--skew=0.5: needs --adapters ≥ 2"),
    "adapters_past_int64": (["--adapters", str(10 ** 19)], f"--adapters={10 ** 19}: use at most"),
    "prompt_length_past_int64": (["--adapters", "8", "--prompt-len", "1", str(10 ** 20)], "--prompt-len="),
    "json_under_a_file": (["--adapters", "8", "--json", "{tmp}/notes/out.json"], "which is not a directory"),
    "json_is_a_directory": (["--adapters", "8", "--json", "{tmp}/shelf"], "is a directory; name a file"),
    "json_is_a_symlink_loop": (["--adapters", "8", "--json", "{tmp}/loop"], "exists; choose a new path"),
    "plot_on_a_pseudo_file_system": (["--adapters", "8", "--plot", "/proc/lorazor-slots.png"],
                                     "on a file system without storage"),
}


@pytest.mark.parametrize("case", sorted(CAPACITY_MISTAKES))
def test_capacity_mistake_is_one_line(tmp_path: Path, capsys, case: str) -> None:
    args, fragment = CAPACITY_MISTAKES[case]
    bundle = tiny_bundle(tmp_path / "bundle")
    (tmp_path / "notes").write_text("mine")
    (tmp_path / "shelf").mkdir()
    os.symlink(tmp_path / "loop", tmp_path / "loop")
    before = digest(tmp_path)
    argv = ["--bundle", str(bundle), *QUICK, *(a.format(tmp=tmp_path) for a in args)]
    assert exit_code(lambda: capacity.main(argv)) == 2
    assert_one_error_line(capsys.readouterr().err, fragment)
    assert digest(tmp_path) == before


BAD_RELEASE_POINTS = {  # stats['release_points'] a bundle may hold, each refused by name
    "negative_count": {"r": [1], "count": [-1], "never": 2},
    "counts_fewer_than_points": {"r": [1, 2], "count": [1], "never": 0},
    "nothing_counted": {"r": [1], "count": [0], "never": 0},
    "not_an_object": [1, 2],
    "negative_point": {"r": [-3], "count": [1], "never": 0},
    "point_not_an_integer": {"r": ["a"], "count": [1], "never": 0},
    "never_missing": {"r": [1], "count": [1]},
}


@pytest.mark.parametrize("case", sorted(BAD_RELEASE_POINTS))
def test_capacity_refuses_malformed_release_points(tmp_path: Path, capsys, case: str) -> None:
    bundle = tiny_bundle(tmp_path / "bundle", BAD_RELEASE_POINTS[case])
    assert exit_code(lambda: capacity.main(["--bundle", str(bundle), "--adapters", "4", *QUICK])) == 2
    assert_one_error_line(capsys.readouterr().err, "adapter 'p': stats['release_points'] is not")


def test_capacity_with_good_release_points_runs(tmp_path: Path, capsys) -> None:
    bundle = tiny_bundle(tmp_path / "bundle", {"r": [1, 4], "count": [3, 1], "never": 4})
    assert capacity.main(["--bundle", str(bundle), "--adapters", "4", *QUICK]) == 0
    assert "max_loras needed with release" in capsys.readouterr().out


# --- scripts/train_adapter.py ------------------------------------------------------------------

@cache
def _train_adapter() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_adapter", ROOT / "scripts" / "train_adapter.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_train_adapter(monkeypatch, *argv: str) -> int:
    """``python scripts/train_adapter.py *argv`` in process; its exit code."""
    monkeypatch.setattr(sys, "argv", ["scripts/train_adapter.py", *argv])
    return exit_code(_train_adapter().main)


ROW = {"split": "train", "messages": [{"role": "user", "content": "What is 1 + 1?"}], "target": "1 + 1 = 2\n#### 2",
       "reference": "2", "evaluator": "numeric"}
EVAL_ROW = {**ROW, "split": "validation"}
# One small epoch, so that a mistake the script does not catch ends quickly after training.
SMALL = ["--rank", "2", "--epochs", "1", "--batch", "1", "--max-new-tokens", "2", "--n-eval", "1"]

TRAIN_MISTAKES = {  # name: (rows of --data (bytes: the file), arguments, message fragment; {data}: the file)
    "data_missing": ([ROW], ["--data", "{tmp}/missing.jsonl"], "--data="),
    "data_not_json": (b'{"split": "train", "messages": [\n', [], "{data}:1: not valid JSON"),
    "data_row_without_messages": ([{k: v for k, v in ROW.items() if k != "messages"}], [],
                                  "{data}:1: missing field 'messages'"),
    "data_messages_not_objects": ([ROW, {**ROW, "messages": ["hi"]}], [], "{data}:2: field 'messages' must be"),
    "data_target_a_number": ([{**ROW, "target": 2}], [], "{data}:1: field 'target' is a JSON number"),
    "data_evaluator_unknown": ([{**ROW, "evaluator": "fuzzy"}], [], "{data}:1: field 'evaluator' is 'fuzzy'"),
    "data_without_train_rows": ([EVAL_ROW], [], "holds no row with split 'train'"),
    "rank_zero": ([ROW], ["--rank", "0"], "--rank=0: use a positive integer"),
    "epochs_zero": ([ROW], ["--epochs", "0"], "--epochs=0"),
    "batch_zero": ([ROW], ["--batch", "0"], "--batch=0"),
    "lr_negative": ([ROW], ["--lr", "-1"], "--lr=-1.0: use a positive number"),
    "lr_nan": ([ROW], ["--lr", "nan"], "--lr=nan"),
    "n_eval_negative": ([ROW, EVAL_ROW], ["--n-eval", "-1"], "--n-eval=-1: use a non-negative integer"),
    "max_len_zero": ([ROW], ["--max-len", "0"], "--max-len=0"),
    "max_len_below_every_row": ([ROW], ["--max-len", "3"], "--max-len=3: every one of the 1 train rows is longer"),
    "max_new_tokens_zero": ([ROW], ["--max-new-tokens", "0"], "--max-new-tokens=0"),
    "targets_empty": ([ROW], ["--targets", ","], "--targets=['', '']"),
    "targets_unknown": ([ROW], ["--targets", "q_projx"], "'q_projx' is no linear module of the backbone"),
    "seed_past_uint64": ([ROW], ["--seed", str(10 ** 20)], f"--seed={10 ** 20}"),
    "gguf_dir_missing": ([ROW], ["--gguf-dir", "{tmp}/nowhere"], "not found (backbone.gguf_dir="),
    "out_under_a_file": ([ROW], ["--out", "{tmp}/notes/adapter"], "which is not a directory"),
}


@pytest.mark.parametrize("case", sorted(TRAIN_MISTAKES))
def test_train_adapter_train_mistake_is_one_line(tmp_path: Path, monkeypatch, capsys, case: str) -> None:
    rows, args, fragment = TRAIN_MISTAKES[case]
    data = tmp_path / "data.jsonl"
    data.write_bytes(rows) if isinstance(rows, bytes) else write_jsonl(data, rows)
    (tmp_path / "notes").write_text("mine")
    before = digest(tmp_path)
    argv = ["train", "--data", str(data), "--out", str(tmp_path / "adapter"), *SMALL,
            *(a.format(tmp=tmp_path) for a in args)]
    assert run_train_adapter(monkeypatch, *argv) == 2
    assert_one_error_line(capsys.readouterr().err, fragment.format(data=data))
    assert digest(tmp_path) == before


PREPARE_MISTAKES = {  # name: (arguments besides --out {tmp}/out.jsonl, message fragment)
    "task_unknown": (["--task", "nope"], "unknown task 'nope'"),
    "task_options_not_json": (["--task", "arith", "--task-options", "{bad"], "--task-options='{bad': not valid JSON"),
    "task_options_not_an_object": (["--task", "arith", "--task-options", "[1]"], "give a JSON object"),
    "task_option_out_of_range": (["--task", "arith", "--task-options", '{"max_new_tokens": 0}'],
                                 "task 'arith': max_new_tokens=0: use a positive integer"),
    "task_option_unknown": (["--task", "arith", "--task-options", '{"colour": "red"}'],
                            "task 'arith' has no option 'colour'"),
    "n_eval_negative": (["--task", "arith", "--n-eval", "-5"], "--n-eval=-5"),
    "eval_split_unknown": (["--task", "arith", "--eval-split", "dev"], "--eval-split='dev'"),
    "evaluator_unknown": (["--task", "arith", "--evaluator", "fuzzy"], "argument --evaluator: invalid choice"),
    "out_is_a_directory": (["--task", "arith", "--out", "{tmp}"], "is a directory; name a file"),
    "task_file_with_a_bad_line": (["--task", "gsm8k", "--task-options", '{"source": "{tmp}/gsm8k"}'],
                                  "{tmp}/gsm8k/train.jsonl:2: not valid JSON"),
}


@pytest.mark.parametrize("case", sorted(PREPARE_MISTAKES))
def test_train_adapter_prepare_mistake_is_one_line(tmp_path: Path, monkeypatch, capsys, case: str) -> None:
    args, fragment = PREPARE_MISTAKES[case]
    good = {"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"}
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "train.jsonl").write_text(json.dumps(good) + "\n" + '{"question": "x", "answer": \n')
    write_jsonl(tmp_path / "gsm8k" / "test.jsonl", [good])
    before = digest(tmp_path)
    argv = ["prepare", "--out", str(tmp_path / "out.jsonl"),
            *(a.replace("{tmp}", str(tmp_path)) for a in args)]
    assert run_train_adapter(monkeypatch, *argv) == 2
    assert_one_error_line(capsys.readouterr().err, fragment.replace("{tmp}", str(tmp_path)))
    assert digest(tmp_path) == before


def test_train_adapter_prepare_then_train_checks_pass(tmp_path: Path, monkeypatch) -> None:
    """What `prepare` writes is data `train` accepts (its checks, up to where the model would load)."""
    out = tmp_path / "arith.jsonl"
    assert run_train_adapter(monkeypatch, "prepare", "--task", "arith", "--n-eval", "2", "--out", str(out)) == 0
    script = _train_adapter()
    args = script.parser().parse_args(["train", "--data", str(out), "--out", str(tmp_path / "adapter")])
    _, rows, targets = script.check_train(args)
    assert len(rows) > 2 and rows[-1]["split"] == "validation" and "q_proj" in targets


# --- python -m calibrate: run directories Hydra cannot create -----------------------------------

def _calibrate(run_dir: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "calibrate", f"hydra.run.dir={run_dir}", "task=arith",
                           "adapter=arith_demo", "stages=[data]"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("case", ["name_too_long", "symlink_loop"])
def test_calibrate_run_directory_hydra_cannot_create(tmp_path: Path, case: str) -> None:
    if case == "name_too_long":
        run_dir, fragment = tmp_path / ("x" * 300) / "run", "File name too long"
    else:
        os.symlink(tmp_path / "b", tmp_path / "a")
        os.symlink(tmp_path / "a", tmp_path / "b")
        run_dir, fragment = tmp_path / "a" / "run", "a symbolic link to nothing"
    done = _calibrate(str(run_dir))
    assert done.returncode == 2
    assert_one_error_line(done.stderr, fragment)
