"""The run directory's lock is a property of the directory (calibrate/rundir_access.py), not of the
inode at ``.lock``: a ``.lock`` hard-linked to another file, a symbolic link or a FIFO is replaced and
the file it pointed at or shared an inode with stays as it was; one that is a directory is refused in
one line; a ``cp -al`` copy of a run directory runs while its original is in use, and changes none
of the original's files. One writer per directory still holds whatever sits at ``.lock``."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.robustness.kill_resume import KILL_CONFIG
from calibrate.rundir import RunDir
from calibrate.rundir_access import RunDirError
from tests.calibrate.test_pipeline import run
from tests.conftest import ROOT
from tests.robustness.helpers import digest, sha256

DATA_ONLY = ["task=arith", "adapter=arith_demo", "task.sizes.train=4", "task.sizes.validation=2", "task.sizes.test=2",
             "stages=[data]", "engine.progress=false"]


def _snapshot(src: Path, dst: Path) -> Path:
    """A copy of ``src`` made as users make cheap snapshots: every file hard-linked (``cp -al``)."""
    subprocess.run(["cp", "-al", str(src), str(dst)], check=True)
    return dst


def _all_files(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root``, logs and the lock record included."""
    return {p.relative_to(root).as_posix(): sha256(p) for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_run_leaves_the_file_its_lock_is_hard_linked_to_unchanged(tmp_path: Path) -> None:
    other = tmp_path / "notes.txt"
    other.write_text("a file of the user's that shares its inode with the run's .lock\n")
    before = sha256(other)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.link(other, run_dir / ".lock")
    run(run_dir, DATA_ONLY)
    assert sha256(other) == before and (run_dir / "stages" / "data.json").is_file()
    assert (run_dir / ".lock").read_text() == "" and not os.path.samefile(other, run_dir / ".lock")


@pytest.mark.parametrize("kind", ["fifo", "symlink_to_a_user_file", "dangling_symlink"])
def test_a_lock_record_that_is_no_regular_file_is_replaced(tmp_path: Path, kind: str) -> None:
    run_dir, user_file = tmp_path / "run", tmp_path / "notes.txt"
    run_dir.mkdir()
    user_file.write_text("mine\n")
    if kind == "fifo":
        os.mkfifo(run_dir / ".lock")
    else:
        os.symlink(user_file if kind == "symlink_to_a_user_file" else tmp_path / "nowhere", run_dir / ".lock")
    run(run_dir, DATA_ONLY)
    assert user_file.read_text() == "mine\n" and not (tmp_path / "nowhere").exists()
    assert (run_dir / ".lock").is_file() and not (run_dir / ".lock").is_symlink()


def test_a_lock_record_that_is_a_directory_is_one_line(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    (run_dir / ".lock").mkdir(parents=True)
    (run_dir / ".lock" / "kept").write_text("x")
    with pytest.raises(RunDirError, match=f"{run_dir / '.lock'} is a directory, but the run keeps its lock record "
                                          f"there") as info:
        run(run_dir, DATA_ONLY)
    assert "\n" not in str(info.value) and (run_dir / ".lock" / "kept").read_text() == "x"
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock"]


def test_a_snapshot_runs_while_its_original_is_in_use(tmp_path: Path, small_run) -> None:
    """The original is held (a run in progress); its ``cp -al`` copy is another directory, so
    another lock: a run there goes ahead and leaves every file of the original as it was."""
    original = _snapshot(small_run[0], tmp_path / "original")  # the shared run stays untouched
    with RunDir(original).locked():
        before = _all_files(original)
        snapshot = _snapshot(original, tmp_path / "snapshot")
        run(snapshot, KILL_CONFIG)
        assert _all_files(original) == before
    assert digest(snapshot) == digest(original)


def test_the_cli_in_a_snapshot_leaves_the_original_as_it_was(tmp_path: Path, small_run) -> None:
    """`python -m calibrate` in a ``cp -al`` copy of a run directory in use: exit code 0, and the
    original's files, its lock record and its job log among them, keep their bytes."""
    original = _snapshot(small_run[0], tmp_path / "original")
    (original / "__main__.log").write_text("the original run's log\n")
    with RunDir(original).locked():
        before = _all_files(original)
        snapshot = _snapshot(original, tmp_path / "snapshot")
        done = subprocess.run([sys.executable, "-m", "calibrate", f"hydra.run.dir={snapshot}", *KILL_CONFIG],
                              cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        assert _all_files(original) == before
    assert (snapshot / ".hydra" / "config.yaml").is_file() and not (original / ".hydra").exists()


def test_one_writer_even_when_the_lock_record_is_hard_linked(tmp_path: Path) -> None:
    run_dir, other = tmp_path / "run", tmp_path / "other"
    run_dir.mkdir()
    other.write_text("x")
    os.link(other, run_dir / ".lock")
    with RunDir(run_dir).locked():
        with pytest.raises(RunDirError, match=f"in use by another run \\(PID {os.getpid()}\\)"):
            with RunDir(run_dir).locked():
                pass
    assert other.read_text() == "x"
