"""Sweep candidates: learned thresholds τ per adapter and profiled release points k (docs/design.md §3.5).

τ candidates per adapter, the union of two grids, rounded to float32 and deduplicated:

- quantiles of the head's scores on its own training points, at levels q/(n+1) for
  q = 1…n (evenly spaced inside (0, 1));
- τ at target skip levels: on the labeled training trajectories, a τ releases each request at
  its first labeled t with s_t < τ and skips that OFF branch's decode forwards after t (the
  skip fraction of :mod:`serve_bridge.steptrim`). For each target level the grid takes the
  smallest τ whose training skip reaches it, so the candidates cover 0–100 % skip evenly,
  including the low-loss end just above never releasing, where raw-score quantiles are sparse.

Rounding to float32 matters: the runtime holds τ and s_t in float32 (StepTrim), so a
float32 τ makes ``s_t < τ`` decide identically in the sweep and in serving. Both grids are
just τ values: the sweep prices any τ exactly.

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
from serve_bridge.steptrim import MAX_LAG

N_QUANTILES = 32
PROFILED_KS = (0, 1, 2, 4, 8, 16, 32, 64, 128)
# Target training skip levels (fractions): dense near 0, where the low-loss candidates are.
_MAX_TRIED, _CHUNK = 2048, 64  # τ tried for the skip levels; τ per vectorised block
SKIP_LEVELS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, *(i / 20 for i in range(2, 21)))


def tau_candidates(scores: np.ndarray, n_quantiles: int = N_QUANTILES) -> np.ndarray:
    """Sorted, unique float32 τ: the q/(n+1) quantiles (q = 1…n) of ``scores``."""
    s = np.asarray(scores, np.float64)
    if n_quantiles < 1:
        raise ValueError(f"n_quantiles must be ≥ 1, got {n_quantiles} (set sweep.n_quantiles).")
    if s.size == 0:
        return np.empty(0, np.float32)
    levels = np.arange(1, n_quantiles + 1) / (n_quantiles + 1)
    return np.unique(np.quantile(s, levels).astype(np.float32))


def training_skip(points: pd.DataFrame, scores: np.ndarray, taus: np.ndarray, lag: int = 0) -> np.ndarray:
    """Skip fraction of each τ on the labeled training trajectories of one adapter.

    ``points`` (uid, t, on_length, off_length) row j has score ``scores[j]``. A request is
    released at its first labeled t with s_t < τ, plus ``lag`` (the OFF_t branch's ``off_length``
    tokens stand for its length: branches are labeled at the points only) or not at all (the ON
    response, ``on_length`` tokens); skip = Σ skipped decode forwards / Σ decode forwards, as
    :func:`serve_bridge.steptrim.skip_fraction` counts them. Only the τ grid uses it; the sweep
    prices each τ exactly.
    """
    df = points.assign(s=np.asarray(scores, np.float32)).sort_values(["uid", "t"], kind="stable")
    groups = list(df.groupby("uid", sort=False))
    width = max((len(g) for _, g in groups), default=0)
    n = len(groups)
    prefix_min = np.full((n, width), np.inf, np.float32)  # min s over the labeled t ≤ this one
    skipped = np.zeros((n, width))
    decode = np.zeros((n, width))
    on_decode = np.zeros(n)
    for i, (_, g) in enumerate(groups):
        m = len(g)
        prefix_min[i, :m] = np.minimum.accumulate(np.nan_to_num(g["s"].to_numpy(), nan=np.inf))
        off = g["off_length"].to_numpy()
        skipped[i, :m] = np.maximum(0, off - 1 - g["t"].to_numpy() - lag)
        decode[i, :m] = np.maximum(0, off - 1)
        on_decode[i] = max(0, int(g["on_length"].iloc[0]) - 1)
    taus = np.asarray(taus, np.float32)
    out = np.zeros(taus.size)
    rows = np.arange(n)[None]
    for lo in range(0, taus.size, _CHUNK):
        fire = prefix_min[None] < taus[lo:lo + _CHUNK, None, None]  # [τ, request, point]
        released, first = fire.any(-1), fire.argmax(-1)
        num = np.where(released, skipped[rows, first], 0.0).sum(-1)
        den = np.where(released, decode[rows, first], on_decode[None]).sum(-1)
        out[lo:lo + _CHUNK] = np.divide(num, den, out=np.zeros_like(num), where=den > 0)
    return out


def skip_level_taus(points: pd.DataFrame, scores: np.ndarray, levels: Sequence[float] = SKIP_LEVELS,
                    lag: int = 0) -> np.ndarray:
    """Sorted unique float32 τ: for each level, the smallest τ whose training skip reaches it
    (the largest τ tried when none does). τ are tried just above each distinct score, where
    the training skip changes (at most ``_MAX_TRIED`` of them, evenly spaced)."""
    s = np.unique(np.asarray(scores, np.float32)[np.isfinite(scores)])
    if s.size == 0 or not len(levels):
        return np.empty(0, np.float32)
    if s.size > _MAX_TRIED:  # evenly spaced distinct scores: τ resolution of 1/_MAX_TRIED of them
        s = np.unique(s[np.linspace(0, s.size - 1, _MAX_TRIED).round().astype(int)])
    if any(not 0 < x <= 1 for x in levels):
        raise ValueError(f"skip levels must be fractions in (0, 1], got {list(levels)} (sweep.skip_levels).")
    tried = np.nextafter(s, np.float32(np.inf))  # the smallest float32 τ with s < τ
    skip = np.maximum.accumulate(training_skip(points, scores, tried, lag))  # monotone envelope
    idx = np.minimum(np.searchsorted(skip, np.asarray(levels) - 1e-12), tried.size - 1)
    return np.unique(tried[idx])


@dataclass(frozen=True)
class Candidates:
    """All candidates of a sweep.

    taus: adapter → sorted float32 τ (adapters whose head is not ok have none).
    ks: profiled release points, shared by all adapters.
    lag: the learned policies' decision lag (:class:`serve_bridge.steptrim.LearnedPolicy`): a τ
        that first fires at forward t releases at r = t + lag (``sweep.decision_lag``).
    """

    taus: dict[str, np.ndarray]
    ks: tuple[int, ...] = PROFILED_KS
    lag: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "taus", {a: np.unique(np.asarray(v, np.float32)) for a, v in self.taus.items()})
        if any(not isinstance(k, (int, np.integer)) or k < 0 for k in self.ks):
            raise ValueError(f"profiled ks must be integers ≥ 0 (prefill is never released), got {self.ks}.")
        object.__setattr__(self, "ks", tuple(sorted({int(k) for k in self.ks})))
        if isinstance(self.lag, bool) or not isinstance(self.lag, (int, np.integer)) or not 0 <= self.lag <= MAX_LAG:
            raise ValueError(f"the decision lag must be an integer in 0…{MAX_LAG}, got {self.lag!r} (sweep.decision_lag).")
        object.__setattr__(self, "lag", int(self.lag))

    def for_adapter(self, adapter: str) -> list[tuple[str, float]]:
        """(policy, param) pairs priced for ``adapter``: its τ (``learned``) then the k (``profiled``)."""
        taus = self.taus.get(adapter, np.empty(0, np.float32))
        return [("learned", float(t)) for t in taus] + [("profiled", float(k)) for k in self.ks]

    def save(self, path: str | Path) -> Path:
        """Write as JSON (float32 τ survive exactly as JSON floats)."""
        doc = {"ks": [int(k) for k in self.ks], "lag": self.lag,
               "taus": {a: [float(t) for t in v] for a, v in self.taus.items()}}
        Path(path).write_text(json.dumps(doc, indent=1) + "\n")
        return Path(path)

    @classmethod
    def load(cls, path: str | Path) -> Candidates:
        """Read candidates written by :meth:`save`."""
        doc = json.loads(Path(path).read_text())
        return cls(taus={a: np.asarray(v, np.float32) for a, v in doc["taus"].items()}, ks=tuple(doc["ks"]),
                   lag=doc.get("lag", 0))  # files written before the lag existed priced lag 0


def build_candidates(heads: Mapping[str, Head], points: pd.DataFrame, features: np.ndarray,
                     n_quantiles: int = N_QUANTILES, ks: Sequence[int] = PROFILED_KS,
                     skip_levels: Sequence[float] = SKIP_LEVELS, lag: int = 0) -> Candidates:
    """τ from each ok head's scores on its training points (``points`` row j ↔ ``features[j]``):
    the quantile grid plus the skip-level grid (``points`` then needs on_length/off_length).
    ``lag``: the learned policies' decision lag, which the skip-level grid counts too."""
    check_points(points, features)
    rows = points.groupby("adapter").indices
    taus = {}
    for a, h in heads.items():
        if h.ok and a in rows:
            scores = h.scores(features[rows[a]])
            grid = [tau_candidates(scores, n_quantiles)]
            if len(skip_levels):
                grid.append(skip_level_taus(points.iloc[rows[a]], scores, skip_levels, lag))
            taus[a] = np.concatenate(grid)
    return Candidates(taus=taus, ks=tuple(ks), lag=lag)
