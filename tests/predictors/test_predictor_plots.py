"""Each plot writes a non-empty PNG; the frontier plot groups labels of nearby k instead of stacking them."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from predictors.frontier import k_table, pareto, select
from predictors.plots import _clusters, plot_frontier, plot_k_curves, plot_positive_rate, plot_release_histogram

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _priced() -> pd.DataFrame:
    rows = [("a", "learned", t / 10, t / 12, t * t / 20) for t in range(10)]
    rows += [("a", "profiled", float(k), max(0.0, 0.9 - k / 70), 8 / (k + 1)) for k in (0, 1, 2, 4, 8, 16, 32, 64)]
    df = pd.DataFrame(rows, columns=["adapter", "policy", "param", "skip", "loss_points"])
    return df.assign(accuracy=75 - df.loss_points, n_requests=50, full_accuracy=75.0)


def _is_png(path) -> bool:
    return path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 2000


@pytest.mark.parametrize("kind", ["frontier", "k", "positive_rate", "histogram"])
def test_plot_writes_png(tmp_path, kind):
    priced = _priced()
    if kind == "frontier":
        out = plot_frontier(priced, pareto(priced), select(priced, ["P25", "P50", "budget=1"]), "a",
                            tmp_path / "f" / "frontier.png")
        bounded = priced.assign(loss_low=priced.loss_points - 1, loss_high=priced.loss_points + 1)
        noted = plot_frontier(bounded, pareto(bounded), select(bounded, ["budget=3"]), "a", tmp_path / "g.png",
                              rule="budget=3", budget=3.0, note="a: why this point, in one line.")
        assert _is_png(noted)
    elif kind == "k":
        out = plot_k_curves(k_table(priced), "a", tmp_path / "k.png")
    elif kind == "positive_rate":
        points = pd.DataFrame({"uid": [f"u{i % 7}" for i in range(80)], "adapter": ["a", "b"] * 40,
                               "t": [(0, 1, 2, 3, 7, 15, 31, 63)[i % 8] for i in range(80)],
                               "y": [int(i % 3 == 0) for i in range(80)]})
        out = plot_positive_rate(points, tmp_path / "pos.png")
    else:
        out = plot_release_histogram([0, 3, 3, 5, None, 12, 120, None], tmp_path / "hist.png", "a, τ=0.2")
    assert _is_png(out)


def test_nearby_k_labels_share_one_label():
    x = np.array([90.0, 89.0, 88.5, 60.0, 20.0, 19.0])
    y = np.array([10.0, 9.8, 9.9, 3.0, 0.1, 0.0])
    assert _clusters(x, y, 100.0, 10.0) == [[0, 1, 2], [3], [4, 5]]
    assert _clusters(x, y, 10.0, 10.0) == [[i] for i in range(6)]  # a narrower span separates them
