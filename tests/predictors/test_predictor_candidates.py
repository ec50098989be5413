"""Candidates: float32 quantile and skip-level thresholds, k lists, JSON round trip."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from predictors.candidates import (PROFILED_KS, Candidates, build_candidates, skip_level_taus, tau_candidates,
                                   training_skip)
from predictors.heads import Head
from serve_bridge.steptrim import skip_fraction


def test_tau_quantiles_are_sorted_unique_float32_inside_range():
    s = np.random.default_rng(0).normal(size=1000).astype(np.float32)
    taus = tau_candidates(s, 32)
    assert taus.dtype == np.float32 and len(taus) == 32
    assert np.all(np.diff(taus) > 0) and s.min() < taus[0] and taus[-1] < s.max()
    assert np.isclose(taus[15], np.quantile(s, 16 / 33), atol=1e-6)
    assert len(tau_candidates(np.zeros(50), 32)) == 1  # deduplicated
    assert tau_candidates(np.empty(0), 32).size == 0


def test_build_candidates_skips_heads_that_are_not_ok(tmp_path):
    ok = Head("a", np.array([1.0, 0.0], np.float32), 0.5, 3, 4, 2, "ok")
    bad = Head("b", np.zeros(2, np.float32), 0.0, 3, 4, 0, "single_class", "msg")
    points = pd.DataFrame({"uid": list("wxyz") * 2, "adapter": ["a"] * 4 + ["b"] * 4, "t": 0, "y": 0})
    feats = np.arange(16, dtype=np.float32).reshape(8, 2)
    c = build_candidates({"a": ok, "b": bad}, points, feats, n_quantiles=3, ks=(0, 4), skip_levels=())
    assert set(c.taus) == {"a"}
    assert np.array_equal(c.taus["a"], tau_candidates(feats[:4, 0] + 0.5, 3))
    assert c.for_adapter("b") == [("profiled", 0.0), ("profiled", 4.0)]
    assert len(c.for_adapter("a")) == 3 + 2
    back = Candidates.load(c.save(tmp_path / "c.json"))
    assert back.ks == (0, 4) and np.array_equal(back.taus["a"], c.taus["a"])
    assert Candidates({}).ks == PROFILED_KS


def _trajectories(seed: int = 0, n: int = 40) -> tuple[pd.DataFrame, np.ndarray]:
    """Labeled points at T of ``n`` toy requests: (uid, adapter, t, on_length, off_length) + scores."""
    rng = np.random.default_rng(seed)
    rows, scores = [], []
    for i in range(n):
        on = int(rng.integers(2, 60))
        for t in (0, 1, 2, 3, 7, 15, 31):
            if t < on - 1:
                rows.append((f"u{i}", "a", t, on, int(t + 1 + rng.integers(1, 70))))
                scores.append(rng.normal(1.0 - t / 10, 1.0))
    df = pd.DataFrame(rows, columns=["uid", "adapter", "t", "on_length", "off_length"])
    return df.assign(y=0), np.asarray(scores, np.float32)


def _training_skip_by_hand(points: pd.DataFrame, scores: np.ndarray, tau: float) -> float:
    lengths, releases = [], []
    for _, g in points.assign(s=scores).groupby("uid"):
        g = g.sort_values("t")
        fired = g[g["s"] < np.float32(tau)]
        if len(fired):
            lengths.append(int(fired["off_length"].iloc[0]))
            releases.append(int(fired["t"].iloc[0]))
        else:
            lengths.append(int(g["on_length"].iloc[0]))
            releases.append(None)
    return skip_fraction(lengths, releases)


def test_training_skip_matches_steptrim_skip_fraction():
    points, scores = _trajectories()
    taus = np.array([-10, -1, 0, 0.5, 1, 2, 10], np.float32)
    got = training_skip(points, scores, taus)
    assert np.allclose(got, [_training_skip_by_hand(points, scores, t) for t in taus])
    assert got[0] == 0 and got[-1] > 0.9  # nothing fires / everything fires at its first point


def test_skip_level_taus_reach_each_level_with_the_smallest_tau():
    points, scores = _trajectories(1)
    levels = (0.01, 0.05, 0.25, 0.5, 0.75, 1.0)
    taus = skip_level_taus(points, scores, levels)
    assert taus.dtype == np.float32 and np.all(np.diff(taus) > 0)
    skips = training_skip(points, scores, taus)
    top = training_skip(points, scores, np.array([np.inf], np.float32))[0]
    for level in levels:
        reached = taus[skips >= min(level, top) - 1e-12]
        assert reached.size, level
        # one float32 step below the chosen τ no longer reaches the level
        tau = reached[0]
        below = np.nextafter(tau, np.float32(-np.inf))
        assert training_skip(points, scores, np.array([below]))[0] < min(level, top) - 1e-12 or level > top
    # the grid reaches the lowest non-zero training skip any τ gives, and the top
    every = training_skip(points, scores, np.nextafter(np.unique(scores), np.float32(np.inf)))
    assert skips.min() == every[every > 0].min() and skips.max() == top
    with pytest.raises(ValueError, match="skip levels"):
        skip_level_taus(points, scores, (0.0, 0.5))


def test_build_candidates_unions_quantiles_and_skip_levels():
    points, scores = _trajectories(2)
    feats = np.stack([scores, np.zeros_like(scores)], 1)
    head = Head("a", np.array([1.0, 0.0], np.float32), 0.0, 40, len(points), 5, "ok")
    both = build_candidates({"a": head}, points, feats, n_quantiles=4, ks=(0,), skip_levels=(0.02, 0.5))
    only_q = build_candidates({"a": head}, points, feats, n_quantiles=4, ks=(0,), skip_levels=())
    levels = skip_level_taus(points, scores, (0.02, 0.5))
    assert np.array_equal(only_q.taus["a"], tau_candidates(scores, 4))
    assert np.array_equal(both.taus["a"], np.unique(np.concatenate([only_q.taus["a"], levels])))
