"""ReleaseRuntime driven by a small fake engine: chunked prefill, preemption recompute,
profiled / learned / none / unknown adapters, counters and start-up checks."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from serve_bridge.bundle import HEADS_FILE, AdapterEntry, BundleError, adapter_fingerprint, write_bundle
from serve_bridge.vllm.rpc import LoRazorWorkerExtension, lorazor_counters, lorazor_requests
from serve_bridge.runtime import CalibratedAdapters, build_runtime
from serve_bridge.steptrim import NO_SLOT, skip_fraction, skipped_decode_forwards
from tests.serve_bridge.engine_walk import H, WalkRequest, hidden_state, walk

W_LEARN = np.linspace(-1.0, 1.0, H, dtype=np.float32)
B_LEARN, TAU_LEARN = 0.1, 0.0


def _adapter(root: Path, name: str, seed: int) -> Path:
    d = root / name
    d.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    save_file({"lora_A": rng.standard_normal((4, H)).astype(np.float32)}, str(d / "adapter_model.safetensors"))
    return d


@pytest.fixture
def served(tmp_path) -> dict[str, Path]:
    """Adapter directories by served name; 'tampered' has other weights than calibrated."""
    names = ["prof0", "prof2", "learn", "off", "stranger"]
    paths = {n: _adapter(tmp_path / "adapters", n, i) for i, n in enumerate(names)}
    paths["tampered"] = _adapter(tmp_path / "adapters", "tampered", 99)
    return paths


def _bundle(tmp_path: Path, served: dict[str, Path], hidden: int = H, lag: int = 0) -> Path:
    fp = {n: adapter_fingerprint(p) for n, p in served.items()}
    entries = [AdapterEntry("prof0", fp["prof0"], "profiled", k=0),
               AdapterEntry("prof2", fp["prof2"], "profiled", k=2),
               AdapterEntry("learn", fp["learn"], "learned", tau=TAU_LEARN,
                            weight=np.resize(W_LEARN, hidden), bias=B_LEARN, lag=lag),
               AdapterEntry("off", fp["off"], "none"),
               AdapterEntry("tampered", fp["prof2"], "profiled", k=1)]  # calibrated on other weights
    return write_bundle(tmp_path / f"bundle{hidden}", backbone="tiny", hidden_size=hidden,
                        config_fingerprint="0" * 64, adapters=entries)


def _reference_release(adapter: str | None, lag: int = 0) -> callable:
    """r for a request, computed independently of the runtime (None: never released); a learned
    decision fires after a forward that ran and releases ``lag`` forwards later."""
    def ref(req_id: str, length: int) -> int | None:
        if adapter == "prof0":
            r = 0
        elif adapter == "prof2":
            r = 2
        elif adapter == "learn":
            fire = next((t for t in range(length) if float(W_LEARN @ hidden_state(req_id, t)) + B_LEARN < TAU_LEARN),
                        None)
            return None if fire is None else fire + lag
        else:
            r = None
        return r if r is not None and r <= length - 1 else None  # a forward that never ran decides nothing
    return ref


def _run(rt, reqs: list[WalkRequest], budget: int, preempt: set[str], paths: dict[str, Path], lag: int = 0,
         read_early: bool = True) -> None:
    """Serve ``reqs`` through the scheduler stand-in (preemption after 4 tokens) and check every
    scheduled position's mapping against the reference release."""
    for r in reqs:
        rt.add(r.req_id, r.adapter, str(paths[r.adapter]) if r.adapter else None, r.prompt)
    seen = walk(rt, reqs, budget, preempt, preempt_after=4, read_early=read_early)
    for r in reqs:
        ref = _reference_release(r.adapter, lag)(r.req_id, r.length)
        for pos, lora in seen[r.req_id]:
            expect = r.lora_id if ref is None or pos < r.prompt + ref else 0
            assert lora == expect, (r.req_id, pos, ref)


