"""Exact one-pass sweep: fork planner exactness, pricing vs naive StepTrim regeneration, I/O, cost."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from predictors.candidates import Candidates
from predictors.intervals import loss_bounds
from predictors.sweep import (ForkPlanner, RequestTree, SweepError, load_trees, price, release_points,
                              save_trees, sweep_cost)
from serve_bridge.steptrim import LearnedPolicy, ProfiledPolicy, StepTrim, release_point_learned


def _fired(planner: ForkPlanner, adapter: str, scores) -> set[int]:
    state = planner.new_state()
    return {t for t, s in enumerate(scores) if planner.should_fork(state, adapter, t, s)}


@pytest.mark.parametrize("lag", [0, 1, 3])
def test_fork_planner_fires_exactly_at_candidate_release_points(lag):
    """Forks land exactly on the candidates' release points: each k, and each τ's first firing
    forward plus the decision lag."""
    rng = np.random.default_rng(lag)
    for trial in range(300):
        L = int(rng.integers(1, 40))
        # few distinct values → many ties between scores and τ; occasional NaN / -inf
        scores = rng.integers(-4, 5, size=L).astype(np.float32) / 2
        scores[rng.random(L) < 0.05] = np.nan
        scores[rng.random(L) < 0.02] = -np.inf
        taus = np.unique(rng.integers(-5, 6, size=int(rng.integers(0, 8))).astype(np.float32) / 2)
        ks = tuple(int(k) for k in rng.choice([0, 1, 2, 4, 8, 16, 32, 64], size=int(rng.integers(0, 4))))
        planner = ForkPlanner({"a": taus}, ks, lag)
        expected = {release_point_learned(scores, float(tau), lag) for tau in taus} | set(ks)
        assert _fired(planner, "a", scores) == {r for r in expected if r is not None and r < L}, trial


def test_fork_planner_without_head_and_misuse():
    planner = ForkPlanner({"a": np.array([0.0], np.float32)}, (1, 3))
    assert _fired(planner, "b", [None] * 5) == {1, 3}  # no τ for b: only k
    state = planner.new_state()
    with pytest.raises(ValueError, match="expected t=0"):
        planner.should_fork(state, "a", 1, 0.5)
    with pytest.raises(ValueError, match="pass its head score"):
        planner.should_fork(state, "a", 0, None)


def _off(i: int, r: int) -> tuple[int, int]:
    """Deterministic toy OFF_r continuation of request i: (Q, length ≥ r+2)."""
    rng = np.random.default_rng([7, i, r])
    return int(rng.integers(0, 2)), r + 1 + int(rng.integers(1, 30))


def _toy_requests(n: int = 60):
    rng = np.random.default_rng(1)
    reqs = []
    for i in range(n):
        adapter = "a" if i % 3 else "b"  # b has no head
        L = int(rng.integers(1, 50))
        scores = np.cumsum(rng.normal(-0.1, 0.5, size=L)).astype(np.float32) if adapter == "a" else np.empty(0)
        reqs.append((f"u{i}", adapter, L, int(rng.random() < 0.7), scores))
    return reqs


def _one_pass(reqs, planner: ForkPlanner) -> list[RequestTree]:
    """The engine's job in miniature: one ON pass per request, forking where the planner says."""
    trees = []
    for i, (uid, adapter, L, q, scores) in enumerate(reqs):
        state, branches = planner.new_state(), {}
        for t in range(L):
            s_t = float(scores[t]) if scores.size else None
            if planner.should_fork(state, adapter, t, s_t) and t < L - 1:
                branches[t] = _off(i, t)
        trees.append(RequestTree(uid, adapter, L, q, scores, branches))
    return trees


def _naive(reqs, adapter: str, policy: str, param: float) -> tuple[float, float]:
    """Regenerate every request under one candidate with StepTrim (H=1, h_t = s_t); (accuracy %, skip)."""
    rows = [(i, r) for i, r in enumerate(reqs) if r[1] == adapter]
    pol = LearnedPolicy(torch.ones(1), 0.0, param) if policy == "learned" else ProfiledPolicy(int(param))
    st = StepTrim([pol], hidden_size=1)
    correct = skipped = total = 0
    for i, (_, _, L, q, scores) in rows:
        released, r = torch.zeros(1, dtype=torch.bool), None
        for t in range(L):
            h = torch.tensor([[float(scores[t])]]) if scores.size else torch.zeros(1, 1)
            released = st.step(torch.zeros(1, dtype=torch.long), torch.tensor([t]), released, h)
            if released.item():
                r = t
                break
        qq, n = _off(i, r) if r is not None and r < L - 1 else (q, L)
        correct += qq
        skipped += n - 1 - r if r is not None and r < L - 1 else 0
        total += n - 1
    return 100 * correct / len(rows), skipped / total


