"""Sweep candidates: learned thresholds τ per adapter and profiled release points k (docs/design.md §3.5).

τ candidates are quantiles of a head's scores on its own training points, at levels
q/(n+1) for q = 1…n (evenly spaced inside (0, 1)), rounded to float32 and deduplicated.
Rounding to float32 matters: the runtime holds τ and s_t in float32 (StepTrim), so a
float32 τ makes ``s_t < τ`` decide identically in the sweep and in serving.

Profiled candidates are the same k list for every adapter.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from predictors.heads import Head, check_points

N_QUANTILES = 32
PROFILED_KS = (0, 1, 2, 4, 8, 16, 32, 64, 128)


def tau_candidates(scores: np.ndarray, n_quantiles: int = N_QUANTILES) -> np.ndarray:
    """Sorted, unique float32 τ: the q/(n+1) quantiles (q = 1…n) of ``scores``."""
    s = np.asarray(scores, np.float64)
    if n_quantiles < 1:
        raise ValueError(f"n_quantiles must be ≥ 1, got {n_quantiles} (set sweep.n_quantiles).")
    if s.size == 0:
        return np.empty(0, np.float32)
    levels = np.arange(1, n_quantiles + 1) / (n_quantiles + 1)
    return np.unique(np.quantile(s, levels).astype(np.float32))


@dataclass(frozen=True)
class Candidates:
    """All candidates of a sweep.

    taus: adapter → sorted float32 τ (adapters whose head is not ok have none).
    ks: profiled release points, shared by all adapters.
    """

    taus: dict[str, np.ndarray]
    ks: tuple[int, ...] = PROFILED_KS

    def __post_init__(self) -> None:
        object.__setattr__(self, "taus", {a: np.unique(np.asarray(v, np.float32)) for a, v in self.taus.items()})
        if any(not isinstance(k, (int, np.integer)) or k < 0 for k in self.ks):
            raise ValueError(f"profiled ks must be integers ≥ 0 (prefill is never released), got {self.ks}.")
        object.__setattr__(self, "ks", tuple(sorted({int(k) for k in self.ks})))

    def for_adapter(self, adapter: str) -> list[tuple[str, float]]:
        """(policy, param) pairs priced for ``adapter``: its τ (``learned``) then the k (``profiled``)."""
        taus = self.taus.get(adapter, np.empty(0, np.float32))
        return [("learned", float(t)) for t in taus] + [("profiled", float(k)) for k in self.ks]

    def save(self, path: str | Path) -> Path:
        """Write as JSON (float32 τ survive exactly as JSON floats)."""
        doc = {"ks": [int(k) for k in self.ks], "taus": {a: [float(t) for t in v] for a, v in self.taus.items()}}
        Path(path).write_text(json.dumps(doc, indent=1) + "\n")
        return Path(path)

    @classmethod
    def load(cls, path: str | Path) -> Candidates:
        """Read candidates written by :meth:`save`."""
        doc = json.loads(Path(path).read_text())
        return cls(taus={a: np.asarray(v, np.float32) for a, v in doc["taus"].items()}, ks=tuple(doc["ks"]))


def build_candidates(heads: Mapping[str, Head], points: pd.DataFrame, features: np.ndarray,
                     n_quantiles: int = N_QUANTILES, ks: Sequence[int] = PROFILED_KS) -> Candidates:
    """τ from each ok head's scores on its training points (``points`` row j ↔ ``features[j]``)."""
    check_points(points, features)
    rows = points.groupby("adapter").indices
    taus = {a: tau_candidates(h.scores(features[rows[a]]), n_quantiles)
            for a, h in heads.items() if h.ok and a in rows}
    return Candidates(taus=taus, ks=tuple(ks))
