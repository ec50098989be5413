"""Exact one-pass sweep: price every candidate from one full-LoRA pass plus forks (docs/design.md §3.5).

Under greedy decoding a request released at r generates exactly the full-LoRA (ON)
tokens up to forward r, then the OFF_r continuation. So one ON pass that records the head
scores s_t, plus one OFF continuation per *distinct* (request, release point) that some
candidate reaches, prices all candidates at once. The engine records that as a
:class:`RequestTree`; :class:`ForkPlanner` tells it, online, where to fork; :func:`price`
turns trees into accuracy / loss / skip per candidate. Release points and skip fractions
come from :mod:`serve_bridge.steptrim` only.

Outcome of a candidate with release point r on a request of ON length L: r is None or
r ≥ L−1 → the ON response (nothing skipped: forward L−1 is the last one); otherwise the
OFF_r branch (its correctness and length; decode forwards after r skip the adapter).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from predictors.candidates import Candidates
from predictors.intervals import CONFIDENCE, loss_bounds
from serve_bridge.steptrim import release_point_learned, release_point_profiled, skip_fraction

TREE_SCHEMA = pa.schema([
    ("adapter", pa.string()), ("uid", pa.string()), ("on_length", pa.int32()), ("on_correct", pa.int8()),
    ("scores", pa.list_(pa.float32())), ("r", pa.int32()), ("off_correct", pa.int8()), ("off_length", pa.int32()),
])
PRICE_COLUMNS = ("adapter", "policy", "param", "accuracy", "loss_points", "skip", "n_requests", "full_accuracy",
                 "broken", "fixed", "loss_low", "loss_high")


class SweepError(ValueError):
    """Sweep inputs that cannot price a candidate (missing fork, malformed tree...)."""


@dataclass
class RequestTree:
    """One validation request's release tree.

    on_length: L, tokens of the full-LoRA response (EOS included when produced); forwards
        0 … L−1. on_correct: Q(ON) ∈ {0, 1}.
    scores: s_t for t = 0 … L−1 along the ON trajectory, float32 (empty if the adapter
        has no head).
    branches: r → (Q(OFF_r), length of the OFF_r response in tokens) for every forked r;
        OFF_r shares the first r+1 tokens with ON.
    """

    uid: str
    adapter: str
    on_length: int
    on_correct: int
    scores: np.ndarray
    branches: dict[int, tuple[int, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.scores = np.asarray(self.scores, np.float32)
        where = f"request tree '{self.uid}' (adapter '{self.adapter}')"
        if self.on_length < 1 or self.on_correct not in (0, 1):
            raise SweepError(f"{where}: on_length must be ≥ 1 and on_correct 0/1, got "
                             f"{self.on_length}, {self.on_correct}.")
        if self.scores.size not in (0, self.on_length):
            raise SweepError(f"{where}: {self.scores.size} scores for {self.on_length} forwards; the engine "
                             f"must record s_t at every forward t = 0 … L−1 (or none without a head).")
        for r, (q, n) in self.branches.items():
            if r < 0 or q not in (0, 1) or n < r + 1:
                raise SweepError(f"{where}: branch r={r} has Q={q}, length={n}; need r ≥ 0, Q 0/1 and "
                                 f"length ≥ r+1 (the first r+1 tokens are shared with ON).")


def save_trees(path: str | Path, trees: Sequence[RequestTree]) -> Path:
    """Write trees to parquet: per request one ON row (r null, with scores) and one row per branch."""
    rows = []
    for t in trees:
        on = {"adapter": t.adapter, "uid": t.uid, "on_length": t.on_length, "on_correct": t.on_correct}
        rows.append(on | {"scores": t.scores.tolist(), "r": None, "off_correct": None, "off_length": None})
        rows += [on | {"scores": None, "r": r, "off_correct": q, "off_length": n}
                 for r, (q, n) in sorted(t.branches.items())]
    pq.write_table(pa.Table.from_pylist(rows, schema=TREE_SCHEMA), str(path))
    return Path(path)


def load_trees(path: str | Path) -> list[RequestTree]:
    """Read trees written by :func:`save_trees`, in their original order."""
    table = pq.read_table(str(path))
    missing = [n for n in TREE_SCHEMA.names if n not in table.column_names]
    if missing:
        raise SweepError(f"{path}: columns {missing} missing; not a tree file (re-run the sweep pass).")
    on: dict[tuple[str, str], dict] = {}
    branches: dict[tuple[str, str], dict[int, tuple[int, int]]] = {}
    for row in table.select(TREE_SCHEMA.names).to_pylist():
        key = (row["adapter"], row["uid"])
        if row["r"] is None:
            if key in on:
                raise SweepError(f"{path}: request '{key[1]}' (adapter '{key[0]}') has two ON rows; re-run the pass.")
            on[key] = row
        elif row["r"] in branches.setdefault(key, {}):
            raise SweepError(f"{path}: request '{key[1]}' has branch r={row['r']} twice; re-run the pass.")
        else:
            branches[key][row["r"]] = (row["off_correct"], row["off_length"])
    orphans = sorted(set(branches) - set(on))
    if orphans:
        raise SweepError(f"{path}: branches of request '{orphans[0][1]}' have no ON row; re-run the pass.")
    return [RequestTree(uid=u, adapter=a, on_length=row["on_length"], on_correct=row["on_correct"],
                        scores=np.asarray(row["scores"], np.float32), branches=branches.get((a, u), {}))
            for (a, u), row in on.items()]


def release_point(tree: RequestTree, policy: str, param: float, lag: int = 0) -> int | None:
    """r of a candidate on a request (steptrim semantics; ``lag``: the learned policies'
    decision lag, :attr:`predictors.candidates.Candidates.lag`); None = never released."""
    if policy == "profiled":
        return release_point_profiled(int(param))
    if policy != "learned":
        raise SweepError(f"unknown policy {policy!r}; use 'learned' or 'profiled'.")
    if tree.scores.size == 0:
        raise SweepError(f"request '{tree.uid}' (adapter '{tree.adapter}') has no scores but a τ candidate "
                         f"exists: run the sweep pass with the adapter's head loaded.")
    return release_point_learned(tree.scores, param, lag)


def outcome(tree: RequestTree, r: int | None) -> tuple[int, int, int | None]:
    """(correct, length, effective release) of releasing ``tree`` at r (None: the ON response)."""
    if r is None or r >= tree.on_length - 1:
        return tree.on_correct, tree.on_length, None
    if r not in tree.branches:
        raise SweepError(f"release point {r} missing for request '{tree.uid}' (adapter '{tree.adapter}') — the "
                         f"sweep pass did not fork there. Re-run the pass with a ForkPlanner built from the "
                         f"same candidates.")
    q, n = tree.branches[r]
    return q, n, r


def _by_adapter(trees: Sequence[RequestTree]) -> dict[str, list[RequestTree]]:
    groups: dict[str, list[RequestTree]] = {}
    seen = set()
    for t in trees:
        if (t.adapter, t.uid) in seen:
            raise SweepError(f"request '{t.uid}' (adapter '{t.adapter}') appears twice; pass each tree once.")
        seen.add((t.adapter, t.uid))
        groups.setdefault(t.adapter, []).append(t)
    return dict(sorted(groups.items()))


def price(trees: Sequence[RequestTree], candidates: Candidates, confidence: float = CONFIDENCE) -> pd.DataFrame:
    """Accuracy (%), loss vs full LoRA (points), skip fraction (0–1) of every candidate, per adapter.

    Columns: :data:`PRICE_COLUMNS`; ``param`` is τ (learned) or k (profiled);
    ``full_accuracy`` is the adapter's full-LoRA accuracy (%); ``broken`` / ``fixed`` count
    the requests the candidate turns right→wrong / wrong→right; ``loss_low`` / ``loss_high``
    are exact bounds on the expected loss at ``confidence`` (:mod:`predictors.intervals`).
    """
    rows = []
    for adapter, group in _by_adapter(trees).items():
        n, full = len(group), sum(t.on_correct for t in group)
        for policy, param in candidates.for_adapter(adapter):
            outs = [outcome(t, release_point(t, policy, param, candidates.lag)) for t in group]
            correct = sum(q for q, _, _ in outs)
            broken = sum(t.on_correct and not q for t, (q, _, _) in zip(group, outs))
            fixed = sum(q and not t.on_correct for t, (q, _, _) in zip(group, outs))
            low, high = loss_bounds(broken, fixed, n, confidence)
            rows.append({"adapter": adapter, "policy": policy, "param": param, "accuracy": 100 * correct / n,
                         "loss_points": 100 * (full - correct) / n,
                         "skip": skip_fraction([m for _, m, _ in outs], [r for _, _, r in outs]),
                         "n_requests": n, "full_accuracy": 100 * full / n, "broken": broken, "fixed": fixed,
                         "loss_low": low, "loss_high": high})
    return pd.DataFrame(rows, columns=list(PRICE_COLUMNS))


def release_points(trees: Sequence[RequestTree], adapter: str, policy: str, param: float,
                   lag: int = 0) -> list[int | None]:
    """Per-request release point r of one candidate on ``adapter``'s requests (None = never)."""
    return [release_point(t, policy, param, lag) for t in trees if t.adapter == adapter]


