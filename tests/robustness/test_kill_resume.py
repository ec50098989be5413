"""Three seeded SIGKILLs of `python -m calibrate` (in labels, sweep and export), each followed by a
re-run: the final outputs equal the uninterrupted tiny run's. The 24-kill version over every stage
is `python -m benchmarks.robustness.kill_resume` (benchmarks/results/2026-12-01-kill-resume.md)."""
from __future__ import annotations

import random
from pathlib import Path

from benchmarks.robustness.kill_resume import kill_chain, run_contents
from tests.calibrate.test_pipeline import TINY

# Rough stage durations of the tiny run on 2 CPU cores (s); a kill lands u × this after the stage starts.
DURATIONS = {"labels": 30.0, "sweep": 15.0, "export": 4.0}


def test_three_kills_then_identical_outputs(tmp_path: Path, tiny_run) -> None:
    rng = random.Random(0)
    targets = [(stage, rng.random()) for stage in DURATIONS]
    chain = kill_chain(tmp_path / "run", TINY, targets, DURATIONS, run_contents(tiny_run[0]))
    assert chain.returncode == 0
    assert chain.diffs == [], chain.diffs
    assert len(chain.kills) + len(chain.skipped) == 3 and len(chain.kills) >= 2, chain
