"""What the vLLM engine sends to vLLM and how its results come back: ON requests tagged with a
uid, the post-hoc fork replay, OFF requests by prefix replay and the hf engine's branch layout."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from labeling.answer_cut import AnswerWatch, Decode
from labeling.engines.hf import GenRequest, GenResult
from labeling.forks import ForkFn, forks_at
from serve_bridge.runtime import REQUEST_ARGS_KEY
from serve_bridge.vllm.settings import CALIBRATION_ENV
from serve_bridge.steptrim import NO_SLOT


@dataclass(frozen=True)
class VLLMRequest:
    """One request handed to vLLM.

    uid: the calibration record's key (ON pass), None for OFF branches.
    release_position: forced release (OFF branches): positions ≥ it run without the adapter.
    decided: called with the tokens generated so far, the number to keep once the response is
    decided (:class:`labeling.answer_cut.AnswerWatch`), else None; the request then stops there.
    """

    prompt_ids: tuple[int, ...]
    slot: int
    max_tokens: int
    uid: str | None = None
    release_position: int | None = None
    decided: Callable[[Sequence[int]], int | None] | None = field(default=None, compare=False, repr=False)

    def extra_args(self) -> dict[str, Any] | None:
        """``SamplingParams.extra_args`` (:func:`serve_bridge.runtime.request_args` layout)."""
        spec = {k: v for k, v in (("uid", self.uid), ("release_position", self.release_position)) if v is not None}
        return {REQUEST_ARGS_KEY: spec} if spec else None


# follow(k, tokens, record): the requests to start when request k of a pipelined run finishes.
FollowFn = Callable[[int, list[int], "dict[str, Any] | None"], Sequence[VLLMRequest]]


@dataclass
class Batch:
    """One ``generate``: generated tokens per request (in order) and the records by uid."""

    tokens: list[list[int]]
    records: dict[str, dict[str, Any]] = field(default_factory=dict)


def capture_set(capture: Callable[[int], bool] | None, max_new_tokens: int) -> frozenset[int]:
    """The forwards t ∈ [0, max_new_tokens) whose h_t the hf engine would record."""
    return frozenset() if capture is None else frozenset(t for t in range(max_new_tokens) if capture(t))


def on_requests(requests: Sequence[GenRequest], max_new_tokens: int) -> list[VLLMRequest]:
    """The ON pass: each request tagged with its index as uid (GenRequest uids need not be unique)."""
    return [VLLMRequest(tuple(r.prompt_ids), r.slot, int(max_new_tokens), uid=str(i)) for i, r in enumerate(requests)]


def on_result(req: GenRequest, tokens: Sequence[int], record: Mapping[str, Any] | None, scored: bool) -> GenResult:
    """A GenResult from the ON tokens and the request's calibration record."""
    if record is None:
        raise RuntimeError(f"request {req.uid}: vLLM returned no LoRazor record; every vLLM process must run the "
                           f"LoRazor runner ({CALIBRATION_ENV}=1 before vLLM starts).")
    tokens = [int(x) for x in tokens]
    if record["forwards"] != len(tokens):
        raise RuntimeError(f"request {req.uid}: the runtime saw {record['forwards']} forwards for {len(tokens)} "
                           f"generated tokens (speculative decoding or a runner mismatch?).")
    res = GenResult(uid=req.uid, slot=req.slot, tokens=tokens, release=record["release"])
    if scored:
        res.scores = [float(s) for s in record["scores"]]
        if len(res.scores) != len(tokens):
            raise RuntimeError(f"request {req.uid}: {len(res.scores)} scores for {len(tokens)} forwards.")
    res.hidden = {int(t): torch.tensor(h, dtype=torch.float32) for t, h in record["hidden"].items()}
    return res


def fork_points(res: GenResult, fork: ForkFn) -> list[int]:
    """The t of every OFF branch the hf engine would fork from this finished ON result: the fork
    rule (:mod:`labeling.forks`) replayed forward by forward, ``fork`` called as the hf engine
    calls it, with a partial result (scores and h_t up to t, release if ≤ t, no tokens)."""
    points = []
    partial = GenResult(uid=res.uid, slot=res.slot)
    for t in range(len(res.tokens)):
        s = res.scores[t] if res.scores else None
        if s is not None:
            partial.scores.append(s)
        if t in res.hidden:
            partial.hidden[t] = res.hidden[t]
        if res.release == t:
            partial.release = t
        released, last = partial.release is not None, t == len(res.tokens) - 1
        if forks_at(fork, partial, t, s, released=released, last=last):
            points.append(t)
        if released or last or res.slot == NO_SLOT:
            break  # the rule forks nothing later
    return points


def plan_forks(results: Sequence[GenResult], fork: ForkFn) -> list[tuple[int, int]]:
    """(result index, t) of every OFF branch (:func:`fork_points`), request by request."""
    return [(i, t) for i, res in enumerate(results) for t in fork_points(res, fork)]


def off_request(req: GenRequest, res: GenResult, t: int, max_new_tokens: int,
                decode: Decode | None = None) -> VLLMRequest:
    """OFF_t by prefix replay: prompt + ON tokens[:t+1], adapter off from position len(prompt)+t
    (token t+1, consumed by forward t+1), for the tokens the ON response had left. With ``decode``
    and the request's ``stop``, the branch stops where its answer is decided (ON tokens[:t+1] are
    not: the ON response was cut first)."""
    if not 0 <= t < len(res.tokens) - 1:
        raise ValueError(f"request {req.uid}: no OFF branch at t={t} for an ON response of {len(res.tokens)} tokens")
    watch = None if decode is None or req.stop is None else AnswerWatch(res.tokens[:t + 1], req.stop, decode)
    return VLLMRequest(tuple(req.prompt_ids) + tuple(res.tokens[:t + 1]), req.slot, max_new_tokens - (t + 1),
                       release_position=len(req.prompt_ids) + t, decided=watch)


def assemble_branches(results: Sequence[GenResult], plan: Sequence[tuple[int, int]],
                      outputs: Sequence[Sequence[int]]) -> None:
    """``results[i].branches[t]`` = ON tokens[:t+1] + the OFF continuation (hf engine layout)."""
    for (i, t), out in zip(plan, outputs, strict=True):
        results[i].branches[t] = results[i].tokens[:t + 1] + [int(x) for x in out]

