"""A CPU stand-in for ``vllm.LLM`` that runs the real LoRazor calibration runtime.

It does what the bridge's runner (``serve_bridge.vllm.model_runner``) does inside vLLM 0.26, on the
hf engine's peft model: requests are added to a :class:`CalibrationRuntime` with their
``SamplingParams.extra_args``; each step schedules chunked prefills under a token budget and
one-token decodes (and, optionally, a preemption recompute), hands the LoRA mapping to
``begin_step``, applies the *masked* mapping position by position (runs of positions with the
same LoRA id are one model call on the request's own KV cache), collects the final-norm
hidden state of each row's last scheduled position, calls ``capture`` and ``decide`` on
them, and samples greedily. Finished requests reach the runtime at the next step, as in
vLLM. So :class:`labeling.engines.vllm.engine.VLLMEngine` can be tested end to end on CPU against
the hf engine; only vLLM's kernels are missing.
"""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from labeling.engines.hf import BASE
from labeling.engines.vllm.requests import Batch, VLLMRequest
from serve_bridge.calibration import CalibrationRuntime


@dataclass
class FakeSamplingParams:
    temperature: float = 1.0
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    detokenize: bool = True
    extra_args: dict | None = None
    output_kind: Any = None  # FakeOutputKind.DELTA: step() returns each new token; else final outputs only


class FakeOutputKind(enum.Enum):
    """``vllm.sampling_params.RequestOutputKind``'s two kinds the engine uses."""

    DELTA = 1
    FINAL_ONLY = 2


@dataclass(frozen=True)
class FakeLoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str


@dataclass(eq=False)  # compared by identity
class _Req:
    req_id: str
    prompt: list[int]
    params: FakeSamplingParams
    lora: FakeLoRARequest | None
    cache: Any = None
    computed: int = 0
    output: list[int] = field(default_factory=list)
    preempted: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)