class SweepCost(NamedTuple):
    """Generated tokens: the trees (ON + branch tokens past each fork) vs naive regeneration
    (the full-LoRA reference pass plus one full generation per candidate and request)."""

    tree_tokens: int
    naive_tokens: int


def sweep_cost(trees: Sequence[RequestTree], candidates: Candidates) -> SweepCost:
    """Token cost of the one-pass sweep vs regenerating every request for every candidate."""
    tree_tokens = sum(t.on_length + sum(n - (r + 1) for r, (_, n) in t.branches.items()) for t in trees)
    naive = sum(t.on_length for t in trees)
    for adapter, group in _by_adapter(trees).items():
        for policy, param in candidates.for_adapter(adapter):
            naive += sum(outcome(t, release_point(t, policy, param, candidates.lag))[1] for t in group)
    return SweepCost(tree_tokens, naive)


@dataclass
class ForkState:
    """Per-request planner state: the minimum score over forwards seen so far, the next t, and
    whether some τ first fired at each of the last ``lag`` forwards (oldest first)."""

    min_score: float = math.inf
    next_t: int = 0
    fired: list[bool] = field(default_factory=list)


class ForkPlanner:
    """Online fork decisions for the single full-LoRA pass.

    ``should_fork`` is True at forward t iff t is the release point of at least one
    candidate: t ∈ ks, or some τ of the adapter has s_u < τ ≤ min_{t'<u} s_{t'} at u = t − lag
    (the first score below τ, plus the learned policies' decision lag; min over no forwards =
    +inf). NaN scores never release (as in steptrim). The engine forks only while the ON response
    continues past t (r ≥ L−1 is priced as ON).
    """

    def __init__(self, taus: Mapping[str, np.ndarray], ks: Sequence[int], lag: int = 0) -> None:
        # float32 τ held in float64: exact, and comparisons with float(s_t) match steptrim's.
        self._taus = {a: np.unique(np.asarray(v, np.float32)).astype(np.float64) for a, v in taus.items()}
        self._ks = frozenset(int(k) for k in ks)
        self._lag = int(lag)

    def new_state(self) -> ForkState:
        return ForkState()

    def should_fork(self, state: ForkState, adapter: str, t: int, s_t: float | None) -> bool:
        """Decide after forward t of a request (call for t = 0, 1, 2, … in order).

        s_t: the float32 head score of forward t (as stored in the tree); may be None only
        when ``adapter`` has no τ candidates.
        """
        if t != state.next_t:
            raise ValueError(f"should_fork got t={t}, expected t={state.next_t}: call it once per forward, in order.")
        state.next_t += 1
        learned = False
        taus = self._taus.get(adapter)
        if taus is not None and taus.size:
            if s_t is None:
                raise ValueError(f"adapter '{adapter}' has τ candidates: pass its head score s_t at t={t}.")
            s = float(np.float32(s_t))  # the value the tree stores and the sweep prices
            i = int(np.searchsorted(taus, s, side="right"))  # first τ > s
            learned = i < taus.size and taus[i] <= state.min_score
            if s < state.min_score:  # NaN never lowers the minimum
                state.min_score = s
        state.fired.append(learned)
        fired = state.fired.pop(0) if len(state.fired) > self._lag else False  # some τ first fired at t − lag
        return t in self._ks or fired
