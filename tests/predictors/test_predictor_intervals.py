"""Exact loss bounds: Clopper–Pearson against the binomial tail they invert, and their coverage."""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import binom

from predictors.intervals import loss_bounds, requests_for_zero_break_bound, share_upper


@pytest.mark.parametrize("n", [1, 7, 48, 240])
def test_upper_bound_inverts_the_binomial_tail(n):
    for x in sorted({0, 1, n // 3, n - 1} - {n}):
        u = float(share_upper(x, n, 0.95))
        assert x / n < u < 1
        # U is the p at which seeing ≤ x of n has probability exactly 5 %.
        assert math.isclose(binom.cdf(x, n, u), 0.05, rel_tol=1e-6)
    assert float(share_upper(n, n)) == 1.0


def test_zero_breaks_closed_form_and_sizing():
    assert math.isclose(loss_bounds(0, 0, 149)[1], 100 * (1 - 0.05 ** (1 / 149)))
    assert requests_for_zero_break_bound(2.0) == 149
    assert loss_bounds(0, 0, 149)[1] <= 2.0 < loss_bounds(0, 0, 148)[1]
    low, high = loss_bounds(3, 1, 100)
    assert low < 0 < (3 - 1) < high  # the interval holds the observed loss, in points
    with pytest.raises(ValueError, match="confidence"):
        share_upper(0, 10, 0.3)


def test_upper_bound_covers_the_true_loss_at_its_level():
    rng = np.random.default_rng(0)
    p_break, p_fix, n = 0.03, 0.01, 120
    true_loss = 100 * (p_break - p_fix)
    draws = rng.multinomial(n, [p_break, p_fix, 1 - p_break - p_fix], size=4000)
    highs = np.array([loss_bounds(int(b), int(f), n)[1] for b, f, _ in draws])
    lows = np.array([loss_bounds(int(b), int(f), n)[0] for b, f, _ in draws])
    assert np.mean(highs >= true_loss) >= 0.95
    assert np.mean((lows <= true_loss) & (true_loss <= highs)) >= 0.90
