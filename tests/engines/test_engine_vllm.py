"""engine=vllm on CPU: the pure parts against the hf engine's semantics, and the whole
VLLMEngine over a stand-in for ``vllm.LLM`` that runs the real calibration runtime
(tests/engines/fake_vllm.py) against the hf engine, token for token."""
from __future__ import annotations

import copy
import json

import numpy as np
import pandas as pd
import pytest
import torch

from labeling.engines.hf import GenRequest
from labeling.engines.vllm.backend import LocalBackend
from labeling.engines.vllm.data_parallel import DataParallelBackend, shard
from labeling.engines.vllm.engine import VLLMEngine
from labeling.engines.vllm.options import VLLMOptions, llm_kwargs, lora_rank, prepare_environment, stop_ids_for
from labeling.engines.vllm.requests import (VLLMRequest, assemble_branches, capture_set, off_request, on_requests,
                                            plan_forks)
from labeling.labels import run_labeling
from labeling.tasks import build_task
from tests.conftest import mixed_requests
from predictors.candidates import tau_candidates
from predictors.sweep import ForkPlanner
from serve_bridge.calibration import calibration_config
from serve_bridge.steptrim import NO_SLOT, LearnedPolicy, ProfiledPolicy, StepTrim
from tests.engines.fake_vllm import FakeLLM, FakeLoRARequest, FakeOutputKind, FakeSamplingParams

MAX_NEW = 12  # the stand-in runs one model call per request and token
H = 576


@pytest.fixture(scope="module")
def requests_mixed(engine) -> list[GenRequest]:
    """12 prompts cycling arith-a, rand-attn and no adapter."""
    return mixed_requests(engine, 12)


@pytest.fixture(scope="module")
def requests_small(requests_mixed) -> list[GenRequest]:
    """6 of them (2 per slot kind): the stand-in runs one request per model call, slowly."""
    return requests_mixed[:6]


@pytest.fixture(scope="module")
def heads() -> list[LearnedPolicy]:
    g = torch.Generator().manual_seed(5)
    return [LearnedPolicy(torch.randn(H, generator=g) / 24, 0.05 * i, 0.0) for i in range(2)]


@pytest.fixture(scope="module")
def fake_llm(engine) -> FakeLLM:
    return FakeLLM(engine, budget=40, preempt_every=4)


@pytest.fixture(scope="module")
def vengine(engine, fake_llm) -> VLLMEngine:
    backend = LocalBackend(fake_llm, engine.adapters, engine.eos_ids, FakeSamplingParams, FakeLoRARequest,
                           FakeOutputKind)
    return VLLMEngine(backend, engine.tokenizer, engine.adapters, engine.eos_ids, engine.hidden_size, progress=False)


def _planner_fork(planner: ForkPlanner, names: list[str], states: dict):
    def fork(res, t, s):
        return planner.should_fork(states.setdefault(res.uid, planner.new_state()), names[res.slot], t, s)
    return fork


# -- the pure parts against the hf engine -----------------------------------------------------------

def test_fork_plan_and_branch_layout_match_hf(engine, requests_mixed, heads) -> None:
    """plan_forks on hf's finished ON results forks exactly where hf forked (with the sweep's
    stateful ForkPlanner, which refuses out-of-order calls), also under a release policy;
    OFF requests and assembled branches have hf's layout."""
    names = [a.name for a in engine.adapters]
    scorer = StepTrim(heads, H)
    probe = engine.generate(requests_mixed, MAX_NEW, scorer=scorer)
    taus = {a: tau_candidates(np.concatenate([r.scores for r in probe if r.slot == i]), 5) for i, a in enumerate(names)}
    planner = ForkPlanner(taus, (0, 3, 6))
    cut = float(np.median([min(r.scores[:4]) for r in probe if r.slot == 0]))
    policy = StepTrim([LearnedPolicy(heads[0].weight, heads[0].bias, cut), ProfiledPolicy(4)], H)
    n_forks = n_released = 0
    for steptrim in (None, policy):
        states: dict = {}
        fork = _planner_fork(planner, names, states)
        hf = engine.generate(requests_mixed, MAX_NEW, steptrim=steptrim, scorer=scorer,
                             capture={0, 3}.__contains__, fork=fork)
        states.clear()
        plan = plan_forks(hf, fork)
        assert sorted(plan) == sorted((i, t) for i, r in enumerate(hf) for t in r.branches)
        offs = []
        for i, t in plan:
            req, res = requests_mixed[i], hf[i]
            off = off_request(req, res, t, MAX_NEW)
            assert off.prompt_ids == tuple(req.prompt_ids) + tuple(res.tokens[:t + 1])
            assert off.release_position == len(req.prompt_ids) + t and off.max_tokens == MAX_NEW - (t + 1)
            assert off.slot == req.slot and off.uid is None
            assert off.extra_args() == {"lorazor": {"release_position": len(req.prompt_ids) + t}}
            assert len(res.branches[t]) - (t + 1) <= off.max_tokens
            offs.append(res.branches[t][t + 1:])
        rebuilt = [copy.copy(r) for r in hf]
        for r in rebuilt:
            r.branches = {}
        assemble_branches(rebuilt, plan, offs)
        assert [r.branches for r in rebuilt] == [r.branches for r in hf]
        n_forks += len(plan)
        n_released += sum(r.release is not None for r in hf)
    assert n_forks >= 20 and n_released >= 3


