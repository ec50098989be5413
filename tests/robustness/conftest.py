"""The robustness battery's small finished run, shared by its files."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def small_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """(run directory, contents as benchmarks.robustness.kill_resume.run_contents compares them) of
    a lone in-process run of the kill battery's small config (KILL_CONFIG). Copy it before running
    more in it."""
    from benchmarks.robustness.kill_resume import KILL_CONFIG, run_contents
    from tests.calibrate.test_pipeline import run

    run_dir = tmp_path_factory.mktemp("small_run")
    run(run_dir, KILL_CONFIG)
    return run_dir, run_contents(run_dir)