class FakeLLM:
    """``generate`` / ``collective_rpc`` / ``model_config`` of ``vllm.LLM`` over an HFEngine's model.

    budget: tokens per step (chunked prefill); preempt_every: every n-th request is preempted
    once, after 3 generated tokens, and recomputed from position 0 (0 = never).
    """

    def __init__(self, hf_engine: Any, budget: int = 48, preempt_every: int = 0) -> None:
        self.hf = hf_engine
        self.runtime = CalibrationRuntime(hf_engine.hidden_size, "cpu")
        self.worker = SimpleNamespace(model_runner=SimpleNamespace(lorazor=self.runtime))
        self.model_config = SimpleNamespace(max_model_len=2048)
        self.budget = budget
        self.preempt_every = preempt_every
        self._ids = itertools.count()
        self.steps = 0
        self.generated = 0  # tokens sampled, aborted requests' included
        self.preemptions = 0
        self._waiting: list[tuple[int, _Req]] = []
        self._running: list[tuple[int, _Req]] = []
        self._finished: list[_Req] = []
        self._admitted = 0
        self.events: list[tuple[int, str, str]] = []  # (step, "added" | "finished", request id)

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return [method(self.worker, *args, **(kwargs or {}))]

    @torch.no_grad()
    def _forward(self, r: _Req, start: int, end: int, lora_ids: np.ndarray) -> torch.Tensor:
        """Run positions [start, end) of ``r`` with per-position LoRA ids; return the last logits."""
        from transformers import DynamicCache

        if r.cache is None:
            r.cache = DynamicCache()
        ids = r.prompt + r.output
        names = {0: BASE, **({r.lora.lora_int_id: r.lora.lora_name} if r.lora else {})}
        logits = None
        cuts = [0, *(np.flatnonzero(np.diff(lora_ids)) + 1).tolist(), end - start]
        for a, b in zip(cuts[:-1], cuts[1:]):
            lo, hi = start + a, start + b
            out = self.hf.forward([names[int(lora_ids[a])]], input_ids=torch.tensor([ids[lo:hi]]),
                                  position_ids=torch.arange(lo, hi)[None], attention_mask=torch.ones(1, hi, dtype=torch.long),
                                  use_cache=True, logits_to_keep=1, **{self.hf._cache_kw: r.cache})
            logits = out.logits[0, -1]
        return logits

    # -- LLMEngine's add_request / has_unfinished_requests / step (what ``llm.llm_engine`` offers) --
    @property
    def llm_engine(self) -> FakeLLM:
        return self

    def add_request(self, request_id, prompt, params, lora_request=None):
        """Queue a request; the runner sees it at the next step (as vLLM's ``_update_states``)."""
        if not self._running and not self._waiting:
            self._admitted = 0  # preempt_every counts requests from the engine's last idle point
        self._waiting.append((self._admitted, _Req(request_id, list(prompt["prompt_token_ids"]), params,
                                                   lora_request)))
        self._admitted += 1
        self.events.append((self.steps, "added", request_id))

    def abort_request(self, request_ids, internal=False):
        """Drop queued or running requests (their KV and runtime state with them)."""
        ids = set(request_ids)
        for r in [r for _, r in self._running + self._waiting if r.req_id in ids]:
            if any(r is q for _, q in self._running):
                self.runtime.finish(r.req_id)
        self._running = [(i, r) for i, r in self._running if r.req_id not in ids]
        self._waiting = [(i, r) for i, r in self._waiting if r.req_id not in ids]

    def has_unfinished_requests(self) -> bool:
        return bool(self._running or self._waiting)

    def _deliver_finished(self) -> None:
        """What the runner learns at a step's start: the last decision, then last step's finishes."""
        self.runtime.resolve()
        for r in self._finished:  # the runner learns of finished requests one step later
            self.runtime.finish(r.req_id)
        self._finished = []

    @torch.no_grad()
    def step(self):
        """One scheduler step; returns the requests that finished in it (final outputs only)."""
        rt = self.runtime
        self._deliver_finished()
        for i, r in self._waiting:
            rt.add(r.req_id, r.lora.lora_name if r.lora else None, r.lora.lora_path if r.lora else None,
                   len(r.prompt), r.params.extra_args)
        self._running += self._waiting
        self._waiting = []
        if not self._running:
            return []
        for i, r in self._running:
            if self.preempt_every and i % self.preempt_every == 0 and not r.preempted and len(r.output) == 3:
                r.preempted, r.computed, r.cache = True, 0, None
                self.preemptions += 1
        rows, left = [], self.budget
        for i, r in self._running:
            n = min(r.num_tokens - r.computed, left)
            if n > 0:
                rows.append((r, n))
                left -= n
        lid = [r.lora.lora_int_id if r.lora else 0 for r, _ in rows]
        tokens = np.concatenate([np.full(n, x) for (_, n), x in zip(rows, lid)])
        m = rt.begin_step([r.req_id for r, _ in rows], np.array([r.computed for r, _ in rows]),
                          np.array([n for _, n in rows]), np.array([r.num_tokens for r, _ in rows]),
                          tuple(tokens), tuple(lid))
        mapping = np.asarray(m.token_mapping)
        captured: dict[str, torch.Tensor] = {}
        hook = self.hf._norm.register_forward_hook(lambda mod, a, out: captured.__setitem__("h", out[:, -1]))
        hidden, logits, off = [], [], 0
        try:
            for r, n in rows:
                logits.append(self._forward(r, r.computed, r.computed + n, mapping[off:off + n]))
                hidden.append(captured["h"][0])
                off += n
        finally:
            hook.remove()
        h = torch.stack(hidden)
        rt.capture(h)
        rt.decide(h)
        self.steps += 1
        for (r, n), lg in zip(rows, logits):
            r.computed += n
            if r.computed < r.num_tokens:
                continue  # a partial prefill chunk samples nothing
            tok = int(lg.argmax())
            r.output.append(tok)
            if tok in r.params.stop_token_ids or len(r.output) >= r.params.max_tokens:
                self._finished.append(r)
        self._running = [(i, r) for i, r in self._running if r not in self._finished]
        self.events += [(self.steps, "finished", r.req_id) for r in self._finished]
        sampled = [r for r, _ in rows if r.computed == r.num_tokens - 1]  # one new token each
        self.generated += len(sampled)
        delta = [r for r in sampled if r.params.output_kind is FakeOutputKind.DELTA]
        return ([SimpleNamespace(request_id=r.req_id, finished=r in self._finished,
                                 outputs=[SimpleNamespace(token_ids=r.output[-1:])]) for r in delta]
                + [SimpleNamespace(request_id=r.req_id, finished=True, outputs=[SimpleNamespace(token_ids=list(r.output))])
                   for r in self._finished if r not in delta])

    def generate(self, prompts, params, lora_request=None, use_tqdm=False):
        """All requests added at once, stepped until done, outputs in input order (``LLM.generate``);
        the runner then also learns of the last finishes (vLLM tells it at the next step)."""
        ids = [str(next(self._ids)) for _ in prompts]
        for rid, p, sp, lr in zip(ids, prompts, params, lora_request, strict=True):
            self.add_request(rid, p, sp, lr)
        done = {}
        while self.has_unfinished_requests():
            done |= {o.request_id: o for o in self.step()}
        self._deliver_finished()
        return [done[rid] for rid in ids]


class EchoBackend:
    """A backend for data-parallel plumbing tests: each request's output is its prompt's last
    max_tokens ids plus the process id; each uid's record names the process."""

    max_model_len = 4096

    def __init__(self, tag: str) -> None:
        self.tag = tag

    def run(self, reqs: list[VLLMRequest], config: dict, desc: str, progress: bool) -> Batch:
        import os

        return Batch([list(r.prompt_ids[-r.max_tokens:]) + [os.getpid()] for r in reqs],
                     {r.uid: {"tag": self.tag, "pid": os.getpid(), "slots": config["slots"]} for r in reqs if r.uid})

    def close(self) -> None:
        pass


def echo_backend(tag: str) -> EchoBackend:
    return EchoBackend(tag)
