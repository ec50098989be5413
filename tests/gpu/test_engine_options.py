"""The GPU tests' engine options at tensor parallelism, and how they compare ranks (no GPU)."""
from __future__ import annotations

from tests.gpu import release_engines as engines

TP = 2


def test_tensor_parallel_model_and_options():
    assert engines.model_for(1) is engines.MODEL and engines.engine_options() == engines.ENGINE  # TP = 1 unchanged
    model = engines.model_for(TP)
    assert model["num_attention_heads"] * model["head_dim"] == model["hidden_size"]
    for n in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        assert model[n] % TP == 0, n
    assert engines.RANK % TP == 0  # fully_sharded_loras splits the rank
    opts = engines.engine_options(TP, True)
    assert opts["tensor_parallel_size"] == TP and opts["fully_sharded_loras"] is True


def test_ranks_agree_ignores_timings_only():
    counters = {"released_requests": 3, "decision_ms_mean": 0.1, "adapters": {"a": {"released": 1}}}
    assert engines.ranks_agree([counters, {**counters, "decision_ms_mean": 0.7}])
    assert not engines.ranks_agree([counters, {**counters, "released_requests": 4}])
    assert not engines.ranks_agree([[{"req_id": "1", "release": 2}], [{"req_id": "1", "release": None}]])