def test_capture_set_and_on_requests() -> None:
    assert capture_set(None, 8) == frozenset()
    assert capture_set({0, 3, 63}.__contains__, 16) == {0, 3}
    reqs = on_requests([GenRequest("a", [1, 2], 0), GenRequest("a", [3], NO_SLOT)], 9)
    assert reqs == [VLLMRequest((1, 2), 0, 9, uid="0"), VLLMRequest((3,), NO_SLOT, 9, uid="1")]
    assert reqs[0].extra_args() == {"lorazor": {"uid": "0"}}
    assert VLLMRequest((1,), 0, 1).extra_args() is None
    with pytest.raises(ValueError, match="no OFF branch at t=2"):
        from labeling.engines.hf import GenResult
        off_request(GenRequest("a", [1], 0), GenResult("a", 0, tokens=[5, 6, 7]), 2, 9)


def test_engine_arguments(engine, tmp_path) -> None:
    kw = llm_kwargs("/m", engine.adapters, VLLMOptions(max_num_seqs=64, tensor_parallel_size=2,
                                                       max_cudagraph_capture_size=None))
    assert kw["enable_prefix_caching"] is False and kw["async_scheduling"] is False and kw["enable_lora"]
    assert kw["max_loras"] == 2 and kw["max_lora_rank"] == 8 and kw["max_num_seqs"] == 64
    assert "max_model_len" not in kw and "data_parallel_size" not in kw and kw["tensor_parallel_size"] == 2
    assert "kv_cache_memory_bytes" not in kw  # sized by vLLM's profiling pass
    fixed = llm_kwargs("/m", engine.adapters, VLLMOptions(kv_cache_memory_bytes=1 << 32))
    assert fixed["kv_cache_memory_bytes"] == 1 << 32
    assert "compilation_config" not in kw  # vLLM's own graph sizes
    kw = llm_kwargs("/m", engine.adapters, VLLMOptions(prefix_caching=True, max_lora_rank="16"))
    assert kw["compilation_config"] == {"max_cudagraph_capture_size": 1024} and kw["max_lora_rank"] == 16
    assert kw["enable_prefix_caching"] is True and kw["async_scheduling"] is False
    with pytest.raises(ValueError, match="max_lora_rank='big'"):
        llm_kwargs("/m", engine.adapters, VLLMOptions(max_lora_rank="big"))
    big = tmp_path / "big"
    big.mkdir()
    (big / "adapter_config.json").write_text(json.dumps({"r": 8, "rank_pattern": {"q_proj": 40}}))
    from labeling.adapters import AdapterSpec

    assert lora_rank([AdapterSpec("b", str(big))]) == 64
    assert shard([5, 1, 1, 1, 1, 1], 2) == [[0], [1, 2, 3, 4, 5]]