def test_price_equals_naive_regeneration_and_costs_less():
    reqs = _toy_requests()
    a_scores = np.concatenate([r[4] for r in reqs if r[1] == "a"])
    cands = Candidates({"a": np.quantile(a_scores, np.linspace(0.05, 0.95, 12)).astype(np.float32)},
                       ks=(0, 1, 2, 4, 8, 16, 32, 64))
    trees = _one_pass(reqs, ForkPlanner(cands.taus, cands.ks))
    priced = price(trees, cands)
    assert len(priced) == 12 + 8 + 8 and set(priced[priced.adapter == "b"].policy) == {"profiled"}
    for row in priced.itertuples():
        acc, skip = _naive(reqs, row.adapter, row.policy, row.param)
        assert row.accuracy == pytest.approx(acc) and row.skip == pytest.approx(skip)
        assert row.loss_points == pytest.approx(row.full_accuracy - acc)
        assert row.loss_points == pytest.approx(100 * (row.broken - row.fixed) / row.n_requests)
        assert (row.loss_low, row.loss_high) == loss_bounds(row.broken, row.fixed, row.n_requests)
    assert priced.skip.max() > 0.3 and priced.broken.max() > 0 and priced.fixed.max() > 0  # not degenerate
    wider = price(trees, cands, confidence=0.99)
    assert (wider.loss_high >= priced.loss_high).all() and (wider.loss_high > priced.loss_high).any()
    cost = sweep_cost(trees, cands)
    assert cost.tree_tokens < cost.naive_tokens / 2


def test_sweep_cost_by_hand():
    tree = RequestTree("u", "a", 10, 1, np.zeros(10, np.float32), {0: (0, 5), 3: (1, 12)})
    cands = Candidates({"a": np.array([0.5], np.float32)}, ks=(3, 20))
    # tree: ON 10 + (5-1) + (12-4) = 22; naive: ON 10 + τ=0.5 → r=0: 5, k=3: 12, k=20: ON 10
    assert tuple(sweep_cost([tree], cands)) == (22, 10 + 5 + 12 + 10)


def test_late_release_is_on_and_missing_fork_is_a_clear_error():
    tree = RequestTree("u7", "a", 5, 1, np.array([3, 3, 3, 3, -1], np.float32), {})
    late = price([tree], Candidates({"a": np.array([0.0], np.float32)}, ks=(4, 9)))
    assert (late.skip == 0).all() and (late.accuracy == 100).all()  # r = 4 = L−1 and r = 9: ON
    with pytest.raises(SweepError, match="release point 2 missing for request 'u7'.*did not fork there"):
        price([tree], Candidates({}, ks=(2,)))
    assert release_points([tree], "a", "learned", 0.0) == [4]


def test_tree_validation():
    with pytest.raises(SweepError, match="3 scores for 5 forwards"):
        RequestTree("u", "a", 5, 1, np.zeros(3), {})
    with pytest.raises(SweepError, match="branch r=2"):
        RequestTree("u", "a", 5, 1, np.zeros(5), {2: (1, 2)})


def test_parquet_round_trip(tmp_path):
    trees = _one_pass(_toy_requests(12), ForkPlanner({"a": np.array([-0.5, 0.0], np.float32)}, (0, 2)))
    trees.append(RequestTree("u0", "c", 3, 0, np.empty(0), {}))  # same uid, another adapter, no branch
    back = load_trees(save_trees(tmp_path / "trees.parquet", trees))
    assert len(back) == len(trees)
    for a, b in zip(trees, back):
        assert (a.uid, a.adapter, a.on_length, a.on_correct, a.branches) == \
            (b.uid, b.adapter, b.on_length, b.on_correct, b.branches)
        assert b.scores.dtype == np.float32 and np.array_equal(a.scores, b.scores)
