"""The smaller holes: a run directory on a pseudo-file system (/proc, /sys) is one line, exit code 2
on the command line, before anything is written."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from benchmarks.robustness.kill_resume import KILL_CONFIG
from calibrate.rundir import RunDir
from calibrate.rundir_access import RunDirError
from tests.conftest import ROOT
from tests.robustness.helpers import assert_one_error_line


def _pseudo(path: str) -> str:
    if not os.path.isdir("/proc") or os.statvfs("/proc").f_blocks != 0:
        pytest.skip("no /proc pseudo-file system here")
    return path


# --- a run directory on a pseudo-file system ---------------------------------------------------

@pytest.mark.parametrize("path", ["/proc/lorazor-run", "/proc/self"], ids=["new", "existing"])
def test_run_directory_on_a_pseudo_file_system(path: str) -> None:
    with pytest.raises(RunDirError, match=f"run directory {_pseudo(path)} is on a file system without storage") as info:
        with RunDir(path).locked():
            pass
    assert "\n" not in str(info.value)


def test_calibrate_cli_on_a_pseudo_file_system() -> None:
    done = subprocess.run([sys.executable, "-m", "calibrate", f"hydra.run.dir={_pseudo('/proc/lorazor-run')}",
                           *KILL_CONFIG], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 2
    assert_one_error_line(done.stderr, "is on a file system without storage")
