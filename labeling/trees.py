"""The sweep's single full-LoRA pass: release trees for every validation request.

One ON generation per (request, adapter) records s_t at every forward (all heads evaluated
by one StepTrim scorer) and forks an OFF continuation exactly at the distinct release
points of the candidates (``predictors.sweep.ForkPlanner``). Every candidate is then priced
from these trees without regenerating (docs/design.md §3.5). Backbone-only rows ride in the same
batches to report each adapter's lift on its own requests.
"""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from labeling.engines.hf import GenResult, HFEngine
from labeling.labels import build_requests, serves
from labeling.tasks import Example, Task
from predictors.sweep import ForkPlanner, RequestTree
from serve_bridge.steptrim import NO_SLOT, StepTrim


@dataclass
class TreePass:
    """Trees, plus the cost of producing them."""

    trees: list[RequestTree]
    backbone_accuracy: dict[str, float]  # adapter → % on that adapter's requests, no adapter
    seconds: float


def run_trees(engine: HFEngine, task: Task, examples: Sequence[Example], adapter_names: Sequence[str],
              scorer: StepTrim, planner: ForkPlanner, parts: Mapping[int, str | None] | None = None) -> TreePass:
    """Generate release trees for ``examples`` × adapters (``parts``: slot → the task part it
    serves, see :func:`labeling.labels.build_requests`), and one backbone-only response per example."""
    parts = parts or {}
    pairs = build_requests(engine, task, examples, [*range(len(adapter_names)), NO_SLOT], parts)
    states = {req.uid: planner.new_state() for _, req in pairs}

    def fork(res: GenResult, t: int, s: float | None) -> bool:
        return planner.should_fork(states[res.uid], adapter_names[res.slot], t, s)

    start = time.perf_counter()
    results = engine.generate([r for _, r in pairs], task.max_new_tokens, scorer=scorer, fork=fork, desc="sweep pass")
    seconds = time.perf_counter() - start
    trees, backbone = [], {}
    for (ex, req), res in zip(pairs, results):
        q_on = task.score(ex, engine.decode(res.tokens))
        if req.slot == NO_SLOT:
            for a_idx, a in enumerate(adapter_names):
                if serves(parts.get(a_idx), ex):
                    backbone.setdefault(a, []).append(q_on)
            continue
        branches = {r: (task.score(ex, engine.decode(b)), len(b)) for r, b in res.branches.items()}
        trees.append(RequestTree(uid=ex.uid, adapter=adapter_names[req.slot], on_length=len(res.tokens),
                                 on_correct=q_on, scores=res.scores, branches=branches))
    return TreePass(trees, {a: 100.0 * sum(q) / len(q) for a, q in backbone.items()}, seconds)
