"""Export: selection + heads → bundle entries → a bundle the runtime loads."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from predictors.export import bundle_entries
from predictors.frontier import pareto, select
from predictors.heads import Head
from serve_bridge.bundle import file_sha256, load_bundle, write_bundle
from serve_bridge.steptrim import LearnedPolicy, ProfiledPolicy

H = 8


def _setup(tmp_path):
    heads = {"a": Head("a", np.arange(H, dtype=np.float32), 0.5, 10, 40, 9, "ok"),
             "b": Head("b", np.zeros(H, np.float32), 0.0, 10, 40, 0, "single_class", "adapter 'b' ... class 0")}
    rows = [("a", "learned", 0.25, 0.6, 1.0), ("a", "learned", -1.0, 0.2, 0.0),
            ("a", "profiled", 4.0, 0.5, 3.0), ("b", "profiled", 8.0, 0.3, 0.5)]
    priced = pd.DataFrame(rows, columns=["adapter", "policy", "param", "skip", "loss_points"])
    priced = priced.assign(accuracy=70.0 - priced.loss_points, n_requests=10, full_accuracy=70.0)
    weights = {}
    for name in heads:
        weights[name] = tmp_path / name / "adapter_model.safetensors"
        weights[name].parent.mkdir()
        weights[name].write_bytes(name.encode())
    front = pareto(priced)
    return heads, select(front, ["P50", "budget=1"]), front, weights


def test_learned_export_round_trips_through_the_bundle(tmp_path):
    heads, sel, front, weights = _setup(tmp_path)
    entries = bundle_entries(heads, sel, front, "P50", "learned", weights)
    a, b = entries
    assert (a.policy, a.tau, a.bias, b.policy) == ("learned", 0.25, 0.5, "none")
    assert a.weights_sha256 == file_sha256(weights["a"])
    assert a.stats["val_skip"] == 0.6 and a.stats["frontier"][-1]["param"] == 0.25
    assert b.stats["head_status"] == "single_class" and "no learned candidates" in b.stats["note"]
    bundle = load_bundle(write_bundle(tmp_path / "bundle", backbone="m", hidden_size=H, config_fingerprint="c",
                                      adapters=entries), expected_hidden_size=H, known_adapters=["a", "b"])
    assert isinstance(bundle.policies["a"], LearnedPolicy) and bundle.policies["b"] is None


def test_profiled_export_and_errors(tmp_path):
    heads, sel, front, weights = _setup(tmp_path)
    a, b = bundle_entries(heads, sel, front, "budget=1", "profiled", weights)
    assert (a.policy, b.policy, b.k) == ("none", "profiled", 8)  # a: k=4 costs 3 points > budget
    assert "loss upper bound ≤ 1 points" in a.stats["note"]
    assert isinstance(a.to_policy(), type(None)) and isinstance(b.to_policy(), ProfiledPolicy)
    with pytest.raises(ValueError, match="no selection for adapter 'a', policy 'profiled', rule 'P75'"):
        bundle_entries(heads, sel, front, "P75", "profiled", weights)
    with pytest.raises(ValueError, match="export policy 'best'"):
        bundle_entries(heads, sel, front, "P50", "best", weights)


def test_export_records_validation_release_points(tmp_path):
    from predictors.export import release_distribution
    from predictors.sweep import RequestTree

    heads, sel, front, weights = _setup(tmp_path)
    trees = [RequestTree(f"a{i}", "a", 6, 1, np.array([1, 1, 0.1, 0, 0, 0], np.float32) * (i % 3)) for i in range(6)]
    trees += [RequestTree("b0", "b", 3, 1, np.zeros(0, np.float32))]
    a, b = bundle_entries(heads, sel, front, "P50", "learned", weights, trees)
    # tau 0.25: s_t = 0 at t = 0 for i % 3 == 0; at t = 2 for the others (0.1, 0.2 < 0.25)
    assert a.stats["release_points"] == {"r": [0, 2], "count": [2, 4], "never": 0}
    assert "release_points" not in b.stats  # none: never released
    a, b = bundle_entries(heads, sel, front, "budget=1", "profiled", weights, trees)
    assert b.stats["release_points"] == {"r": [8], "count": [1], "never": 0}  # a point mass at k
    assert release_distribution([None, 3, 3, 1]) == {"r": [1, 3], "count": [1, 2], "never": 1}
    load_bundle(write_bundle(tmp_path / "bundle", backbone="m", hidden_size=H, config_fingerprint="c",
                             adapters=[a, b]), expected_hidden_size=H)  # plain JSON the manifest accepts
