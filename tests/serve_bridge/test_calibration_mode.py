"""Calibration mode of the bridge: activation, per-request forced release and uid tags, and
the records (release, s_t, h_t) of a CalibrationRuntime driven by a fake engine walk with
chunked prefill and preemption recompute."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from serve_bridge.calibration import (CalibrationRuntime, calibration_config, policy_from_data, policy_to_data,
                                      steptrim_from_data, steptrim_to_data)
from serve_bridge.vllm.rpc import lorazor_calibrate, lorazor_captures, lorazor_counters
from serve_bridge.runtime import NEVER, ReleaseRuntime, RequestState, request_args
from serve_bridge.vllm.settings import BridgeError, BridgeSettings
from serve_bridge.steptrim import NO_SLOT, LearnedPolicy, ProfiledPolicy, StepTrim
from tests.serve_bridge.engine_walk import H, WalkRequest, hidden_state, walk

W = torch.linspace(-1.0, 1.0, H)


# -- activation ---------------------------------------------------------------------------------

def test_calibration_env_activates_without_bundle():
    s = BridgeSettings.from_env({"LORAZOR_CALIBRATION": "1"})
    assert s is not None and s.calibration and s.bundle is None
    assert BridgeSettings.from_env({"LORAZOR_CALIBRATION": " On "}).calibration
    for off in ("", "0", "off"):
        assert BridgeSettings.from_env({"LORAZOR_CALIBRATION": off}) is None
    assert not BridgeSettings.from_env({"LORAZOR_BUNDLE": "/b"}).calibration


@pytest.mark.parametrize("env,match", [({"LORAZOR_CALIBRATION": "yes"}, "use 1 or on"),
                                       ({"LORAZOR_CALIBRATION": "1", "LORAZOR_BUNDLE": "/b"}, "both set")])
def test_calibration_env_refuses(env, match):
    with pytest.raises(BridgeError, match=match):
        BridgeSettings.from_env(env)


def test_rpc_refuses_serving_runtime(tmp_path):
    serving = ReleaseRuntime.__new__(ReleaseRuntime)
    with pytest.raises(RuntimeError, match="LORAZOR_CALIBRATION=1"):
        lorazor_captures(SimpleNamespace(model_runner=SimpleNamespace(lorazor=serving)))


# -- request arguments ----------------------------------------------------------------------------

def test_request_args():
    assert request_args(None) == (None, None)
    assert request_args({"other": 1}) == (None, None)
    assert request_args({"lorazor": {"uid": "q@0", "release_position": 12}}) == ("q@0", 12)
    assert request_args({"lorazor": {"release_position": np.int64(0)}}) == (None, 0)
    for bad, match in [({"lorazor": 3}, "must be a mapping"), ({"lorazor": {"uid": 1}}, r"\['uid'\] must be a string"),
                       ({"lorazor": {"release_position": -1}}, "int ≥ 0"),
                       ({"lorazor": {"release_position": True}}, "int ≥ 0"),
                       ({"lorazor": {"release": 3}}, "unknown keys")]:
        with pytest.raises(ValueError, match=match):
            request_args(bad)


def test_forced_release_position_masks_and_never_decides(caplog):
    st = RequestState(adapter="a", slot=0, num_prompt_tokens=10, forced_release_position=9)
    assert st.release_position == 9 and not st.decides
    st.release = 3
    assert st.release_position == 9  # the earlier of the two
    assert RequestState(adapter="a", slot=0, num_prompt_tokens=10, release=None).release_position == NEVER
    rt = CalibrationRuntime(H, "cpu")
    with caplog.at_level(logging.WARNING, logger="vllm.lorazor"):
        rt.add("x", "a", "/p", 4, {"lorazor": {"release_position": "soon"}})
    assert "int ≥ 0" in caplog.text and rt.states["x"].forced_release_position is None


# -- policies as data -----------------------------------------------------------------------------

def test_policy_data_round_trip_is_exact():
    g = torch.Generator().manual_seed(0)
    learned = LearnedPolicy(torch.randn(H, generator=g), 0.123456789, -0.3)
    st = StepTrim([ProfiledPolicy(3), None, learned], H)
    back = steptrim_from_data(steptrim_to_data(st), H)
    assert back.policies[0] == ProfiledPolicy(3) and back.policies[1] is None
    assert torch.equal(back.table, st.table)  # float32 parameters survive as Python floats
    assert policy_from_data(policy_to_data(None)) is None
    assert steptrim_to_data(None) is None
    with pytest.raises(ValueError, match="2 slots for 3 adapters"):
        calibration_config(["a", "b", "c"], policy=StepTrim([None, None], H))


# -- a fake engine walk ----------------------------------------------------------------------------

def _walk(rt: CalibrationRuntime, reqs: list[WalkRequest], budget: int, preempt: set[str]) -> dict[str, list[tuple]]:
    """Add ``reqs`` with their calibration tags and serve them through the scheduler stand-in
    (preemption after 3 tokens); return the masked mapping seen at every scheduled position."""
    for r in reqs:
        extra = {"lorazor": {k: v for k, v in (("uid", r.uid), ("release_position", r.forced)) if v is not None}}
        rt.add(r.req_id, r.adapter, "/p" if r.adapter else None, r.prompt, extra)
    return walk(rt, reqs, budget, preempt, preempt_after=3)


def test_walk_records_release_scores_andhidden_state():
    rt = CalibrationRuntime(H, "cpu")
    worker = SimpleNamespace(model_runner=SimpleNamespace(lorazor=rt))
    slots = ["prof", "learn", "none"]
    head = LearnedPolicy(W, 0.1, 0.0)
    scorer = StepTrim([LearnedPolicy(-W, 0.2, 0.0), head, None], H)
    policy = StepTrim([ProfiledPolicy(2), head, None], H)
    lorazor_calibrate(worker, calibration_config(slots, policy, scorer, capture={0, 3, 99}))
    ids = {"prof": 1, "learn": 2, "none": 3, "stranger": 4, None: 0}
    rng = np.random.default_rng(1)
    reqs = []
    for i in range(20):
        adapter = list(ids)[i % len(ids)]
        reqs.append(WalkRequest(f"r{i}", adapter, ids[adapter], int(rng.integers(2, 12)), int(rng.integers(1, 10)),
                                uid=f"u{i}" if i % 7 else None))
    forced = [WalkRequest(f"f{i}", a, ids[a], p, 6, uid=f"fu{i}", forced=p - 1 - d)
              for i, (a, p, d) in enumerate([("prof", 9, 0), ("learn", 7, 0), ("learn", 11, 3), ("none", 5, 0)])]
    victims = {"r1", "r2", "f1"}
    for r in reqs:
        if r.req_id in victims:
            r.length = 8
    seen = _walk(rt, reqs + forced, budget=9, preempt=victims)
    part = lorazor_captures(worker, uids=["u3", "fu1", "nobody"])  # a read by uid takes only those
    assert set(part) == {"u3", "fu1"}
    records = lorazor_captures(worker)
    assert lorazor_captures(worker) == {}  # cleared by the first read
    assert not set(part) & set(records)
    records |= part

    def expected_release(r: WalkRequest) -> int | None:
        if r.forced is not None or r.adapter not in ("prof", "learn"):
            return None
        if r.adapter == "prof":
            rel = 2
        else:
            rel = next((t for t in range(r.length) if float(W @ torch.from_numpy(hidden_state(r.req_id, t))) + 0.1 < 0),
                       None)
        return rel if rel is not None and rel <= r.length - 1 else None

    checked_learn = 0
    for r in reqs + forced:
        rel = expected_release(r)
        pos = r.forced if r.forced is not None else (NEVER if rel is None else r.prompt + rel)
        for p, lora in seen[r.req_id]:  # masking: exactly the positions ≥ the release position
            assert lora == (0 if p >= pos else r.lora_id), (r, p)
        if r.uid is None:
            assert all(k != r.uid for k in records)
            continue
        rec = records[r.uid]
        assert rec["release"] == rel and rec["forwards"] == r.length
        assert rec["forced_release_position"] == r.forced
        slot = slots.index(r.adapter) if r.adapter in slots else NO_SLOT
        want = [float(scorer.scores(torch.tensor([slot]), torch.from_numpy(hidden_state(r.req_id, t))[None])[0])
                for t in range(r.length)]
        assert rec["scores"] == want  # every forward, preemption recompute included, same float32 values
        assert sorted(rec["hidden"]) == [t for t in (0, 3) if t < r.length]
        for t, h in rec["hidden"].items():
            assert np.array_equal(np.asarray(h, np.float32), hidden_state(r.req_id, t))
        checked_learn += r.adapter == "learn" and rel not in (None, 0)
    assert checked_learn > 0
    assert sum(r.uid is not None for r in reqs + forced) == len(records)
    c = lorazor_counters(worker)
    assert c["calibration"]["slots"] == slots and c["released_requests"] == sum(
        expected_release(r) is not None for r in reqs + forced)


def test_reconfigure_switches_policy_and_clears_nothing_unread():
    rt = CalibrationRuntime(H, "cpu")
    rt.configure(calibration_config(["a"], StepTrim([ProfiledPolicy(0)], H)))
    rt.add("x", "a", "/p", 3, {"lorazor": {"uid": "x"}})
    rt.begin_step(["x"], np.array([0]), np.array([3]), np.array([3]), (1, 1, 1), (1,))
    rt.capture(torch.zeros(1, H))
    rt.decide(torch.zeros(1, H))
    rt.finish("x")
    rt.configure(calibration_config(["a"]))  # full LoRA from now on; the record of x stays
    rt.add("y", "a", "/p", 3, {"lorazor": {"uid": "y"}})
    rt.begin_step(["y"], np.array([0]), np.array([3]), np.array([3]), (1, 1, 1), (1,))
    rt.capture(torch.zeros(1, H))
    rt.decide(torch.zeros(1, H))
    recs = rt.take_records()
    assert recs["x"]["release"] == 0 and recs["y"]["release"] is None
    assert recs["x"]["scores"] == [] and recs["x"]["hidden"] == {}  # no scorer, empty capture set


def test_plugin_activates_on_calibration(monkeypatch):
    """LORAZOR_CALIBRATION=1 alone switches the plugin on (here: its version gate refuses a fake vLLM)."""
    import sys
    from types import ModuleType

    from serve_bridge.vllm import plugin

    fake = ModuleType("vllm")
    fake.__version__ = "0.27.0"
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.delenv("LORAZOR_BUNDLE", raising=False)
    monkeypatch.delenv("LORAZOR_GRIDTRIM", raising=False)
    monkeypatch.setenv("LORAZOR_CALIBRATION", "1")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    with pytest.raises(BridgeError, match="vLLM 0.27.0 is installed"):
        plugin.register()
