"""Heads: Eq. 13 exactly (vs direct float64 minimisation), orientation, single class, persistence."""
from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from predictors.heads import LAMBDA, fit_head, fit_heads, load_heads, save_heads


def _requests(seed: int, n_req: int = 50, hidden: int = 10, offset: float = 4.0):
    """Random points with uneven |T_i| and a large feature offset (exercises centering)."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 9, size=n_req)
    rid = np.repeat([f"r{i}" for i in range(n_req)], sizes)
    x = rng.normal(size=(len(rid), hidden)) * rng.uniform(0.5, 3.0, size=hidden) + offset
    w_true = rng.normal(size=hidden)
    y = (rng.random(len(rid)) < 1 / (1 + np.exp(-((x - offset) @ w_true - 0.5)))).astype(int)
    return x, y, rid


def _eq13_torch(x: np.ndarray, y: np.ndarray, rid: np.ndarray, lam: float) -> tuple[np.ndarray, float]:
    """argmin (1/N) Σ_i (1/|T_i|) Σ_t BCE + λ/2 ‖w‖² with torch LBFGS in float64."""
    _, inv, counts = np.unique(rid, return_inverse=True, return_counts=True)
    xt, yt = torch.tensor(x), torch.tensor(y, dtype=torch.float64)
    sw = torch.tensor(1.0 / counts[inv])
    w = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros((), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=5000, tolerance_grad=1e-14, tolerance_change=1e-16,
                            history_size=50, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        bce = torch.nn.functional.binary_cross_entropy_with_logits(xt @ w + b, yt, reduction="none")
        loss = (sw * bce).sum() / len(counts) + lam / 2 * (w @ w)
        loss.backward()
        return loss

    for _ in range(3):
        opt.step(closure)
    return w.detach().numpy(), float(b.detach())


def test_matches_direct_minimisation_of_eq13():
    for seed in (0, 1):
        x, y, rid = _requests(seed)
        head = fit_head("a", x, y, rid)
        w_ref, b_ref = _eq13_torch(x, y, rid, LAMBDA)
        assert head.status == "ok" and head.weight.dtype == np.float32
        assert np.linalg.norm(head.weight - w_ref) / np.linalg.norm(w_ref) < 1e-4
        assert abs(head.bias - b_ref) / max(1.0, abs(b_ref)) < 1e-4
        assert (head.n_requests, head.n_points, head.positives) == (50, len(y), int(y.sum()))


def test_the_solver_runs_with_one_blas_thread_whatever_the_machine(monkeypatch):
    from sklearn.linear_model import LogisticRegression
    from threadpoolctl import threadpool_info, threadpool_limits

    def blas_threads() -> set[int]:
        return {p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"}

    seen, fit = [], LogisticRegression.fit

    def recording(self, *args, **kwargs):
        seen.append(blas_threads())
        return fit(self, *args, **kwargs)

    monkeypatch.setattr(LogisticRegression, "fit", recording)
    x, y, rid = _requests(0)
    with threadpool_limits(limits=2):  # as on a machine with more cores and no OMP_NUM_THREADS
        assert blas_threads() == {2}
        head = fit_head("a", x, y, rid)
        assert blas_threads() == {2}  # restored
    assert head.ok and seen == [{1}]


def test_per_request_weighting_matters():
    """Duplicating one request's points must not change the fit (1/|T_i| weights), unlike plain BCE."""
    x, y, rid = _requests(2)
    first = rid == "r0"
    x2 = np.concatenate([x, np.repeat(x[first], 5, axis=0)])
    y2 = np.concatenate([y, np.repeat(y[first], 5)])
    head, dup = fit_head("a", x, y, rid), fit_head("a", x2, y2, np.concatenate([rid, np.repeat(rid[first], 5)]))
    assert np.allclose(head.weight, dup.weight, rtol=1e-4, atol=1e-6)
    assert abs(head.bias - dup.bias) < 1e-4


def test_score_is_high_for_risky_points():
    rng = np.random.default_rng(3)
    y = rng.integers(0, 2, size=400)
    x = rng.normal(size=(400, 6)) + 2.0 * y[:, None]  # risky points sit at larger h
    head = fit_head("a", x, y, [f"r{i // 4}" for i in range(400)])
    s = head.scores(x)
    assert s[y == 1].mean() > s[y == 0].mean() + 1.0
    policy = head.policy(tau=0.0)  # release where P(risky) < 1/2
    assert float(policy.score(torch.from_numpy(x[y == 0].astype(np.float32))).mean()) < 0.0


def test_single_class_gives_never_release_with_message():
    x = np.ones((7, 4))
    head = fit_head("arith-a", x, np.zeros(7, int), ["u1"] * 3 + ["u2"] * 4)
    assert head.status == "single_class" and not head.ok and head.policy(0.0) is None
    for part in ("arith-a", "7 labeled points", "2 requests", "class 0", "never-release"):
        assert part in head.message
    assert fit_head("b", x, np.ones(7, int), ["u"] * 7).message.count("class 1") == 1
    assert fit_head("c", np.empty((0, 4)), np.empty(0, int), []).status == "single_class"


def test_fit_heads_groups_by_adapter_and_persists(tmp_path):
    x, y, rid = _requests(4, n_req=20, hidden=5)
    points = pd.DataFrame({"uid": rid, "adapter": "a", "t": 0, "y": y})
    points = pd.concat([points, points.assign(adapter="b", y=0)], ignore_index=True)
    heads = fit_heads(points, np.concatenate([x, x]))
    assert heads["a"].ok and heads["b"].status == "single_class"
    assert np.array_equal(heads["a"].weight, fit_head("a", x, y, rid).weight)
    back = load_heads(save_heads(tmp_path / "heads.safetensors", heads))
    for name in heads:
        assert np.array_equal(back[name].weight, heads[name].weight)
        assert (back[name].bias, back[name].status, back[name].message) == \
            (heads[name].bias, heads[name].status, heads[name].message)
