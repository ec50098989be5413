"""One finished tiny pipeline run on the embedded default, shared by the tests that start from it
(each stage is cached in the run directory, so a test that needs a later stage runs only that)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.calibrate.test_pipeline import TINY, run


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """(run directory, stage summaries) of `python -m calibrate` with TINY's overrides. Read it,
    or copy it (``shutil.copytree``) before running more stages in it."""
    run_dir = tmp_path_factory.mktemp("tiny_run")
    return run_dir, run(run_dir, TINY)
