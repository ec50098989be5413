"""Release-risk heads: one L2-regularised linear logistic head per adapter (docs/design.md §3.4, Eq. 13).

Orientation: a labeled point (i, t) has y = 1 iff releasing after forward t is *risky*
(Q(ON) = 1 and Q(OFF_t) = 0). The head's score s = wᵀh + b is the logit of P(risky | h),
so it is HIGH where releasing is risky; StepTrim releases at the first t with s_t < τ
(:mod:`serve_bridge.steptrim`).

Objective (Eq. 13), N requests, T_i the labeled points of request i, λ = 0.1:

    J(w, b) = (1/N) Σ_i (1/|T_i|) Σ_{t∈T_i} BCE(wᵀh_{i,t} + b, y_{i,t}) + (λ/2)‖w‖²,

bias unregularized. sklearn's L2 logistic regression (lbfgs, ``l1_ratio=0``) minimises

    S(w, b) = C Σ_j sw_j BCE_j + ½‖w‖²        (intercept unpenalized)

(internally it minimises S / (C Σ_j sw_j), the same minimiser). With sw_j = 1/|T_i| for
every point j of request i, Σ_j sw_j BCE_j = Σ_i (1/|T_i|) Σ_t BCE_{i,t}, hence

    J = (1/N) Σ_j sw_j BCE_j + (λ/2)‖w‖² = λ · [ (1/(λN)) Σ_j sw_j BCE_j + ½‖w‖² ],

which is λ·S for C = 1/(λN). λ > 0 is a constant factor, so argmin J = argmin S: the
docs/design.md's C = 1/(λN) is exact (no missing factor). ``tests/predictors/test_predictor_heads.py``
checks it against direct float64 minimisation of J.

Features are centered before fitting and the centering is folded back into the bias
(b = b' − wᵀμ). This is exact: w and its penalty are unchanged and b is unpenalized; it
only conditions the intercept. Nothing is scaled, so the exported head acts on raw h.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from serve_bridge.bundle import head_tensor_names
from serve_bridge.steptrim import LearnedPolicy

LAMBDA = 0.1
POINT_COLUMNS = ("uid", "adapter", "t", "y")  # the labeled-points table; row j ↔ features[j]


@dataclass(frozen=True)
class Head:
    """A fitted head (or a never-release placeholder when the labels have one class).

    weight: float32 [H]; bias: a float32-representable float. Score s = weightᵀh + bias = logit P(risky).
    n_requests / n_points / positives: N, Σ|T_i| and the number of y = 1 points.
    status: ``ok``, or ``single_class`` (weight is zero and :meth:`policy` returns None:
    the adapter is never released); message explains a non-ok status.
    """

    adapter: str
    weight: np.ndarray
    bias: float
    n_requests: int
    n_points: int
    positives: int
    status: str
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def scores(self, features: np.ndarray) -> np.ndarray:
        """s = hᵀw + b for features [n, H], computed in float32 like the runtime; float32 [n]."""
        return (np.asarray(features, np.float32) @ self.weight + np.float32(self.bias)).astype(np.float32)

    def policy(self, tau: float, lag: int = 0) -> LearnedPolicy | None:
        """The StepTrim policy releasing ``lag`` forwards after the first s_t < tau; None (never
        release) unless status is ok."""
        return LearnedPolicy(torch.from_numpy(self.weight.copy()), self.bias, float(tau), lag) if self.ok else None


def fit_head(adapter: str, features: np.ndarray, labels: np.ndarray, request_ids: Sequence[str],
             lam: float = LAMBDA) -> Head:
    """Fit Eq. 13 for one adapter.

    features [n, H] (h_{i,t}), labels [n] in {0, 1} (1 = risky), request_ids [n] (i of each
    point; |T_i| is its count). A label set with a single class (or no points) returns a
    ``single_class`` head with a message instead of raising, so the pipeline continues.

    The solver runs with one BLAS thread whatever the machine: its products are small (n points ×
    H), a BLAS thread pool costs more than it gives there (four fits of 190 points × 3072: 1.8 s
    with one thread against 39 s with two, 2-core CPU, 2026-12-06), and the head then does not
    depend on the machine's core count.
    """
    x = np.asarray(features, dtype=np.float64)
    y = np.asarray(labels)
    rid = np.asarray(request_ids)
    if x.ndim != 2 or y.shape != (len(x),) or rid.shape != (len(x),):
        raise ValueError(f"adapter '{adapter}': features {x.shape}, labels {y.shape} and request_ids "
                         f"{rid.shape} must be [n, H], [n], [n] for the same n labeled points.")
    if not np.isin(y, (0, 1)).all():
        raise ValueError(f"adapter '{adapter}': labels must be 0/1 (1 = risky release), got "
                         f"{sorted(set(np.unique(y).tolist()) - {0, 1})[:5]}.")
    if not np.isfinite(x).all():
        raise ValueError(f"adapter '{adapter}': features hold NaN/inf; check the labeling stage's h_t dump.")
    y = y.astype(np.int64)
    _, inverse, counts = np.unique(rid, return_inverse=True, return_counts=True)
    n_req, n, pos = len(counts), len(y), int(y.sum())
    if pos in (0, n):
        found = ("has no labeled points" if n == 0 else
                 f"has {n} labeled points from {n_req} requests, all of class {int(y[0])} "
                 f"({'every release risky' if pos else 'no risky release'})")
        message = (f"adapter '{adapter}' {found}; a head needs both classes, so this adapter gets a "
                   f"never-release policy (full LoRA). Label more requests or release points to get both.")
        return Head(adapter, np.zeros(x.shape[1], np.float32), 0.0, n_req, n, pos, "single_class", message)
    from sklearn.linear_model import LogisticRegression  # ~1 s to import: only where a head is fitted
    from threadpoolctl import threadpool_limits  # scikit-learn's own dependency

    mu = x.mean(axis=0)
    clf = LogisticRegression(C=1.0 / (lam * n_req), l1_ratio=0, solver="lbfgs", tol=1e-10, max_iter=10_000)
    with threadpool_limits(limits=1, user_api="blas"):
        clf.fit(x - mu, y, sample_weight=1.0 / counts[inverse])
    w = clf.coef_[0]  # coef_ belongs to classes_[1] = 1 (risky): s is the logit of P(risky)
    bias = float(np.float32(clf.intercept_[0] - w @ mu))  # float32-exact: every consumer scores alike
    return Head(adapter, w.astype(np.float32), bias, n_req, n, pos, "ok")


def check_points(points: pd.DataFrame, features: np.ndarray) -> None:
    """Raise ValueError unless ``points`` has the point columns and one feature row per point."""
    missing = [c for c in POINT_COLUMNS if c not in points.columns]
    if missing or len(points) != len(features):
        raise ValueError(f"labeled points: need columns {POINT_COLUMNS} (missing {missing}) and one feature "
                         f"row per point ({len(points)} points, {len(features)} feature rows); re-run labeling.")


def fit_heads(points: pd.DataFrame, features: np.ndarray, lam: float = LAMBDA) -> dict[str, Head]:
    """One head per adapter of a labeled-points table (columns uid, adapter, t, y; row j ↔ features[j])."""
    check_points(points, features)
    heads = {}
    for adapter, rows in points.groupby("adapter", sort=True).indices.items():
        sub = points.iloc[rows]
        heads[adapter] = fit_head(adapter, features[rows], sub["y"].to_numpy(), sub["uid"].to_numpy(), lam)
    return heads


def save_heads(path: str | Path, heads: Mapping[str, Head]) -> Path:
    """Write heads to one safetensors file (tensors named as in the bundle, the rest as metadata)."""
    tensors, meta = {}, {}
    for name, h in heads.items():
        w_name, b_name = head_tensor_names(name)
        tensors[w_name], tensors[b_name] = h.weight, np.array(h.bias, np.float32)
        meta[name] = {k: v for k, v in asdict(h).items() if k not in ("weight", "bias")}
    save_file(tensors, str(path), metadata={"heads": json.dumps(meta)})
    return Path(path)


def load_heads(path: str | Path) -> dict[str, Head]:
    """Read heads written by :func:`save_heads`."""
    with safe_open(str(path), "numpy") as f:
        meta = json.loads((f.metadata() or {}).get("heads", "{}"))
    tensors = load_file(str(path))
    heads = {}
    for name, m in meta.items():
        w_name, b_name = head_tensor_names(name)
        heads[name] = Head(weight=tensors[w_name], bias=float(tensors[b_name]), **m)
    return heads