def test_the_calibration_engine_environment_per_vllm_line() -> None:
    base = {"LORAZOR_CALIBRATION": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    for version, runner in (("0.26.0", "0"), ("0.33.0", "1")):  # V1 on 0.26, V2 on 0.33
        env = {"LORAZOR_BUNDLE": "/b", "VLLM_USE_V2_MODEL_RUNNER": "1" if runner == "0" else "0"}
        prepare_environment(env, version)
        assert env == base | {"VLLM_USE_V2_MODEL_RUNNER": runner}
    env = {"LORAZOR_BUNDLE": "/b"}
    prepare_environment(env, "0.34.0")  # V2 is 0.34's only runner; VLLM_USE_V2_MODEL_RUNNER=0 would stop it
    assert env == base


def test_stop_ids_match_the_hf_engine(engine) -> None:
    from labeling.backbone import SMOLLM2, resolve_backbone_dir

    assert stop_ids_for(resolve_backbone_dir(SMOLLM2), engine.tokenizer, SMOLLM2) == engine.eos_ids


# -- the whole engine over the runtime, against the hf engine --------------------------------------

def _same(hf, vl) -> None:
    for a, b in zip(hf, vl, strict=True):
        assert (b.uid, b.slot) == (a.uid, a.slot)
        assert b.tokens == a.tokens, a.uid
        assert b.release == a.release, a.uid
        np.testing.assert_allclose(b.scores, a.scores, atol=2e-4, rtol=0)
        assert sorted(b.hidden) == sorted(a.hidden)
        for t in a.hidden:
            torch.testing.assert_close(b.hidden[t], a.hidden[t], atol=2e-4, rtol=1e-4)
        assert b.branches == a.branches, a.uid


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "two-pass"])
def test_vllm_engine_matches_hf_engine(engine, vengine, fake_llm, requests_small, heads, pipeline) -> None:
    """ON tokens, s_t, h_t and OFF branches (prefix replay with a forced release) equal the hf
    engine's (KV forks), with chunked prefill and preemption recompute in the stand-in; OFF
    branches started as their ON response finishes (pipelined) or after all of them."""
    scorer = StepTrim(heads, H)
    kw = dict(scorer=scorer, capture={0, 2, 5}.__contains__, fork=lambda res, t, s: t in (0, 2, 5))
    hf = engine.generate(requests_small, MAX_NEW, **kw)
    vengine.pipeline, start = pipeline, len(fake_llm.events)
    try:
        vl = vengine.generate(requests_small, MAX_NEW, **kw)
    finally:
        vengine.pipeline = True
    _same(hf, vl)
    events = fake_llm.events[start:]
    first_off = min(step for step, what, rid in events if what == "added" and rid not in {e[2] for e in events[:6]})
    last_on = max(step for step, what, rid in events if what == "finished" and rid in {e[2] for e in events[:6]})
    assert (first_off < last_on) is pipeline  # OFF branches ran next to unfinished ON responses
    assert sum(len(r.branches) for r in hf) >= 8
    assert sum(b[:t + 1] != r.tokens[:t + 1] or b != r.tokens for r in hf for t, b in r.branches.items()) > 0
    assert fake_llm.preemptions > 0
    assert fake_llm.runtime.take_records() == {}  # all read
    assert fake_llm.step() == []  # as in vLLM, the runner learns of the last finishes at the next step
    assert not fake_llm.runtime.states


def test_vllm_engine_release_policy_matches_hf(engine, vengine, requests_small, heads) -> None:
    """A learned and a profiled policy drive the ON pass through the runtime's StepTrim:
    same release points and tokens as the hf engine."""
    scorer = StepTrim(heads, H)
    probe = engine.generate(requests_small, MAX_NEW, scorer=scorer)
    cut = float(np.max([min(r.scores[1:6]) for r in probe if r.slot == 0])) + 1e-4  # each releases by t=5
    policy = StepTrim([LearnedPolicy(heads[0].weight, heads[0].bias, cut), ProfiledPolicy(3)], H)
    hf = engine.generate(requests_small, MAX_NEW, steptrim=policy, scorer=scorer)
    vl = vengine.generate(requests_small, MAX_NEW, steptrim=policy, scorer=scorer)
    _same(hf, vl)
    assert [r.release is not None for r in hf] == [r.slot != NO_SLOT for r in hf]
    assert any(r.release not in (0, 3) for r in hf if r.slot == 0)


