"""No command writes over its own inputs or over a file it did not create (serve_bridge/safe_write.py):
an output named as an input (by its path, a hard link or a symbolic link), inside an input directory
or holding an input is refused in one line with exit code 2 and every input keeps its sha256; an
existing output is replaced only with ``--replace``, and then by a rename. The run directory of
`python -m calibrate` and the run's inputs are disjoint (calibrate/validate.py)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from calibrate.rundir_access import RunDirError
from serve_bridge import capacity
from tests.calibrate.test_pipeline import run
from tests.conftest import DEMO_ADAPTER, ROOT
from tests.robustness.helpers import assert_one_error_line, digest, exit_code, sha256, write_jsonl
from tests.robustness.test_battery_commands import EVAL_ROW, QUICK, ROW, SMALL, run_train_adapter, tiny_bundle


# --- python -m serve_bridge.capacity: --bundle in, --plot and --json out --------------------------

def _link(kind: str, target: Path, link: Path) -> Path:
    (os.link if kind == "hard" else os.symlink)(target, link)
    return link


CAPACITY_OUTPUTS = {  # name: (make the output path from (bundle, tmp), extra arguments, message fragment)
    "json_is_the_manifest": (lambda b, t: b / "manifest.json", [], "the command's input"),
    "plot_is_the_heads_file": (lambda b, t: b / "heads.safetensors", ["--replace"], "the command's input"),
    "json_is_a_hard_link_to_the_manifest": (lambda b, t: _link("hard", b / "manifest.json", t / "m.json"),
                                            ["--replace"], "is the command's input"),
    "json_is_a_symlink_to_the_manifest": (lambda b, t: _link("soft", b / "manifest.json", t / "m.json"),
                                          ["--replace"], "the command's input"),
    "json_new_inside_the_bundle": (lambda b, t: b / "slots.json", [], "lies inside the command's input"),
    "json_is_a_file_of_the_user": (lambda b, t: t / "notes", [], "exists; choose a new path, or pass --replace"),
}


@pytest.mark.parametrize("case", sorted(CAPACITY_OUTPUTS))
def test_capacity_never_writes_its_input_or_a_user_file(tmp_path: Path, capsys, case: str) -> None:
    make, extra, fragment = CAPACITY_OUTPUTS[case]
    bundle = tiny_bundle(tmp_path / "bundle")
    (tmp_path / "notes").write_text("mine")
    out = make(bundle, tmp_path)
    before = digest(tmp_path)
    flag = "--plot" if case.startswith("plot") else "--json"
    argv = ["--bundle", str(bundle), "--adapters", "4", *QUICK, flag, str(out), *extra]
    assert exit_code(lambda: capacity.main(argv)) == 2
    assert_one_error_line(capsys.readouterr().err, fragment)
    assert digest(tmp_path) == before and sha256(bundle / "manifest.json") == before["bundle/manifest.json"]


def test_capacity_json_and_plot_on_one_path(tmp_path: Path, capsys) -> None:
    bundle = tiny_bundle(tmp_path / "bundle")
    out = str(tmp_path / "slots")
    assert exit_code(lambda: capacity.main(["--bundle", str(bundle), "--adapters", "4", *QUICK, "--json", out,
                                            "--plot", out])) == 2
    assert_one_error_line(capsys.readouterr().err, "is also --plot")
    assert not os.path.lexists(out)


def test_capacity_replace_renames_a_new_file_into_place(tmp_path: Path) -> None:
    bundle = tiny_bundle(tmp_path / "bundle")
    out, other = tmp_path / "slots.json", tmp_path / "other"
    other.write_text("kept")
    os.link(other, out)  # the old output shares its inode with another name
    assert capacity.main(["--bundle", str(bundle), "--adapters", "4", *QUICK, "--json", str(out), "--replace"]) == 0
    assert json.loads(out.read_text())["results"] and other.read_text() == "kept"


# --- scripts/train_adapter.py train: --data (and --gguf-dir) in, --out out ---------------------------

@pytest.mark.parametrize("case", ["out_is_the_data_file", "out_holds_the_data_file", "out_is_an_existing_adapter"])
def test_train_never_writes_its_input_or_a_user_directory(tmp_path: Path, monkeypatch, capsys, case: str) -> None:
    data = write_jsonl(tmp_path / "work" / "data.jsonl", [ROW, EVAL_ROW])
    existing = shutil.copytree(DEMO_ADAPTER, tmp_path / "adapter")
    out, extra, fragment = {"out_is_the_data_file": (data, ["--replace"], "is the command's input"),
                            "out_holds_the_data_file": (data.parent, ["--replace"], "holds the command's input"),
                            "out_is_an_existing_adapter": (existing, [], "exists; choose a new path")}[case]
    before = digest(tmp_path)
    argv = ["train", "--data", str(data), "--out", str(out), *SMALL, *extra]
    assert run_train_adapter(monkeypatch, *argv) == 2
    assert_one_error_line(capsys.readouterr().err, fragment)
    assert digest(tmp_path) == before and sha256(data) == before["work/data.jsonl"]


def test_train_replace_swaps_the_adapter_directory(tmp_path: Path, monkeypatch) -> None:
    """`--replace` trains, then renames the new adapter into place of the old directory."""
    data = write_jsonl(tmp_path / "data.jsonl", [ROW, EVAL_ROW])
    out = tmp_path / "adapter"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    assert run_train_adapter(monkeypatch, "train", "--data", str(data), "--out", str(out), *SMALL, "--replace") == 0
    assert {"TRAINING.json", "adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in out.iterdir()}
    assert not (out / "stale.txt").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "data.jsonl"]


# --- scripts/train_adapter.py prepare: the task's data in, --out out ---------------------------------

GSM8K = {"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"}


@pytest.mark.parametrize("case", ["out_is_the_train_file", "out_is_the_train_file_replace",
                                  "out_is_a_hard_link_to_the_train_file", "out_is_a_symlink_to_the_test_file",
                                  "out_is_a_file_of_the_user"])
def test_prepare_never_writes_the_task_data_or_a_user_file(tmp_path: Path, monkeypatch, capsys, case: str) -> None:
    src = tmp_path / "gsm8k"
    write_jsonl(src / "train.jsonl", [GSM8K] * 3)
    write_jsonl(src / "test.jsonl", [GSM8K])
    (tmp_path / "notes").write_text("mine")
    make, extra = {"out_is_the_train_file": (lambda: src / "train.jsonl", []),
                   "out_is_the_train_file_replace": (lambda: src / "train.jsonl", ["--replace"]),
                   "out_is_a_hard_link_to_the_train_file": (
                       lambda: _link("hard", src / "train.jsonl", tmp_path / "t.jsonl"), ["--replace"]),
                   "out_is_a_symlink_to_the_test_file": (
                       lambda: _link("soft", src / "test.jsonl", tmp_path / "t.jsonl"), ["--replace"]),
                   "out_is_a_file_of_the_user": (lambda: tmp_path / "notes", [])}[case]
    out = make()
    before = digest(tmp_path)
    argv = ["prepare", "--task", "gsm8k", "--task-options", json.dumps({"source": str(src), "val_size": 1}),
            "--out", str(out), *extra]
    assert run_train_adapter(monkeypatch, *argv) == 2
    fragment = "exists; choose a new path" if case == "out_is_a_file_of_the_user" else "the command's input"
    assert_one_error_line(capsys.readouterr().err, fragment)
    assert digest(tmp_path) == before and sha256(src / "train.jsonl") == before["gsm8k/train.jsonl"]


# --- python -m calibrate: the run directory and the run's inputs ------------------------------------

def _gsm8k_in(run_dir: Path) -> tuple[Path, list[str]]:
    """A local GSM8K source at ``run_dir/data``, where the run keeps its own split files."""
    src = run_dir / "data"
    write_jsonl(src / "train.jsonl", [GSM8K] * 3)
    write_jsonl(src / "test.jsonl", [GSM8K])
    return src, ["task=gsm8k", f"task.options.source={src}", "task.options.val_size=1", "adapter=arith_demo",
                 "stages=[data]", "engine.progress=false"]


def test_calibrate_refuses_task_data_inside_its_run_directory(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    src, overrides = _gsm8k_in(run_dir)
    before = digest(tmp_path)
    with pytest.raises(RunDirError, match=f"{src / 'train.jsonl'} is an input of the run but lies inside its run "
                                          f"directory {run_dir}"):
        run(run_dir, overrides)
    assert digest(tmp_path) == before and sha256(src / "train.jsonl") == before["run/data/train.jsonl"]


def test_calibrate_cli_refuses_task_data_inside_its_run_directory(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    src, overrides = _gsm8k_in(run_dir)
    before = digest(tmp_path)
    done = subprocess.run([sys.executable, "-m", "calibrate", f"hydra.run.dir={run_dir}", *overrides], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 2
    assert_one_error_line(done.stderr, "is an input of the run but lies inside its run directory")
    assert digest(tmp_path) == before


def test_calibrate_refuses_an_adapter_inside_its_run_directory(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    adapter = shutil.copytree(DEMO_ADAPTER, run_dir / "data" / "arith-a")
    before = digest(tmp_path)
    with pytest.raises(RunDirError, match="is an input of the run but lies inside its run directory"):
        run(run_dir, ["task=arith", "adapter=arith_demo", f"adapter.adapters=[{{name: arith-a, path: {adapter}}}]",
                      "stages=[data]", "engine.progress=false"])
    assert digest(tmp_path) == before


def test_calibrate_refuses_a_run_directory_inside_an_adapter(tmp_path: Path) -> None:
    adapter = shutil.copytree(DEMO_ADAPTER, tmp_path / "arith-a")
    before = digest(tmp_path)
    with pytest.raises(RunDirError, match=f"run directory {adapter / 'run'} lies inside {adapter}, an input"):
        run(adapter / "run", ["task=arith", "adapter=arith_demo",
                              f"adapter.adapters=[{{name: arith-a, path: {adapter}}}]", "stages=[data]",
                              "engine.progress=false"])
    assert digest(tmp_path) == before
