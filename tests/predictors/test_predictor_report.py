"""The one-line reasons: a never-release choice names the best bound it missed; a release names both
policies' skips, their ratio and the spread of release points."""
from __future__ import annotations

import pandas as pd

from predictors.report import explain


def _priced() -> pd.DataFrame:
    rows = [  # adapter, policy, param, skip, loss, broken, loss_high
        ("late", "learned", 0.5, 0.60, 0.0, 0, 1.2), ("late", "learned", 0.9, 0.80, 5.0, 12, 8.0),
        ("late", "profiled", 16.0, 0.10, 0.0, 0, 1.2), ("late", "profiled", 4.0, 0.70, 30.0, 72, 36.0),
        ("needy", "learned", 0.1, 0.30, 15.0, 7, 25.0), ("needy", "learned", 0.2, 0.06, 4.0, 2, 9.0),
        ("needy", "profiled", 32.0, 0.05, 2.1, 1, 9.8),
    ]
    df = pd.DataFrame(rows, columns=["adapter", "policy", "param", "skip", "loss_points", "broken", "loss_high"])
    return df.assign(loss_low=-1.0, fixed=0, accuracy=90 - df.loss_points, n_requests=240, full_accuracy=90.0)


def test_release_line_compares_policies_and_spread():
    line = explain(_priced(), "late", "budget=2", "learned", [3, 5, 5, 9, None])
    assert line.startswith("late: learned skips 60.0% at a loss of 0.0 points (≤ 1.2 at the bound)")
    assert "the best profiled k=16 skips 10.0% (learned/profiled = 6.0×)" in line
    assert "release points r = 3–9 (middle half 4–6) over 4/5 requests" in line


def test_never_release_line_names_the_bound_it_missed():
    line = explain(_priced(), "needy", "budget=2", "learned")
    assert line.startswith("needy: never released")
    assert "the lowest: 9.0 at 6% skip, 2 of 240 requests broken" in line
    assert explain(_priced(), "needy", "P50", "learned").startswith("needy: never released — no learned candidate")


def test_never_release_line_blames_the_sample_size_when_nothing_broke():
    few = _priced().assign(n_requests=48)
    few.loc[few["param"] == 0.2, ["broken", "loss_points", "loss_high"]] = [0, 0.0, 6.1]
    line = explain(few, "needy", "budget=2", "learned")
    assert "with no request broken): 48 validation requests are too few" in line
