"""The hf engine against transformers/peft `generate`, and OFF forks against from-scratch runs."""
from __future__ import annotations

import pytest
import torch

from labeling.engines.hf import MIN_SHARED_PREFIX, GenRequest
from tests.conftest import mixed_requests
from serve_bridge.steptrim import NO_SLOT, LearnedPolicy, ProfiledPolicy, StepTrim, release_point_learned

MAX_NEW = 16


@pytest.fixture(scope="module")
def requests_mixed(engine) -> list[GenRequest]:
    """16 prompts cycling arith-a, rand-attn and no adapter, so every batch mixes them."""
    return mixed_requests(engine, 16)


def test_mixed_batch_matches_peft_generate(engine, requests_mixed) -> None:
    results = engine.generate(requests_mixed, MAX_NEW)
    peft_model = engine.model
    for req, res in zip(requests_mixed, results):
        ids = torch.tensor([req.prompt_ids])
        kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                  eos_token_id=sorted(engine.eos_ids), pad_token_id=engine.tokenizer.pad_token_id)
        if req.slot == NO_SLOT:
            with peft_model.disable_adapter():
                out = peft_model.generate(**kw)
        else:
            peft_model.set_adapter(engine.adapters[req.slot].name)
            out = peft_model.generate(**kw)
        ref = out[0, ids.shape[1]:].tolist()
        if ref and ref[-1] == engine.tokenizer.pad_token_id and len(ref) > len(res.tokens):
            ref = ref[:len(res.tokens)]
        assert res.tokens == ref, f"{req.uid} (slot {req.slot}) differs from peft generate"
    assert len({r.slot for r in requests_mixed}) == 3


def test_shared_prompt_prefix_runs_once_per_slot(engine, requests_mixed) -> None:
    """The batch above shares its chat template per slot: each slot's prefix KV is computed once
    (the tokens it then yields equal peft's generate, previous test)."""
    shared, kv = engine._shared_prefixes(requests_mixed)
    assert min(shared) >= MIN_SHARED_PREFIX
    assert all(n < len(r.prompt_ids) for n, r in zip(shared, requests_mixed))
    assert len(kv) == engine.model.config.num_hidden_layers
    assert set(kv[0]) == {r.slot for r in requests_mixed}
    assert {k.shape[-2] for k, _ in kv[0].values()} == set(shared)
    alone = engine._shared_prefixes(requests_mixed[:1])  # one request: nothing to share
    assert alone == ([0], [])


@pytest.mark.parametrize("engine_name", ["engine", "engine_auto"])
def test_fork_equals_profiled_from_scratch(engine_name, requests_mixed, request) -> None:
    """OFF_k forked from the ON state == a from-scratch run with profiled k, for several k at once,
    in float32 and as calibration multiplies by default."""
    engine = request.getfixturevalue(engine_name)
    reqs = [r for r in requests_mixed if r.slot != NO_SLOT][:4]
    ks = (0, 2, 5)
    forked = engine.generate(reqs, MAX_NEW, fork=lambda res, t, s: t in ks)
    n_checked = 0
    for k in ks:
        scratch = engine.generate(reqs, MAX_NEW, steptrim=StepTrim([ProfiledPolicy(k), ProfiledPolicy(k)], 576))
        for f, s in zip(forked, scratch):
            if len(f.tokens) - 1 > k:  # the response continues past forward k: a real fork
                assert f.branches[k] == s.tokens
                assert s.release == k
                n_checked += 1
            else:
                assert k not in f.branches and s.tokens == f.tokens
    assert n_checked >= 9


@pytest.mark.parametrize("engine_name", ["engine", "engine_auto"])
def test_learned_release_matches_scores(engine_name, requests_mixed, request) -> None:
    """A learned policy releases at the first t whose recorded score falls below τ."""
    engine = request.getfixturevalue(engine_name)
    reqs = [r for r in requests_mixed if r.slot == 0][:4]
    g = torch.Generator().manual_seed(3)
    head = LearnedPolicy(torch.randn(576, generator=g) / 24, 0.0, 0.0)
    scorer = StepTrim([head, None], 576)
    on = engine.generate(reqs, MAX_NEW, scorer=scorer)
    tau = float(torch.tensor([min(r.scores[: len(r.scores) // 2 + 1]) for r in on]).median()) + 1e-4
    policy = StepTrim([LearnedPolicy(head.weight, 0.0, tau), None], 576)
    trimmed = engine.generate(reqs, MAX_NEW, steptrim=policy, scorer=scorer)
    for a, b in zip(on, trimmed):
        r = release_point_learned(a.scores, tau)
        assert b.release == (r if r is not None and r < len(b.tokens) else None) or r >= len(a.tokens) - 1
        if r is not None:
            assert b.tokens[: r + 1] == a.tokens[: r + 1]


def test_captures_hidden_at_requested_forwards(engine, requests_mixed) -> None:
    reqs = [r for r in requests_mixed if r.slot == 0][:2]
    res = engine.generate(reqs, MAX_NEW, capture={0, 3}.__contains__)
    for r in res:
        assert set(r.hidden) == {0, 3}
        assert r.hidden[0].shape == (576,) and torch.isfinite(r.hidden[0]).all()
        assert not torch.equal(r.hidden[0], r.hidden[3])


def test_unknown_slot_is_rejected(engine) -> None:
    with pytest.raises(ValueError, match="slot 5"):
        engine.generate([GenRequest("x", [1, 2, 3], 5)], 4)


def _sweep_like_pass(engine, reqs, workers: int):
    """One pass with everything a pass can do (forks, captures, a scorer), on ``workers`` processes."""
    g = torch.Generator().manual_seed(5)
    scorer = StepTrim([LearnedPolicy(torch.randn(576, generator=g) / 24, 0.0, 0.0), None], 576)
    engine.workers, start = workers, engine.generated_tokens
    try:
        out = engine.generate(reqs, MAX_NEW, scorer=scorer, capture={0, 2}.__contains__,
                              fork=lambda res, t, s: t in (1, 4))
    finally:
        engine.workers = 1
    return out, engine.generated_tokens - start


def test_worker_processes_give_the_results_of_one(engine_auto, requests_mixed) -> None:
    """Three batches on two forked workers (and on three) equal the same batches in this process:
    tokens, branches, release points, scores, hidden states and the tokens counted."""
    reqs = requests_mixed[:12]  # batch_size 8: batches of 8 and 4, so a worker gets a short one
    one, n_one = _sweep_like_pass(engine_auto, reqs, 1)
    for workers in (2, 3):
        many, n_many = _sweep_like_pass(engine_auto, reqs, workers)
        assert n_many == n_one > 0
        assert [r.uid for r in many] == [r.uid for r in reqs]
        for a, b in zip(one, many):
            assert (a.tokens, a.branches, a.release, a.scores) == (b.tokens, b.branches, b.release, b.scores)
            assert a.hidden.keys() == b.hidden.keys() and all(torch.equal(a.hidden[t], b.hidden[t]) for t in a.hidden)
    assert any(r.branches for r in one) and any(r.hidden for r in one)
