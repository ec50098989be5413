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
