"""Exact confidence bounds on a candidate's validation accuracy loss (paired, per request).

On n validation requests a candidate *breaks* b of them (full LoRA right, candidate wrong)
and *fixes* f (full LoRA wrong, candidate right); its loss is 100·(b − f)/n points. The
expected loss is p_b − p_f, which lies between −p_f and p_b. Each bound is the exact
one-sided Clopper–Pearson bound of a binomial share at ``confidence``:

    high = 100 · U(b, n),   low = −100 · U(f, n),   U(x, n) = Beta⁻¹(confidence; x + 1, n − x),

so P(expected loss > high) ≤ 1 − confidence, and [low, high] covers it with probability at
least 2·confidence − 1 (90 % for the default 0.95). The bounds need no assumption beyond
independent requests, and they stay wide when nothing breaks: with b = 0, high =
100·(1 − (1 − confidence)^(1/n)), e.g. 2 points needs n ≥ 149 at 95 %.
"""
from __future__ import annotations

import numpy as np
from scipy.stats import beta

CONFIDENCE = 0.95


def share_upper(x: int | np.ndarray, n: int, confidence: float = CONFIDENCE) -> np.ndarray:
    """One-sided exact (Clopper–Pearson) upper bound on a binomial share, x of n observed."""
    if not 0.5 <= confidence < 1:
        raise ValueError(f"confidence must be in [0.5, 1), got {confidence} (sweep.confidence).")
    if n < 1:
        raise ValueError(f"need at least one request to bound a share, got n={n}")
    x = np.asarray(x, np.float64)
    return np.where(x >= n, 1.0, beta.ppf(confidence, x + 1, np.maximum(n - x, 1e-300)))


def loss_bounds(broken: int, fixed: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """(low, high) bounds on the expected loss in points; see the module docstring."""
    return -100.0 * float(share_upper(fixed, n, confidence)), 100.0 * float(share_upper(broken, n, confidence))


def requests_for_zero_break_bound(points: float, confidence: float = CONFIDENCE) -> int:
    """The fewest requests for which a candidate that breaks none has ``high`` ≤ ``points``."""
    if not 0 < points < 100:
        raise ValueError(f"points must be in (0, 100), got {points}")
    return int(np.ceil(np.log(1 - confidence) / np.log1p(-points / 100)))
