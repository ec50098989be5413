"""Frontier, selection rules (ties, fallbacks), budget comparison, k table, CSV writer."""
from __future__ import annotations

import math

import pandas as pd
import pytest

from predictors.frontier import compare_at_budget, frontier_summary, k_table, pareto, parse_rule, select, write_tables

LEARNED = {  # τ: (skip, loss)
    0.1: (0.10, 0.0), 0.2: (0.30, 0.5), 0.3: (0.30, 1.0), 0.4: (0.55, 2.0), 0.5: (0.50, 2.5),
    0.6: (0.80, 6.0), 0.7: (0.55, 2.0), 0.8: (0.35, 0.5), 0.9: (0.40, 1.0 + 1e-12),
}
PROFILED = {0: (0.9, 20.0), 4: (0.6, 5.0), 16: (0.2, 1.0), 64: (0.0, 0.0), 128: (0.0, 0.0)}


def _priced() -> pd.DataFrame:
    rows = [("a", "learned", p, s, l) for p, (s, l) in LEARNED.items()]
    rows += [(a, "profiled", float(k), s, l) for a in ("a", "b") for k, (s, l) in PROFILED.items()]
    df = pd.DataFrame(rows, columns=["adapter", "policy", "param", "skip", "loss_points"])
    return df.assign(accuracy=80.0 - df.loss_points, n_requests=100, full_accuracy=80.0)


def _choice(sel: pd.DataFrame, adapter: str, policy: str, rule: str) -> pd.Series:
    return sel[(sel.adapter == adapter) & (sel.policy == policy) & (sel.rule == rule)].iloc[0]


def test_pareto_keeps_exactly_the_non_dominated_points():
    front = pareto(_priced())
    assert list(front[(front.adapter == "a") & (front.policy == "learned")].param) == [0.1, 0.8, 0.9, 0.4, 0.6]
    assert list(front[(front.adapter == "a") & (front.policy == "profiled")].param) == [64.0, 16.0, 4.0, 0.0]
    assert frontier_summary(front, "a", "profiled")[0] == {"param": 64.0, "skip": 0.0, "loss_points": 0.0}


def test_rules_ties_and_fallbacks():
    rules = ["P25", "P50", "P75", "P95", "budget=1", "budget=0.25"]
    sel = select(_priced(), rules)
    assert len(sel) == 2 * 2 * len(rules)
    expect = {("learned", "P25"): 0.8,  # loss 0.5 at skip .30 and .35 → larger skip
              ("learned", "P50"): 0.4,  # identical (0.55, 2.0) for τ .4 and .7 → smaller param
              ("learned", "P75"): 0.6, ("learned", "budget=1"): 0.9,  # loss 1+1e-12 counts as ≤ 1
              ("learned", "budget=0.25"): 0.1,
              ("profiled", "P25"): 4.0, ("profiled", "P75"): 0.0, ("profiled", "budget=1"): 16.0,
              ("profiled", "budget=0.25"): 64.0}
    for (policy, rule), param in expect.items():
        c = _choice(sel, "a", policy, rule)
        assert c.param == param and not c.fallback and c.note == "", (policy, rule)
    fb = _choice(sel, "a", "learned", "P95")
    assert fb.fallback and math.isnan(fb.param) and (fb.skip, fb.loss_points, fb.accuracy) == (0, 0, 80)
    assert "skip ≥ 95%" in fb.note and "never release" in fb.note
    assert "no learned candidates" in _choice(sel, "b", "learned", "P25").note
    assert select(pareto(_priced()), rules).equals(sel)


def test_bad_rules_are_rejected():
    for bad in ("p50", "P0", "budget=-1", "budget", "best"):
        with pytest.raises(ValueError, match="P<percent>"):
            parse_rule(bad)
    with pytest.raises(ValueError, match="budget must be"):
        compare_at_budget(_priced(), -1)


def test_compare_at_budget_and_k_table(tmp_path):
    cmp = compare_at_budget(_priced(), 1.0)
    a = cmp[cmp.adapter == "a"].iloc[0]
    assert (a.learned_tau, a.learned_skip, a.profiled_k, a.profiled_skip, a.profiled_loss) == (0.9, 0.4, 16, 0.2, 1.0)
    b = cmp[cmp.adapter == "b"].iloc[0]
    assert math.isnan(b.learned_tau) and "no learned candidates" in b.note
    kt = k_table(_priced())
    assert list(kt[kt.adapter == "a"].k) == [0, 4, 16, 64, 128] and kt.k.dtype.kind == "i"
    paths = write_tables(tmp_path / "tables", {"k_table": kt, "budget": cmp})
    back = pd.read_csv(paths["k_table"])
    assert list(back.columns) == list(kt.columns) and len(back) == len(kt)
    assert paths["budget"].read_text().startswith("adapter,budget,learned_tau")


def test_budget_rule_selects_on_the_loss_upper_bound():
    """A candidate whose point loss is within budget but whose bound is not is passed over; P rules
    keep using the point estimate; the comparison reports both bounds and the skip ratio."""
    df = _priced()
    df = df.assign(loss_low=df.loss_points - 1, loss_high=df.loss_points + 0.6)
    sel = select(df, ["budget=1", "P50"])
    # point losses ≤ 1: τ .9 (0.40 skip); bounds ≤ 1: only τ .1 (0.0 + 0.6) → skip 0.10
    assert _choice(sel, "a", "learned", "budget=1").param == 0.1
    assert _choice(sel, "a", "learned", "budget=1").loss_high == pytest.approx(0.6)
    assert _choice(sel, "a", "learned", "P50").param == 0.4  # unchanged by the bounds
    assert _choice(sel, "a", "profiled", "budget=1").param == 64.0  # k=16's bound is 1.6
    cmp = compare_at_budget(df, 1.0).set_index("adapter")
    assert cmp.loc["a", "learned_loss_high"] == pytest.approx(0.6) and cmp.loc["a", "profiled_k"] == 64
    assert cmp.loc["a", "skip_ratio"] == math.inf  # learned releases, profiled cannot
    plain = compare_at_budget(_priced(), 1.0).set_index("adapter")  # no bounds: point estimates
    assert plain.loc["a", "skip_ratio"] == pytest.approx(0.4 / 0.2)
    assert plain.loc["b", "skip_ratio"] == 0.0  # b: no learned candidates, profiled k=16 skips 20%
