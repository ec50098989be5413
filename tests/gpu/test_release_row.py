"""The learned-release test's rule for two engines' release points (tests/gpu/real_engines.py), on CPU."""
from __future__ import annotations

import math
import random

from tests.gpu.real_engines import MARGIN, MIN_AGREEMENT, release_row

TAU = -1.0
STOP = 2


def _case(n: int, seed: int):
    rng = random.Random(seed)
    fulls = [[rng.randrange(3, 100) for _ in range(30)] for _ in range(n)]
    scores = [[rng.uniform(-4.0, 2.0) for _ in range(30)] for _ in range(n)]
    releases = [rng.randrange(1, 29) for _ in range(n)]
    return fulls, scores, releases


def _row(releases_b, fulls_b, fulls, scores, releases, scored=None, lag=0):
    notes: list[str] = []
    _, ok, detail = release_row("x", ("a", "b"), (releases, releases_b), (fulls, fulls_b), scores,
                                fulls if scored is None else scored, TAU, lag, {STOP}, notes)
    return ok, detail, notes


def test_equal_release_points_pass_without_notes():
    fulls, scores, releases = _case(50, 0)
    ok, detail, notes = _row(list(releases), [f + [STOP] for f in fulls], fulls, scores, releases)
    assert ok and detail.startswith("50/50") and not notes  # a final stop token is not a difference


def test_a_difference_needs_a_near_tie_or_differing_tokens():
    fulls, scores, releases = _case(50, 1)
    moved = list(releases)
    t = releases[0] - 1
    moved[0] = t  # the other engine releases one step earlier
    scores[0][t] = TAU + MARGIN / 2  # hf's score there within the margin: explained
    ok, detail, notes = _row(moved, fulls, fulls, scores, releases)
    assert ok and "0 unexplained" in detail and len(notes) == 1
    scores[0][t] = TAU + 3 * MARGIN  # far from τ with equal tokens: a fault
    ok, detail, _ = _row(moved, fulls, fulls, scores, releases)
    assert not ok and "1 unexplained" in detail
    other = [list(f) for f in fulls]
    other[0][t] += 1  # the full-LoRA tokens already differ at t: explained again
    ok, _, _ = _row(moved, other, fulls, scores, releases)
    assert ok
    ok, _, _ = _row(moved, fulls, fulls, scores, releases, scored=other)  # the engines agree, hf scored
    assert ok                                                            # another trajectory: its score says nothing


def test_too_many_explained_differences_still_fail():
    n = 40
    fulls, scores, releases = _case(n, 2)
    moved = list(releases)
    k = n - math.ceil(MIN_AGREEMENT * n) + 1  # one difference more than the rule allows
    for j in range(k):
        moved[j] = None  # never released: the earlier point is this engine's release
        scores[j][releases[j]] = TAU
    ok, detail, notes = _row(moved, fulls, fulls, scores, releases)
    assert not ok and "0 unexplained" in detail and len(notes) == k


def test_a_lagged_policy_is_judged_at_its_decision_not_at_its_release():
    fulls, scores, releases = _case(50, 3)
    moved = list(releases)
    r = releases[0] - 1
    moved[0] = r  # the other engine releases one step earlier: with lag 1 it decided at r − 1
    scores[0][r - 1] = TAU + MARGIN / 2  # the decision was a near-tie: explained
    scores[0][r] = TAU + 3 * MARGIN  # the score at the release itself says nothing
    ok, detail, notes = _row(moved, fulls, fulls, scores, releases, lag=1)
    assert ok and "0 unexplained" in detail and f"decision t={r - 1}" in notes[0]
    scores[0][r - 1], scores[0][r] = TAU + 3 * MARGIN, TAU  # a far decision, a tie one step late: a fault
    ok, detail, _ = _row(moved, fulls, fulls, scores, releases, lag=1)
    assert not ok and "1 unexplained" in detail