@pytest.mark.parametrize("lag, read_early", [(0, True), (1, True), (1, False), (0, False)])
def test_engine_walk_matches_steptrim_semantics(tmp_path, served, caplog, lag, read_early):
    """Every scheduled position's adapter, every record and counter follow StepTrim's semantics,
    with a learned decision lag of 0 or 1, and whether decisions are read as soon as they exist
    (a synchronous engine) or only when a step needs them (async scheduling): when a decision is
    read never changes a release."""
    paths = dict(served)
    rt = build_runtime(_bundle(tmp_path, served, lag=lag), H, "cpu")
    assert rt.hold == lag
    ids = {"prof0": 1, "prof2": 2, "learn": 3, "off": 4, "stranger": 5, "tampered": 6, None: 0}
    rng = np.random.default_rng(0)
    reqs = []
    for i in range(36):
        adapter = list(ids)[i % len(ids)]
        reqs.append(WalkRequest(f"r{i}", adapter, ids[adapter], prompt=int(rng.integers(2, 14)),
                         length=int(rng.integers(1, 12))))
    victims = {next(r for r in reqs if r.adapter == a).req_id for a in ("prof0", "prof2", "learn", "off")}
    for r in reqs:
        if r.req_id in victims:
            r.length = 11
    with caplog.at_level(logging.WARNING, logger="vllm.lorazor"):
        _run(rt, reqs, budget=10, preempt=victims, paths=paths, lag=lag, read_early=read_early)
    warned = caplog.text
    assert "'stranger' has no policy" in warned and "'tampered'" in warned and "differ from" in warned
    assert warned.count("'stranger' has no policy") == 1  # once per adapter

    records = {rec["req_id"]: rec for rec in lorazor_requests(SimpleNamespace(model_runner=SimpleNamespace(lorazor=rt)))}
    assert all(rec["finished"] for rec in records.values())
    assert set(records) == {r.req_id for r in reqs} and not rt.states
    releases = {}
    for r in reqs:
        ref = _reference_release(r.adapter, lag)(r.req_id, r.length)
        assert records[r.req_id]["release"] == ref, r
        assert records[r.req_id]["forwards"] == r.length
        releases[r.req_id] = ref
    assert any(releases[r.req_id] not in (None, 0) for r in reqs if r.adapter == "learn")  # non-trivial heads

    c = rt.counters()
    with_adapter = [r for r in reqs if r.adapter is not None]
    assert c["decode_forwards"] == sum(r.length - 1 for r in with_adapter)  # recompute is not counted twice
    assert c["skipped_forwards"] == sum(skipped_decode_forwards(r.length, releases[r.req_id]) for r in with_adapter)
    assert c["skip_fraction"] == pytest.approx(skip_fraction([r.length for r in with_adapter],
                                                             [releases[r.req_id] for r in with_adapter]))
    for name in ("prof0", "prof2", "learn", "off", "stranger", "tampered"):
        mine = [r for r in reqs if r.adapter == name]
        a = c["adapters"][name]
        assert a["requests"] == len(mine)
        assert a["released"] == sum(releases[r.req_id] is not None for r in mine)
        assert a["skipped_forwards"] == sum(skipped_decode_forwards(r.length, releases[r.req_id]) for r in mine)
    assert c["adapters"]["off"]["released"] == c["adapters"]["stranger"]["released"] == 0
    assert c["adapters"]["tampered"]["released"] == 0  # full LoRA, although the bundle says k=1
    assert c["released_requests"] == sum(v is not None for v in releases.values())
    assert c["decision_steps"] > 0 and c["decided_rows"] >= c["released_requests"]
    assert lorazor_counters(SimpleNamespace(model_runner=SimpleNamespace(lorazor=rt))) == c


@pytest.mark.parametrize("lag", [1, 2])
def test_previews_report_each_learned_release_at_the_step_that_decided_it(tmp_path, served, lag):
    """Under async scheduling (decisions read only as the hold requires), the preview taken after
    each step's take_releases reports a learned release with the step whose decision fired, with
    the same r as take_releases, which reads it `lag` launched decisions later (`lag` steps or
    more); it reports nothing else (chunked prefill and preemption included)."""
    paths = dict(served)
    rt = build_runtime(_bundle(tmp_path, served, lag=lag), H, "cpu")
    rt.report_releases = True
    ids = {"learn": 3, "prof2": 2, None: 0}
    rng = np.random.default_rng(1)
    reqs = [WalkRequest(f"r{i}", a, ids[a], prompt=int(rng.integers(2, 14)), length=int(rng.integers(2, 12)))
            for i, a in enumerate(["learn", "learn", "prof2", None] * 6)]
    victims = {reqs[0].req_id, reqs[2].req_id}
    for r in reqs:
        rt.add(r.req_id, r.adapter, str(paths[r.adapter]) if r.adapter else None, r.prompt)
        if r.req_id in victims:
            r.length = 11
    first_ahead: dict[str, tuple[int, int]] = {}
    first_taken: dict[str, tuple[int, int]] = {}
    steps = []

    def after_decide() -> None:
        steps.append(len(steps))
        taken = rt.take_releases()
        preview = rt.preview_releases()
        ahead = preview.releases() if preview is not None else {}
        for seen, got in ((first_ahead, ahead), (first_taken, taken)):
            for req_id, r in got.items():
                assert seen.setdefault(req_id, (steps[-1], r))[1] == r, (req_id, r, seen[req_id])

    walk(rt, reqs, budget=10, preempt=victims, preempt_after=4, read_early=False, after_decide=after_decide)
    learned = {r.req_id: _reference_release(r.adapter, lag)(r.req_id, r.length) for r in reqs if r.adapter == "learn"}
    released = {req_id: ref for req_id, ref in learned.items() if ref is not None}
    assert released and set(first_ahead) == set(released)
    for req_id, ref in released.items():
        (ahead_step, ahead_r), (taken_step, taken_r) = first_ahead[req_id], first_taken[req_id]
        assert ahead_r == taken_r == ref and taken_step - ahead_step >= lag, (req_id, first_ahead[req_id],
                                                                              first_taken[req_id])


