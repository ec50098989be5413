"""The one-pass sweep is exact on the real engine: pricing a candidate from the release trees
gives the same per-request outcome, length and release point as regenerating with that
policy active through StepTrim."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from labeling.labels import build_requests
from labeling.tasks import build_task
from labeling.trees import run_trees
from predictors.candidates import Candidates, tau_candidates
from predictors.sweep import ForkPlanner, outcome, release_point
from serve_bridge.steptrim import LearnedPolicy, ProfiledPolicy, StepTrim, skip_fraction

MAX_NEW = 20


@pytest.mark.parametrize("lag", [1, 0])
def test_tree_pricing_equals_naive_regeneration(engine_auto, lag) -> None:
    """For the default decision lag (1: a learned decision on forward t releases from t+2) and for
    lag 0, as old bundles hold."""
    task = build_task("arith", sizes={"validation": 4}, max_new_tokens=MAX_NEW)
    examples = task.load_split("validation")
    names = [a.name for a in engine_auto.adapters]
    g = torch.Generator().manual_seed(11)
    heads = [LearnedPolicy(torch.randn(576, generator=g) / 24, 0.1, 0.0) for _ in names]
    scorer = StepTrim(heads, engine_auto.hidden_size)
    # τ candidates from the heads' own scores along a plain full-LoRA pass.
    probe = run_trees(engine_auto, task, examples, names, scorer, ForkPlanner({}, ()))
    taus = {a: tau_candidates(np.concatenate([t.scores for t in probe.trees if t.adapter == a]), 6) for a in names}
    cands = Candidates(taus=taus, ks=(0, 3, 8), lag=lag)
    tp = run_trees(engine_auto, task, examples, names, scorer, ForkPlanner(cands.taus, cands.ks, cands.lag))
    checked = 0
    for a_idx, a in enumerate(names):
        trees = [t for t in tp.trees if t.adapter == a]
        priced_here = cands.for_adapter(a)[::3]  # 2 of the 6 τ and 1 of the 3 k
        assert {p for p, _ in priced_here} == {"learned", "profiled"}
        for policy, param in priced_here:
            pol = (LearnedPolicy(heads[a_idx].weight, heads[a_idx].bias, float(param), lag) if policy == "learned"
                   else ProfiledPolicy(int(param)))
            slots = [None] * len(names)
            slots[a_idx] = pol
            naive = engine_auto.generate(
                [r for r in _requests(engine_auto, task, examples, a_idx)], MAX_NEW,
                steptrim=StepTrim(slots, engine_auto.hidden_size))
            priced = [outcome(t, release_point(t, policy, param, lag)) for t in trees]
            for (correct, length, rel), res, ex in zip(priced, naive, examples):
                assert length == len(res.tokens)
                assert correct == task.score(ex, engine_auto.decode(res.tokens))
                naive_rel = res.release if res.release is not None and res.release < len(res.tokens) - 1 else None
                assert rel == naive_rel
                checked += 1
            assert skip_fraction([p[1] for p in priced], [p[2] for p in priced]) == skip_fraction(
                [len(r.tokens) for r in naive], [r.release for r in naive])
    assert checked >= 24


def _requests(engine, task, examples, slot):
    return [r for _, r in build_requests(engine, task, examples, [slot])]


def test_mixed_task_trees_route_each_part_to_its_adapter(engine_auto) -> None:
    """task=mix: adapter 0 serves arith, adapter 1 counter; every example also gets one backbone row,
    and the backbone's accuracy is reported per adapter on that adapter's own examples."""
    parts = {"arith": {"sizes": {"validation": 2}, "options": {"max_new_tokens": MAX_NEW}},
             "counter": {"sizes": {"validation": 3}, "options": {"max_new_tokens": MAX_NEW}}}
    task = build_task("mix", parts=parts)
    examples = task.load_split("validation")
    names = [a.name for a in engine_auto.adapters]
    scorer = StepTrim([None] * len(names), engine_auto.hidden_size)
    tp = run_trees(engine_auto, task, examples, names, scorer, ForkPlanner({}, (2,)), {0: "arith", 1: "counter"})
    served = {a: [t.uid for t in tp.trees if t.adapter == a] for a in names}
    assert served == {names[0]: [e.uid for e in examples if e.meta["task"] == "arith"],
                      names[1]: [e.uid for e in examples if e.meta["task"] == "counter"]}
    assert set(tp.backbone_accuracy) == set(names)
    assert all(2 in t.branches for t in tp.trees if t.on_length > 3)  # forks still follow the planner