def test_labeling_points_per_adapter(engine, vengine, tmp_path) -> None:
    """Labeling runs unchanged on the vLLM engine: the same labels and features as on the hf engine,
    with points given per adapter slot (each adapter's requests labeled at its own T, every t of it
    the response continues past)."""
    task = build_task("arith", sizes={"train": 2}, max_new_tokens=12)
    examples = task.load_split("train")
    names = [a.name for a in engine.adapters]
    pts = {0: [0, 1, 3, 7], 1: [2, 4, 5]}
    ref, ref_h = run_labeling(engine, task, examples, names, pts, tmp_path / "hf", shard_requests=4)
    got, got_h = run_labeling(vengine, task, examples, names, pts, tmp_path / "vllm", shard_requests=4)
    pd.testing.assert_frame_equal(got, ref)
    np.testing.assert_allclose(got_h, ref_h, atol=2e-4, rtol=1e-4)
    for (uid, adapter), g in ref.groupby(["uid", "adapter"]):
        on_length = g["on_length"].iloc[0]
        assert list(g["t"]) == [t for t in pts[names.index(adapter)] if t < on_length - 1], (uid, adapter)
    assert set(ref["adapter"]) == set(names) and len(ref) >= 8


def test_pipelined_run_aborts_on_error_and_refuses_a_busy_engine(engine, fake_llm) -> None:
    """A follow-up callback that fails leaves no request behind in the engine; a run does not
    start on an engine that has someone else's requests."""
    backend = LocalBackend(fake_llm, engine.adapters, engine.eos_ids, FakeSamplingParams, FakeLoRARequest,
                           FakeOutputKind)
    reqs = [VLLMRequest((1, 2, 3, 4), 0, 6, uid=f"e{i}") for i in range(3)] + [VLLMRequest((5, 6), 0, 3, uid="short")]
    seen = []

    def follow(k, tokens, record):
        seen.append((k, len(tokens), record["forwards"]))
        if len(seen) == 2:
            raise KeyError("boom")
        return [VLLMRequest((1, 2, 3, 4, *tokens[:1]), 0, 5, release_position=4)]

    with pytest.raises(KeyError, match="boom"):
        backend.run_pipelined(reqs, {"slots": [a.name for a in engine.adapters]}, follow, "t", False)
    assert not fake_llm.has_unfinished_requests()
    assert all(n == f for _, n, f in seen)  # records read by uid are complete: forwards = tokens
    fake_llm.runtime.take_records()  # the aborted run's other records
    policy = calibration_config([a.name for a in engine.adapters], StepTrim([ProfiledPolicy(1)] * 2, H))
    with pytest.raises(ValueError, match="release policy"):
        backend.run_pipelined(reqs, policy, follow, "t", False)
    fake_llm.add_request("busy", {"prompt_token_ids": [1, 2]}, FakeSamplingParams(max_tokens=1))
    with pytest.raises(RuntimeError, match="unfinished requests"):
        backend.run_pipelined(reqs, {"slots": []}, follow, "t", False)
    fake_llm.abort_request(["busy"])
    assert not fake_llm.has_unfinished_requests()


def test_engine_checks(vengine) -> None:
    with pytest.raises(ValueError, match="slot 5"):
        vengine.generate([GenRequest("x", [1, 2, 3], 5)], 4)
    with pytest.raises(ValueError, match="max_model_len 2048"):
        vengine.generate([GenRequest("x", [1] * 2040, 0)], 16)
    with pytest.raises(ValueError, match="hidden size 8"):
        vengine.generate([GenRequest("x", [1, 2], 0)], 4, scorer=StepTrim([None, None], 8))
    assert vengine.generate([], 4) == []


def test_data_parallel_replicas_split_and_merge() -> None:
    """Replicas in their own processes, each with its own CUDA_VISIBLE_DEVICES slice; outputs and
    records come back in request order."""
    dp = DataParallelBackend(2, 1, "tests.engines.fake_vllm:echo_backend", ("x",), visible=["0", "1"])
    try:
        reqs = [VLLMRequest(tuple(range(i + 1)), 0, 2, uid=str(i)) for i in range(5)]
        out = dp.run(reqs, {"slots": ["a"]}, "dp", False)
        assert [t[:-1] for t in out.tokens] == [list(r.prompt_ids[-2:]) for r in reqs]
        assert set(out.records) == {"0", "1", "2", "3", "4"}
        assert len({t[-1] for t in out.tokens}) == 2 and out.records["0"]["slots"] == ["a"]
        assert dp.run([], {"slots": []}, "dp", False).tokens == []
    finally:
        dp.close()


