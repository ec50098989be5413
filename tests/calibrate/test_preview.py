"""The cost preview scales what the measured labeling shards generated, per request, to the run."""
from __future__ import annotations

import pytest

from calibrate.preview import Workload, estimate, format_preview
from labeling.labels import LabelingPlan, ShardStats


def test_estimate_scales_the_measured_shards() -> None:
    # two shards of 4 requests measured: 10 ON tokens, 3 OFF branches of 5 tokens per request, 0.5 s each
    shard = ShardStats(requests=4, points=12, on_tokens=40, off_branches=12, off_tokens=60, seconds=2.0)
    plan = LabelingPlan(requests=20, shard_requests=4, done={0: shard, 3: shard})
    work = Workload({"train": 20, "validation": 6, "test": 5}, adapters=1, points=8)
    e = estimate(plan, work)
    assert plan.shards == 5 and plan.measured().tokens == 200
    assert e["labels"] == pytest.approx({"on": 20, "off": 60, "off_max": 160, "tokens": 500, "seconds": 10.0,
                                         "left_s": 6.0})
    # sweep and test ON responses at the measured 50 tokens/s (200 in 4 s) and 10 ON tokens per request
    assert e["sweep"] == pytest.approx({"on": 12, "tokens": 120, "seconds": 2.4})
    assert e["test"] == pytest.approx({"on": 10, "tokens": 100, "seconds": 2.0})
    text = format_preview(plan, work, "hf (cpu)")
    assert text.startswith("preview on hf (cpu), measured on 2 of 5 labeling shard(s): 8 requests, 200 generated")
    assert "labels: 20 ON + ~60 OFF continuations (at most 160), ~500 generated tokens, ~10 s (6 s left)" in text


def test_the_warmup_shard_is_not_extrapolated() -> None:
    """The first shard this process ran (3 s for 4 requests: warm-up) counts as done, but the
    requests left are priced at the steady shard's 0.5 s per request, and so is the sweep."""
    warm = ShardStats(requests=4, points=12, on_tokens=40, off_branches=12, off_tokens=60, seconds=3.0)
    steady = ShardStats(requests=4, points=12, on_tokens=40, off_branches=12, off_tokens=60, seconds=2.0)
    plan = LabelingPlan(requests=20, shard_requests=4, done={0: warm, 1: steady}, warmup=0)
    work = Workload({"train": 20, "validation": 6, "test": 5}, adapters=1, points=8)
    e = estimate(plan, work)
    assert e["labels"]["left_s"] == pytest.approx(6.0) and e["labels"]["seconds"] == pytest.approx(11.0)
    assert e["sweep"]["seconds"] == pytest.approx(2.4)  # 120 tokens at the steady 50 tokens/s
    assert "(50 tokens/s after the warm-up shard)" in format_preview(plan, work, "hf (cpu)")


def test_the_preview_waits_for_a_shard_past_the_warmup() -> None:
    plan = LabelingPlan(requests=20, shard_requests=4, done={})
    assert not plan.ready_to_preview(0)
    plan.done[0], plan.warmup = ShardStats(4, 12, 40, 12, 60, 3.0), 0
    assert not plan.ready_to_preview(1) and plan.ready_to_preview(4)  # unless the next shard is the last
    plan.done[1] = ShardStats(4, 12, 40, 12, 60, 2.0)
    assert plan.ready_to_preview(2)
    resumed = LabelingPlan(requests=20, shard_requests=4, done={0: plan.done[0]})  # done before this process
    assert resumed.ready_to_preview(1) and resumed.steady() == resumed.measured()


def test_no_measured_shard_is_refused() -> None:
    with pytest.raises(ValueError, match="no labeling shard"):
        estimate(LabelingPlan(4, 2, {}), Workload({"train": 4, "validation": 1, "test": 1}, 1, 8))