def test_partial_prefill_chunk_does_not_decide(tmp_path, served):
    rt = build_runtime(_bundle(tmp_path, served), H, "cpu")
    rt.add("a", "prof0", str(served["prof0"]), 10)
    rt.begin_step(["a"], np.array([0]), np.array([6]), np.array([10]), (1,) * 6, (1,))
    rt.decide(torch.zeros(1, H))
    rt.resolve()
    assert rt.states["a"].release is None and rt.decision_steps == 0
    rt.begin_step(["a"], np.array([6]), np.array([4]), np.array([10]), (1,) * 4, (1,))
    rt.decide(torch.zeros(1, H))
    rt.resolve()
    assert rt.states["a"].release == 0 and rt.states["a"].forwards == 1
    m = rt.begin_step(["a"], np.array([10]), np.array([1]), np.array([11]), (1,), (1,))
    assert list(m.token_mapping) == [0] and m.lora_groups == 0


def test_profiled_k_is_applied_on_the_host(tmp_path, served):
    """prof2 (k = 2) is released after its forward t = 2 with no decision launched: the next
    step masks it, the counters and the step's reported releases say so, and only learned rows
    are planned for a decision."""
    rt = build_runtime(_bundle(tmp_path, served), H, "cpu")
    rt.report_releases = True
    rt.add("p", "prof2", str(served["prof2"]), 4)
    rt.add("l", "learn", str(served["learn"]), 4)
    computed, scheduled = np.array([0, 0]), np.array([4, 4])
    for t in range(4):
        m = rt.begin_step(["p", "l"], computed, scheduled, computed + scheduled,
                          (2,) * int(scheduled[0]) + (3,) * int(scheduled[1]), (2, 3))
        assert m.sampled_mapping[0] == (0 if t == 3 else 2)  # off from forward 3 on
        assert rt.wants_hidden() and len(rt._plan.rows) == 1  # the learned row only
        assert rt.take_releases() == ({"p": 2} if t == 2 else {})
        rt._plan = None  # no hidden states here: the learned row is not decided
        computed, scheduled = computed + scheduled, np.array([1, 1])
    assert rt.states["p"].release == 2 and rt.states["p"].decides is False
    c = rt.counters()
    assert c["decision_steps"] == 0 and c["adapters"]["prof2"]["released"] == 1
    assert c["adapters"]["prof2"]["skipped_forwards"] == 1


def test_group_count_follows_masked_mapping(tmp_path, served):
    rt = build_runtime(_bundle(tmp_path, served), H, "cpu")
    rt.add("a", "prof0", str(served["prof0"]), 4)
    rt.add("b", "off", str(served["off"]), 4)
    m = rt.begin_step(["a", "b"], np.array([0, 0]), np.array([4, 4]), np.array([4, 4]), (1,) * 4 + (4,) * 4, (1, 4))
    assert m.lora_groups == 2
    rt.decide(torch.zeros(2, H))
    m = rt.begin_step(["a", "b"], np.array([4, 4]), np.array([1, 1]), np.array([5, 5]), (1, 4), (1, 4))
    assert list(m.token_mapping) == [0, 4] and m.lora_groups == 2  # adapter 4 plus the released row
    assert rt.counters()["adapters"]["prof0"]["skipped_forwards"] == 1


