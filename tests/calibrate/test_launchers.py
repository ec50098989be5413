"""Hydra multirun through the joblib launcher (the local scale-out path), on CPU."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT


def test_joblib_multirun_runs_each_job_in_its_own_run_dir(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "calibrate", "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
         "task=arith", "adapter=arith_demo", "task.sizes.validation=4,5", "stages=[data]", f"hydra.sweep.dir={tmp_path}",
         "hydra.sweep.subdir=v${task.sizes.validation}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    for n in (4, 5):
        summary = json.loads((tmp_path / f"v{n}" / "stages" / "data.json").read_text())["summary"]
        assert summary["validation"] == n
        assert len((tmp_path / f"v{n}" / "data" / "validation.jsonl").read_text().splitlines()) == n
