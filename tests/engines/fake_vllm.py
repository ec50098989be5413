"""A CPU stand-in for ``vllm.LLM`` that runs the real LoRazor calibration runtime.

It does what the bridge's runner (``serve_bridge.vllm_hooks``) does inside vLLM 0.26, on the
hf engine's peft model: requests are added to a :class:`CalibrationRuntime` with their
``SamplingParams.extra_args``; each step schedules chunked prefills under a token budget and
one-token decodes (and, optionally, a preemption recompute), hands the LoRA mapping to
``begin_step``, applies the *masked* mapping position by position (runs of positions with the
same LoRA id are one model call on the request's own KV cache), collects the final-norm
hidden state of each row's last scheduled position, calls ``capture`` and ``decide`` on
them, and samples greedily. Finished requests reach the runtime at the next step, as in
vLLM. So :class:`labeling.engines.vllm.VLLMEngine` can be tested end to end on CPU against
the hf engine; only vLLM's kernels are missing.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from labeling.engines.hf import BASE
from labeling.engines.vllm import Batch, VLLMRequest
from serve_bridge.calibration import CalibrationRuntime


@dataclass
class FakeSamplingParams:
    temperature: float = 1.0
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    detokenize: bool = True
    extra_args: dict | None = None


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
        self.preemptions = 0

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
            kw = {"adapter_names": [names[int(lora_ids[a])]]} if self.hf.adapters else {}
            out = self.hf.model(input_ids=torch.tensor([ids[lo:hi]]), position_ids=torch.arange(lo, hi)[None],
                                attention_mask=torch.ones(1, hi, dtype=torch.long), use_cache=True, logits_to_keep=1,
                                **{self.hf._cache_kw: r.cache}, **kw)
            logits = out.logits[0, -1]
        return logits

    def generate(self, prompts, params, lora_request=None, use_tqdm=False):
        reqs = [_Req(str(next(self._ids)), list(p["prompt_token_ids"]), sp, lr)
                for p, sp, lr in zip(prompts, params, lora_request, strict=True)]
        rt = self.runtime
        captured: dict[str, torch.Tensor] = {}
        hook = self.hf._norm.register_forward_hook(lambda m, a, out: captured.__setitem__("h", out[:, -1]))
        running, finished = [], []
        try:
            for i, r in enumerate(reqs):  # all admitted at once (the scheduler's first steps)
                rt.add(r.req_id, r.lora.lora_name if r.lora else None, r.lora.lora_path if r.lora else None,
                       len(r.prompt), r.params.extra_args)
                running.append((i, r))
            while running or finished:
                rt.resolve()
                for r in finished:  # the runner learns of finished requests one step later
                    rt.finish(r.req_id)
                finished = []
                if not running:
                    break
                for i, r in running:
                    if (self.preempt_every and i % self.preempt_every == 0 and not r.preempted
                            and len(r.output) == 3):
                        r.preempted, r.computed, r.cache = True, 0, None
                        self.preemptions += 1
                rows, left = [], self.budget
                for i, r in running:
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
                hidden, logits, off = [], [], 0
                for r, n in rows:
                    logits.append(self._forward(r, r.computed, r.computed + n, mapping[off:off + n]))
                    hidden.append(captured["h"][0])
                    off += n
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
                        finished.append(r)
                running = [(i, r) for i, r in running if r not in finished]
        finally:
            hook.remove()
        return [SimpleNamespace(request_id=r.req_id, outputs=[SimpleNamespace(token_ids=list(r.output))])
                for r in reqs]


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