def test_mismatched_hidden_rows_skip_the_decision(tmp_path, served, caplog):
    rt = build_runtime(_bundle(tmp_path, served), H, "cpu")
    rt.add("a", "learn", str(served["learn"]), 3)
    rt.begin_step(["a"], np.array([0]), np.array([3]), np.array([3]), (1,) * 3, (1,))
    with caplog.at_level(logging.WARNING, logger="vllm.lorazor"):
        rt.decide(torch.zeros(2, H))
    rt.resolve()
    assert rt.states["a"].release is None and "skipped a step" in caplog.text


def test_summary_is_logged_on_interval(tmp_path, served, caplog):
    rt = build_runtime(_bundle(tmp_path, served), H, "cpu", log_interval_s=10)
    with caplog.at_level(logging.INFO, logger="vllm.lorazor"):
        rt.maybe_log(now=rt._last_log + 5)
        assert "LoRazor StepTrim:" not in caplog.text
        rt.maybe_log(now=rt._last_log + 11)
    assert "LoRazor StepTrim: 0 adapter requests, 0 released" in caplog.text


# -- start-up checks: one BundleError each ----------------------------------------------------

def test_tampered_bundle_fails_at_start(tmp_path, served):
    b = _bundle(tmp_path, served)
    raw = bytearray((b / HEADS_FILE).read_bytes())
    raw[-2] ^= 1
    (b / HEADS_FILE).write_bytes(bytes(raw))
    with pytest.raises(BundleError, match="sha256 does not match"):
        build_runtime(b, H, "cpu")


def test_wrong_hidden_size_fails_at_start(tmp_path, served):
    with pytest.raises(BundleError, match="'hidden_size' is 8 but the served model has 576"):
        build_runtime(_bundle(tmp_path, served), 576, "cpu")


def test_unserved_bundle_adapter_fails_at_start(tmp_path, served):
    adapters = {n: str(served[n]) for n in ("prof0", "prof2", "learn", "off")}  # 'tampered' not served
    with pytest.raises(BundleError, match="adapter 'tampered' is not served here"):
        build_runtime(_bundle(tmp_path, served), H, "cpu", adapters)


def test_served_weights_differ_from_calibrated_fails_at_start(tmp_path, served):
    adapters = {n: str(served[n]) for n in ("prof0", "prof2", "learn", "off", "tampered")}
    with pytest.raises(BundleError, match="weights of adapter 'tampered' differ"):
        build_runtime(_bundle(tmp_path, served), H, "cpu", adapters)


def test_served_adapter_missing_from_bundle_warns_and_runs_full_lora(tmp_path, served, caplog):
    adapters = {n: str(served[n]) for n in ("prof0", "prof2", "learn", "off", "stranger")}
    adapters["tampered"] = str(served["prof2"])  # the weights the bundle calibrated
    with caplog.at_level(logging.WARNING, logger="vllm.lorazor"):
        rt = build_runtime(_bundle(tmp_path, served), H, "cpu", adapters)
    assert "adapter 'stranger' has no policy" in caplog.text
    assert rt.bundle.policies["stranger"] is None and "stranger" not in rt.slot_of
    rt.add("x", "tampered", adapters["tampered"], 3)
    assert rt.states["x"].slot == rt.slot_of["tampered"]  # verified at start-up


def test_weights_rewritten_under_a_served_name_are_checked_again(tmp_path, served, caplog):
    """An adapter loaded again under its name from the same directory, whose weights were rewritten
    meanwhile (vLLM 0.34 gives the new load a new id while old requests run): its requests are
    judged by the new weights, in the worker and in the scheduler (each its own CalibratedAdapters,
    the scheduler's trusting the worker's start-up check), and a running request keeps its policy."""
    path = str(served["prof2"])
    adapters = {n: str(served[n]) for n in ("prof0", "prof2", "learn", "off")} | {"tampered": path}
    rt = build_runtime(_bundle(tmp_path, served), H, "cpu", adapters)  # hashed at start-up
    scheduler = CalibratedAdapters(rt.bundle, adapters)
    weights = served["prof2"] / "adapter_model.safetensors"
    calibrated = weights.read_bytes()
    rt.add("a", "prof2", path, 3)
    weights.write_bytes((served["tampered"] / "adapter_model.safetensors").read_bytes())  # in place, same size
    os.utime(weights, ns=(1, 1))  # the rewrite's mtime, fixed so that no clock granularity hides it
    with caplog.at_level(logging.WARNING, logger="vllm.lorazor"):
        rt.add("b", "prof2", path, 3)
    assert "differ from those calibrated" in caplog.text and not scheduler.check("prof2", path)
    replacement = weights.with_suffix(".new")
    replacement.write_bytes(calibrated)
    os.replace(replacement, weights)  # the calibrated weights back, as a new file
    rt.add("c", "prof2", path, 3)
    assert scheduler.check("prof2", path)
    slots = {r: rt.states[r].slot for r in "abc"}
    assert slots == {"a": rt.slot_of["prof2"], "b": NO_SLOT, "c": rt.slot_of["prof2"]}


