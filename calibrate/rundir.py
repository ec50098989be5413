"""Run-directory layout and stage completion markers.

Layout (all paths relative to the run directory)::

    .hydra/                 Hydra's composed config (written by Hydra)
    engine.json             the engine the run resolved to (engine=auto's choice) and why
    stages/<stage>.json     completion marker: {"fingerprint", "finished_at", "summary"}
    data/<split>.jsonl      the examples each split resolved to (uid, question, reference)
    labels/shards/NNNNN.*   labeling shards (resumable), merged into
    labels/points.parquet   one row per (request, t): uid, adapter, t, y, q_on, q_off, lengths
    labels/features.npy     h_t per row of points.parquet, float32 [N, H]
    heads/heads.safetensors heads/heads.json
    sweep/trees.parquet     release trees of the validation pass
    sweep/*.csv             candidates, frontier, k table, selection, budget comparison
    bundle/                 the policy bundle (manifest.json, heads.safetensors)
    plots/*.png             frontier, k curves, positive rate per t, release histogram
    test/*.csv              realized test skip/accuracy of the exported policy
    agreement/agreement.csv with agreement=true: predicted vs realized on vLLM (plots/agreement.png)

A stage is done when its marker exists with the current fingerprint: a hash of the config
it depends on, chained with its upstream stages' fingerprints, so changing e.g. the label
points re-runs labels and everything after it, while re-running a finished command is a
no-op. Markers are written last, atomically, so an interrupted stage is never marked done.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any


def fingerprint(*parts: Any) -> str:
    """A stable short hash of JSON-serializable parts."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a rename, so readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class RunDir:
    """A calibration run directory with per-stage markers."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, *parts: str) -> Path:
        p = self.root.joinpath(*parts)
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def _marker(self, stage: str) -> Path:
        return self.path("stages", f"{stage}.json")

    def done(self, stage: str, fp: str) -> bool:
        """True iff ``stage`` finished with fingerprint ``fp``."""
        m = self._marker(stage)
        return m.is_file() and json.loads(m.read_text()).get("fingerprint") == fp

    def summary(self, stage: str) -> dict[str, Any]:
        """The summary a finished stage recorded."""
        return json.loads(self._marker(stage).read_text())["summary"]

    def mark_done(self, stage: str, fp: str, summary: dict[str, Any]) -> None:
        write_atomic(self._marker(stage), json.dumps(
            {"fingerprint": fp, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "summary": summary}, indent=2))
