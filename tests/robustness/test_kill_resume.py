"""Three seeded SIGKILLs of `python -m calibrate` (in labels, sweep and export), each followed by a
re-run: the final outputs equal the uninterrupted tiny run's. The 24-kill version over every stage
is `python -m benchmarks.robustness.kill_resume` (benchmarks/results/2026-12-01-kill-resume.md)."""
from __future__ import annotations

import json
import random
from datetime import datetime
from pathlib import Path

from benchmarks.robustness.kill_resume import STAGE_ORDER, kill_chain, run_contents
from tests.calibrate.test_pipeline import TINY

TARGETS = ("labels", "sweep", "export")


def stage_seconds(run_dir: Path) -> dict[str, float]:
    """Each stage's duration in the uninterrupted run, from consecutive stage markers' ``finished_at``
    (1 s resolution, so at least 1 s): the kill delays follow this machine's speed."""
    done = [datetime.fromisoformat(json.loads((run_dir / "stages" / f"{s}.json").read_text())["finished_at"])
            for s in STAGE_ORDER]
    return {s: max((done[i] - done[i - 1]).total_seconds(), 1.0) for i, s in enumerate(STAGE_ORDER) if i}


def test_three_kills_then_identical_outputs(tmp_path: Path, tiny_run) -> None:
    rng = random.Random(0)
    # A kill lands in the first half of its stage, so a machine faster than the reference run still
    # kills mid-stage. A loaded machine can run the reference slower than the chain, so that a kill
    # lands after its stage or the run: such a chain is still compared, and another follows with the
    # delays halved, until one chain has two kills.
    targets = [(stage, 0.5 * rng.random()) for stage in TARGETS]
    durations, reference = stage_seconds(tiny_run[0]), run_contents(tiny_run[0])
    chains = []
    for attempt in range(3):
        scaled = [(stage, u * 0.5 ** attempt) for stage, u in targets]
        chain = kill_chain(tmp_path / f"run{attempt}", TINY, scaled, durations, reference)
        chains.append(chain)
        assert chain.returncode == 0, chains
        assert chain.diffs == [], chains
        assert len(chain.kills) + len(chain.skipped) == 3, chains
        if len(chain.kills) >= 2:
            break
    else:
        raise AssertionError(f"no chain killed the run twice: {chains}")