def test_a_prefix_caching_engine_refuses_release_policy_passes(engine, fake_llm, requests_small, heads) -> None:
    """With engine.prefix_caching the scheduler keys only forced releases (serve_bridge.vllm.prefix_cache):
    a pass whose policy releases while decoding is refused before it starts; full-LoRA passes run."""
    backend = LocalBackend(fake_llm, engine.adapters, engine.eos_ids, FakeSamplingParams, FakeLoRARequest)
    cached = VLLMEngine(backend, engine.tokenizer, engine.adapters, engine.eos_ids, engine.hidden_size,
                        progress=False, prefix_caching=True)
    policy = StepTrim([ProfiledPolicy(3), None], H)
    with pytest.raises(ValueError, match="release policy.*prefix_caching=false"):
        cached.generate(requests_small, MAX_NEW, steptrim=policy)
    assert len(cached.generate(requests_small, MAX_NEW, steptrim=StepTrim([None, None], H),
                               scorer=StepTrim(heads, H))) == len(requests_small)


def test_a_replica_that_cannot_start_is_one_clear_error() -> None:
    with pytest.raises(RuntimeError, match="data-parallel replica 0 died"):
        DataParallelBackend(1, 1, "tests.engines.fake_vllm:no_such_factory", (), visible=["0"])


def test_vllm_engine_cuts_where_the_answer_is_decided(engine, vengine, fake_llm) -> None:
    """Responses end where the task decides them, as on the hf engine; with early stop the ON
    response is cut before its OFF branches are planned (none past that point) and an OFF branch
    is aborted at the step that decides it; without it every branch runs to its end and is cut
    afterwards: the same results, fewer tokens generated. The requests: one whose hf response is
    decided early (the backbone alone commits a wrong count on a counter question), the same
    question with the adapter (its OFF branch at t = 0 commits as early), and one that is not,
    picked on the hf engine, which is fast."""
    from labeling.labels import build_requests

    CUT_MAX_NEW = 16  # the backbone's early-decided answer needs 12 tokens

    task = build_task("counter", sizes={"validation": 12}, max_new_tokens=CUT_MAX_NEW)
    pool = [r for _, r in build_requests(engine, task, task.load_split("validation"), [0, NO_SLOT])]
    first = engine.generate(pool, CUT_MAX_NEW)
    cut = [q for q, r in zip(pool, first) if len(r.tokens) < CUT_MAX_NEW and r.tokens[-1] not in engine.eos_ids]
    whole = [q for q, r in zip(pool, first) if len(r.tokens) == CUT_MAX_NEW]
    assert cut and whole, "the backbone no longer answers these counter questions as this test expects"
    # with the adapter, the same question: released at t = 0 the backbone commits as early
    twin = next(q for q in pool if q.slot == 0 and q.uid.split("@")[0] == cut[0].uid.split("@")[0])
    reqs = cut[:1] + [twin] + whole[:1]
    kw = dict(fork=lambda res, t, s: t in (0, 13))  # 13: past the early-decided response's cut
    hf = engine.generate(reqs, CUT_MAX_NEW, **kw)
    cut_branches = [b for r in hf for b in r.branches.values() if len(b) < CUT_MAX_NEW and b[-1] not in engine.eos_ids]
    assert cut_branches, "no OFF branch is decided early: the test would not see the OFF early stop"
    used, sampled = [], []
    for early_stop in (True, False):
        vengine.early_stop, start, start_sampled = early_stop, vengine.generated_tokens, fake_llm.generated
        try:
            vl = vengine.generate(reqs, CUT_MAX_NEW, **kw)
        finally:
            vengine.early_stop = True
        used.append(vengine.generated_tokens - start)
        sampled.append(fake_llm.generated - start_sampled)
        assert [(r.tokens, r.branches) for r in vl] == [(r.tokens, r.branches) for r in hf]
        assert not fake_llm.has_unfinished_requests()
    assert used[0] == sampled[0] < used[1] == sampled[1]  # what was counted is what the engine sampled