def test_request_records_include_tracked_requests_and_clear_finished(tmp_path, served):
    rt = build_runtime(_bundle(tmp_path, served), H, "cpu")
    worker = SimpleNamespace(model_runner=SimpleNamespace(lorazor=rt))
    for rid in ("a", "b"):
        rt.add(rid, "prof0", str(served["prof0"]), 3)
    rt.begin_step(["a", "b"], np.array([0, 0]), np.array([3, 3]), np.array([3, 3]), (1,) * 6, (1, 1))
    rt.decide(torch.zeros(2, H))
    rt.finish("a")  # applies the pending decision before recording
    recs = lorazor_requests(worker, clear=True)
    assert [(r["req_id"], r["finished"], r["forwards"], r["release"]) for r in recs] == [
        ("a", True, 1, 0), ("b", False, 1, 0)]
    assert [r["req_id"] for r in lorazor_requests(worker)] == ["b"]


def test_worker_extension_names_the_readouts(tmp_path, served):
    """By method name, as vLLM's /collective_rpc calls them (string arguments)."""
    class Worker(LoRazorWorkerExtension):
        model_runner = SimpleNamespace(lorazor=build_runtime(_bundle(tmp_path, served), H, "cpu"))

    rt = Worker.model_runner.lorazor
    rt.add("a", "prof0", str(served["prof0"]), 3)
    rt.begin_step(["a"], np.array([0]), np.array([3]), np.array([3]), (1,) * 3, (1,))
    rt.decide(torch.zeros(1, H))
    rt.finish("a")
    worker = Worker()
    assert worker.lorazor_counters()["released_requests"] == 1
    assert [r["req_id"] for r in worker.lorazor_requests(clear="true")] == ["a"]
    assert worker.lorazor_requests() == []


def test_rpc_without_bridge_explains_how_to_start():
    with pytest.raises(RuntimeError, match="LORAZOR_BUNDLE=<bundle directory>"):
        lorazor_counters(SimpleNamespace(model_runner=SimpleNamespace()))


@pytest.mark.parametrize("record", [True, False])
def test_recorded_margins_are_the_learned_scores_less_tau(tmp_path, served, record):
    """With record_margins each learned decision's s_t − τ is kept: equal to the head on the
    request's hidden state, non-negative before the release and negative at it; none for a
    profiled request, and none at all while off (the default)."""
    rt = build_runtime(_bundle(tmp_path, served), H, "cpu")
    assert not rt.record_margins
    rt.record_margins = record
    reqs = [WalkRequest(f"m{i}", "learn", 3, prompt=3 + i, length=10) for i in range(8)]
    reqs.append(WalkRequest("p", "prof2", 2, prompt=4, length=6))
    _run(rt, reqs, budget=10, preempt={"m1"}, paths=dict(served))
    records = {rec["req_id"]: rec for rec in lorazor_requests(SimpleNamespace(model_runner=SimpleNamespace(lorazor=rt)))}
    assert records["p"]["margins"] == []
    if not record:
        assert all(rec["margins"] == [] for rec in records.values())
        return
    released = 0
    for r in reqs[:-1]:
        rel, margins = records[r.req_id]["release"], dict(records[r.req_id]["margins"])
        assert sorted(margins) == list(range(len(margins))) and margins, r.req_id  # every decision, in order
        for t, m in margins.items():
            want = float(W_LEARN @ hidden_state(r.req_id, t)) + B_LEARN - TAU_LEARN
            assert m == pytest.approx(want, rel=1e-5, abs=1e-5)
        if rel is not None:
            released += 1
            assert max(margins) == rel and margins[rel] < 0 and all(margins[t] >= 0 for t in range(rel))
        else:
            assert all(m >= 0 for m in margins.values())
    assert released > 0
