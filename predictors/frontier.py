"""Pareto frontiers, selection rules, the budget comparison and k tables (docs/design.md §3.5).

Inputs are the priced table of :func:`predictors.sweep.price` (one row per candidate:
adapter, policy, param, accuracy %, loss_points, skip ∈ [0, 1], n_requests, full_accuracy).

Rules (the same for learned τ and profiled k):
- ``P<p>`` (P25, P50, P75…): the smallest loss with skip ≥ p%; ties → larger skip.
- ``budget=<B>``: the largest skip whose loss *upper bound* ``loss_high`` is ≤ B points
  (:mod:`predictors.intervals`: exact, one-sided, at the sweep's confidence), so sampling
  error on a small validation set cannot pass a candidate that likely loses more than B;
  ties → smaller loss. A table without bounds (hand-made) is taken at its point estimates.
Remaining ties go to the smaller param. If no candidate qualifies, the rule falls back to
the never-release point (skip 0, loss 0: full LoRA, exact), flagged in ``fallback`` and ``note``.
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

POLICIES = ("learned", "profiled")
DEFAULT_RULES = ("P25", "P50", "P75")
SELECTION_COLUMNS = ("adapter", "policy", "rule", "param", "accuracy", "loss_points", "loss_low", "loss_high",
                     "skip", "full_accuracy", "fallback", "note")
_EPS = 1e-9  # skip/loss are ratios of counts; absorb float noise at rule thresholds


@dataclass(frozen=True)
class Rule:
    """A parsed selection rule: ``min_skip`` (P rules, fraction) or ``max_loss`` (budget, points)."""

    name: str
    min_skip: float | None = None
    max_loss: float | None = None


def parse_rule(rule: str) -> Rule:
    """Parse ``P<percent>`` or ``budget=<points>``; raise ValueError naming the accepted forms."""
    text = rule.strip()
    m = re.fullmatch(r"P(\d+(?:\.\d+)?)", text)
    if m and 0 < float(m.group(1)) <= 100:
        return Rule(text, min_skip=float(m.group(1)) / 100)
    m = re.fullmatch(r"budget=(\d+(?:\.\d+)?(?:e[+-]?\d+)?)", text)  # as resolve_rule writes it (:g)
    if m and math.isfinite(float(m.group(1))):
        return Rule(text, max_loss=float(m.group(1)))
    raise ValueError(f"selection rule {rule!r} is not understood: use 'P<percent>' (e.g. P50: smallest loss "
                     f"with skip ≥ 50%) or 'budget=<points>' (e.g. budget=1: largest skip with loss ≤ 1 point).")


def resolve_rule(rule: str, budget: float) -> str:
    """``export.rule`` as a selection rule: ``budget`` becomes ``budget=<B>``."""
    return f"budget={float(budget):g}" if rule == "budget" else rule


def pareto(priced: pd.DataFrame) -> pd.DataFrame:
    """Non-dominated candidates (maximise skip, minimise loss) per adapter and policy, by skip.

    A candidate is dropped if another has skip ≥ and loss ≤ with one strict; of identical
    (skip, loss) points the one with the smaller param is kept.
    """
    keep = []
    for _, g in priced.groupby(["adapter", "policy"], sort=True):
        best = math.inf
        for idx, loss in g.sort_values(["skip", "loss_points", "param"], ascending=[False, True, True])[
                "loss_points"].items():
            if loss < best:
                keep.append(idx)
                best = loss
    return priced.loc[keep].sort_values(["adapter", "policy", "skip"]).reset_index(drop=True)


def with_bounds(priced: pd.DataFrame) -> pd.DataFrame:
    """``priced`` with ``loss_low``/``loss_high``; a table without them gets its point losses."""
    if {"loss_low", "loss_high"} <= set(priced.columns):
        return priced
    return priced.assign(loss_low=priced["loss_points"], loss_high=priced["loss_points"])


def _pick(g: pd.DataFrame, rule: Rule) -> pd.DataFrame:
    if rule.min_skip is not None:
        q = g[g["skip"] >= rule.min_skip - _EPS]
        return q.sort_values(["loss_points", "skip", "param"], ascending=[True, False, True])
    q = g[g["loss_high"] <= rule.max_loss + _EPS]
    return q.sort_values(["skip", "loss_points", "param"], ascending=[False, True, True])


def select(priced: pd.DataFrame, rules: Sequence[str] = DEFAULT_RULES) -> pd.DataFrame:
    """One row per (adapter, policy, rule): the chosen candidate or the never-release fallback.

    ``priced`` may be the full priced table or its :func:`pareto` subset (same choices).
    Columns: :data:`SELECTION_COLUMNS` (param is NaN for a fallback).
    """
    return _select(priced, [parse_rule(r) for r in rules])


def _select(priced: pd.DataFrame, parsed: Sequence[Rule]) -> pd.DataFrame:
    rows = []
    for adapter, a in with_bounds(priced).groupby("adapter", sort=True):
        full = float(a["full_accuracy"].iloc[0])
        for policy in POLICIES:
            g = a[a["policy"] == policy]
            for rule in parsed:
                chosen = _pick(g, rule)
                if len(chosen):
                    c = chosen.iloc[0]
                    rows.append({"adapter": adapter, "policy": policy, "rule": rule.name, "param": c["param"],
                                 "accuracy": c["accuracy"], "loss_points": c["loss_points"],
                                 "loss_low": c["loss_low"], "loss_high": c["loss_high"], "skip": c["skip"],
                                 "full_accuracy": full, "fallback": False, "note": ""})
                    continue
                why = (f"no {policy} candidates" if g.empty else
                       f"no {policy} candidate with skip ≥ {100 * rule.min_skip:g}%" if rule.min_skip is not None
                       else f"no {policy} candidate with loss upper bound ≤ {rule.max_loss:g} points")
                rows.append({"adapter": adapter, "policy": policy, "rule": rule.name, "param": math.nan,
                             "accuracy": full, "loss_points": 0.0, "loss_low": 0.0, "loss_high": 0.0, "skip": 0.0,
                             "full_accuracy": full, "fallback": True, "note": f"{why}: never release (full LoRA)"})
    return pd.DataFrame(rows, columns=list(SELECTION_COLUMNS))


def compare_at_budget(priced: pd.DataFrame, budget: float) -> pd.DataFrame:
    """Learned vs profiled under the same loss budget, per adapter (the paper's Table 4).

    Columns: adapter, budget, learned_tau, learned_skip, learned_loss, learned_loss_high,
    profiled_k, profiled_skip, profiled_loss, profiled_loss_high, skip_ratio (learned skip /
    profiled skip; inf when only learned releases, NaN when neither does), note (fallback
    notes, ``; ``-joined).
    """
    if not budget >= 0:
        raise ValueError(f"budget must be ≥ 0 loss points, got {budget}.")
    sel = _select(priced, [Rule(f"budget={budget:g}", max_loss=float(budget))])
    rows = []
    for adapter, g in sel.groupby("adapter", sort=True):
        lr, pr = (g[g["policy"] == p].iloc[0] for p in POLICIES)
        ratio = (lr["skip"] / pr["skip"] if pr["skip"] > 0 else math.inf if lr["skip"] > 0 else math.nan)
        rows.append({"adapter": adapter, "budget": float(budget), "learned_tau": lr["param"],
                     "learned_skip": lr["skip"], "learned_loss": lr["loss_points"],
                     "learned_loss_high": lr["loss_high"],
                     "profiled_k": pd.NA if pr["fallback"] else int(pr["param"]),
                     "profiled_skip": pr["skip"], "profiled_loss": pr["loss_points"],
                     "profiled_loss_high": pr["loss_high"], "skip_ratio": ratio,
                     "note": "; ".join(n for n in (lr["note"], pr["note"]) if n)})
    out = pd.DataFrame(rows)
    if len(out):
        out["profiled_k"] = out["profiled_k"].astype("Int64")
    return out


def k_table(priced: pd.DataFrame) -> pd.DataFrame:
    """Per adapter and profiled k: accuracy (%), loss (points), skip (fraction)."""
    p = priced[priced["policy"] == "profiled"]
    out = p.assign(k=p["param"].astype(int))[["adapter", "k", "accuracy", "loss_points", "skip", "full_accuracy"]]
    return out.sort_values(["adapter", "k"]).reset_index(drop=True)


def frontier_summary(frontier: pd.DataFrame, adapter: str, policy: str) -> list[dict[str, float]]:
    """The frontier of one adapter and policy as plain JSON points (param, skip, loss_points)."""
    g = frontier[(frontier["adapter"] == adapter) & (frontier["policy"] == policy)]
    return [{"param": float(r.param), "skip": float(r.skip), "loss_points": float(r.loss_points)}
            for r in g.itertuples()]


def write_tables(out_dir: str | Path, tables: Mapping[str, pd.DataFrame]) -> dict[str, Path]:
    """Write each table as ``<out_dir>/<name>.csv`` (no index); return the paths by name."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, df in tables.items():
        paths[name] = out / f"{name}.csv"
        df.to_csv(paths[name], index=False)
    return paths
