"""Run directories that cannot be used: a file, under a file, a bookkeeping entry that is a file,
a read-only mount (a fully cached run too), a full file system, and one that fills up during a
stage. Each is one line on stderr and exit code 2 (a RunDirError in process), before anything in
the directory changes; a stage cut short by a full disk leaves the previous complete state.

Read-only and full file systems are real: a bind mount remounted read-only and a small tmpfs,
made in a private mount namespace (``unshare -m``) around the `python -m calibrate` process;
those cases are skipped where this machine cannot make one."""
from __future__ import annotations

import errno
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from benchmarks.robustness.kill_resume import KILL_CONFIG, run_contents
from calibrate.rundir_access import RunDirError
from tests.calibrate.test_pipeline import cli, run
from tests.conftest import ROOT
from tests.robustness.helpers import digest


def _one_error_line(proc: subprocess.Popen, fragment: str) -> None:
    _, err = proc.communicate(timeout=600)
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], err


def test_run_directory_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "run").write_text("notes")
    _one_error_line(cli(tmp_path / "run", *KILL_CONFIG), f"run directory {tmp_path / 'run'} is a file")
    assert (tmp_path / "run").read_text() == "notes"


def test_run_directory_under_a_file(tmp_path: Path) -> None:
    (tmp_path / "notes").write_text("notes")
    _one_error_line(cli(tmp_path / "notes" / "a" / "run", *KILL_CONFIG),
                    f"is under {tmp_path / 'notes'}, which is a file")


@pytest.mark.parametrize("entry", ["stages", "labels", ".scratch", ".publishing"])
def test_bookkeeping_entry_that_is_a_file(tmp_path: Path, small_run, entry: str) -> None:
    run_dir = Path(shutil.copytree(small_run[0], tmp_path / "run"))
    if (run_dir / entry).exists():
        shutil.rmtree(run_dir / entry)
    (run_dir / entry).write_text("x")
    before = digest(run_dir)
    with pytest.raises(RunDirError, match=f"{run_dir / entry} is not a directory"):
        run(run_dir, KILL_CONFIG)
    assert digest(run_dir) == before


def test_disk_full_during_a_stage_keeps_the_previous_state(tmp_path: Path, small_run, monkeypatch) -> None:
    """ENOSPC while the labels stage writes its features (injected: the file system fills up)."""
    run_dir = Path(shutil.copytree(small_run[0], tmp_path / "run"))
    (run_dir / "stages" / "labels.json").unlink()
    before = digest(run_dir)

    def full(path, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(np, "save", full)
    with pytest.raises(RunDirError, match="cannot take the run's output: No space left on device .*features.npy.*"
                                          "free some space and run again"):
        run(run_dir, KILL_CONFIG)
    assert digest(run_dir) == before and not (run_dir / ".scratch").exists()


# --- real read-only and full file systems ---------------------------------------------------

@cache
def _can_mount() -> bool:
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
                           capture_output=True) if shutil.which("unshare") else None
    return probe is not None and probe.returncode == 0


def _cli_mounted(mount: str, run_dir: Path, *overrides: str) -> subprocess.Popen:
    """`python -m calibrate` in a private mount namespace after the shell commands ``mount``."""
    if not _can_mount():
        pytest.skip("cannot make a mount namespace here (unshare -m)")
    return subprocess.Popen(["unshare", "-m", "sh", "-c", f'{mount} && exec "$0" -m calibrate "$@"', sys.executable,
                             f"hydra.run.dir={run_dir}", *overrides],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _read_only(d: Path) -> str:
    return f"mount --bind {d} {d} && mount -o remount,ro,bind {d}"


def test_read_only_fully_cached_run(tmp_path: Path, small_run) -> None:
    """Every stage is cached, but a run still writes its lock, config record and log: one line."""
    run_dir = Path(shutil.copytree(small_run[0], tmp_path / "run"))
    before = run_contents(run_dir)
    _one_error_line(_cli_mounted(_read_only(run_dir), run_dir, *KILL_CONFIG),
                    f"run directory {run_dir} is not writable: Read-only file system")
    assert run_contents(run_dir) == before


def test_read_only_parent_of_a_new_run(tmp_path: Path) -> None:
    _one_error_line(_cli_mounted(_read_only(tmp_path), tmp_path / "run", *KILL_CONFIG),
                    f"run directory {tmp_path / 'run'} cannot be created: Read-only file system")


def test_full_file_system(tmp_path: Path) -> None:
    _one_error_line(_cli_mounted(f"mount -t tmpfs -o size=1m tmpfs {tmp_path}", tmp_path / "run", *KILL_CONFIG),
                    "MiB free on its file system, a run needs 64 MiB")
