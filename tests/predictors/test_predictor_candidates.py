"""Candidates: float32 quantile thresholds, k lists, JSON round trip."""
from __future__ import annotations

import numpy as np
import pandas as pd

from predictors.candidates import PROFILED_KS, Candidates, build_candidates, tau_candidates
from predictors.heads import Head


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
    c = build_candidates({"a": ok, "b": bad}, points, feats, n_quantiles=3, ks=(0, 4))
    assert set(c.taus) == {"a"}
    assert np.array_equal(c.taus["a"], tau_candidates(feats[:4, 0] + 0.5, 3))
    assert c.for_adapter("b") == [("profiled", 0.0), ("profiled", 4.0)]
    assert len(c.for_adapter("a")) == 3 + 2
    back = Candidates.load(c.save(tmp_path / "c.json"))
    assert back.ks == (0, 4) and np.array_equal(back.taus["a"], c.taus["a"])
    assert Candidates({}).ks == PROFILED_KS
