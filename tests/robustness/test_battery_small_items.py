"""The smaller holes: a run directory on a pseudo-file system, a data file whose reference reads as a
special number, the early-stop switch in the bundle's config fingerprint, and a line break in a
bundle's path. Each is one line (exit code 2 on a command line) before any work, or no difference."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.robustness.kill_resume import KILL_CONFIG
from calibrate.rundir import RunDir
from calibrate.rundir_access import RunDirError
from calibrate.validate import validate_task_data
from labeling.evaluators.numeric import numeric_decided, numeric_match
from labeling.tasks import TaskError, build_task
from serve_bridge import capacity
from serve_bridge.bundle import BundleError, load_bundle
from tests.calibrate.test_pipeline import run
from tests.conftest import ROOT
from tests.robustness.helpers import assert_one_error_line, digest, exit_code, write_jsonl


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


# --- references that read as special numbers -----------------------------------------------------

GOOD = {"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"}


@pytest.mark.parametrize("reference", ["sNaN", "NaN", "Infinity", "-inf"])
def test_special_number_reference_is_refused_by_the_data_check(tmp_path: Path, reference: str) -> None:
    src = tmp_path / "gsm8k"
    write_jsonl(src / "train.jsonl", [GOOD, {"question": "How many?", "answer": f"none\n#### {reference}"}])
    write_jsonl(src / "test.jsonl", [GOOD])
    with pytest.raises(TaskError, match=f"{src / 'train.jsonl'}:2: field 'answer' gives the reference "
                                        f"'{reference}', which is not a finite number") as info:
        validate_task_data(build_task("gsm8k", source=str(src)))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("reference", ["sNaN", "-sNaN7"])
def test_special_number_reference_scores_zero_without_raising(reference: str) -> None:
    assert numeric_match("#### 5", reference) == 0 and numeric_match("#### sNaN 5", reference) == 0
    assert numeric_decided("#### 5 ", reference)


# --- labeling.early_stop and the bundle ------------------------------------------------------------

def test_early_stop_leaves_the_bundle_byte_for_byte_the_same(tmp_path: Path, small_run) -> None:
    """The switch changes how much is generated, never a result (docs/pipeline.md): the bundles
    exported with it on and off are the same files, the config fingerprint in the manifest too."""
    bundles = {}
    for early_stop in ("true", "false"):
        run_dir = Path(shutil.copytree(small_run[0], tmp_path / early_stop))
        (run_dir / "stages" / "export.json").unlink()
        run(run_dir, [*KILL_CONFIG, f"labeling.early_stop={early_stop}", "stages=[export]"])
        bundles[early_stop] = digest(run_dir / "bundle")
    assert bundles["true"] == bundles["false"]


# --- a line break in a bundle's path ---------------------------------------------------------------

def test_bundle_path_with_a_line_break_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(BundleError) as info:
        load_bundle(tmp_path / "runs\nbundle")
    assert "\n" not in str(info.value) and "runs\\nbundle" in str(info.value)


def test_served_bundle_path_with_a_line_break_is_one_line(tmp_path: Path) -> None:
    from serve_bridge.runtime import build_runtime

    with pytest.raises(BundleError) as info:
        build_runtime(tmp_path / "runs\nbundle", 8, "cpu")
    assert "\n" not in str(info.value)


def test_capacity_bundle_path_with_a_line_break_is_one_line(tmp_path: Path, capsys) -> None:
    assert exit_code(lambda: capacity.main(["--bundle", str(tmp_path / "runs\nbundle"), "--adapters", "8"])) == 2
    assert_one_error_line(capsys.readouterr().err, "runs\\nbundle")
