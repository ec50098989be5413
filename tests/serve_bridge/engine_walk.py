"""A stand-in for vLLM's scheduler, for runtime tests without vLLM.

It drives a :class:`serve_bridge.runtime.ReleaseRuntime` step by step like vLLM 0.26's runner:
chunked prefill under a token budget, one-token decodes, and for each request in ``preempt`` one
recompute from position 0 (vLLM's preemption) once it has generated ``preempt_after`` tokens.
Hidden states are a deterministic function of (request, forward), so tests can compute release
points independently of the runtime.
"""
from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

H = 8  # hidden size of the walk's states


def hidden_state(req_id: str, t: int) -> np.ndarray:
    """h_t of request ``req_id`` at forward t (float32 [H], seeded by both)."""
    rng = np.random.default_rng(zlib.crc32(f"{req_id}:{t}".encode()))
    return rng.standard_normal(H).astype(np.float32)


@dataclass
class WalkRequest:
    """A request of ``length`` generated tokens after a ``prompt``-token prompt, on LoRA id
    ``lora_id`` (0: none). uid / forced: the calibration tag and forced release position."""

    req_id: str
    adapter: str | None
    lora_id: int
    prompt: int
    length: int
    uid: str | None = None
    forced: int | None = None
    computed: int = 0
    generated: int = 0


def walk(rt, reqs: list[WalkRequest], budget: int, preempt: set[str], preempt_after: int, read_early: bool = True,
         after_decide: Callable[[], None] | None = None) -> dict[str, list[tuple[int, int]]]:
    """Run ``reqs`` (already added to ``rt``) to completion; return, per request, the masked
    LoRA id the runtime mapped to every position it scheduled, as (position, lora id).

    A runtime with a ``capture`` method (calibration mode) is given each step's hidden states
    before ``decide``, as the runner does. ``read_early``: read every launched decision before
    the next step, as a synchronous engine can at no cost; otherwise the runtime reads only what
    its :attr:`hold` requires, as under vLLM's async scheduling. ``after_decide`` is called after
    each step's ``decide``, where the runner samples and builds the step's output.
    """
    seen: dict[str, list[tuple[int, int]]] = {r.req_id: [] for r in reqs}
    running, preempted = list(reqs), set()
    while running:
        if read_early:
            rt.resolve()
        for r in running:
            if r.req_id in preempt and r.req_id not in preempted and r.generated == preempt_after:
                preempted.add(r.req_id)
                r.computed = 0
        rows, left = [], budget
        for r in running:
            n = min(r.prompt + r.generated - r.computed, left)
            if n > 0:
                rows.append((r, n))
                left -= n
        tokens = np.concatenate([np.full(n, r.lora_id) for r, n in rows])
        m = rt.begin_step([r.req_id for r, _ in rows], np.array([r.computed for r, _ in rows]),
                          np.array([n for _, n in rows]), np.array([r.prompt + r.generated for r, _ in rows]),
                          tuple(tokens), tuple(r.lora_id for r, _ in rows))
        off = 0
        for r, n in rows:
            seen[r.req_id] += [(r.computed + q, int(m.token_mapping[off + q])) for q in range(n)]
            off += n
        hidden = torch.from_numpy(np.stack([hidden_state(r.req_id, r.computed + n - r.prompt) for r, n in rows]))
        if hasattr(rt, "capture"):
            rt.capture(hidden)
        rt.decide(hidden)
        if after_decide is not None:
            after_decide()
        for r, n in rows:
            r.computed += n
            if r.computed == r.prompt + r.generated:
                r.generated += 1
        for r in [r for r in running if r.generated == r.length]:
            running.remove(r)
            rt.finish(r.req_id)
    assert preempted == preempt, "every request marked for preemption was preempted"
    return seen
