"""Per-request StepTrim release inside a serving engine, without the engine (DESIGN §2, §4).

The engine glue (:mod:`serve_bridge.vllm_hooks`) feeds this module plain arrays; all
release logic lives here and is tested on CPU. Release decisions themselves come only
from :class:`serve_bridge.steptrim.StepTrim`.

Positions and forwards. A request with P prompt tokens has its prompt at positions
0 … P−1 and its generated token j (1-based) at position P+j−1. A step that schedules
positions [c, c+n) *completes a forward* when c+n equals the request's token count (prompt
plus tokens generated so far); that forward is t = c+n−P: the prefill (t = 0), a decode
step, or the recompute of a preempted request (t = its generated-token count). A step
that ends earlier is a partial prefill chunk; it produces no token and no decision.

Release position. A request released at r (adapter on at forwards t ≤ r) runs forward
t > r, which consumes the token at position P+t−1 ≥ P+r, without its adapter. Masking
every position ≥ P+r to "no adapter" — in every step, whichever forward it belongs to —
is therefore exact under chunked prefill and under preemption recompute.
"""
from __future__ import annotations

import logging
import os
import time
import warnings
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from serve_bridge.bundle import Bundle, BundleError, BundleWarning, adapter_fingerprint, load_bundle
from serve_bridge.settings import BridgeSettings
from serve_bridge.steptrim import NO_SLOT, StepTrim

# A child of vLLM's "vllm" logger, so records go wherever vLLM's logging sends them.
logger = logging.getLogger("vllm.lorazor")

NEVER = np.iinfo(np.int64).max  # release position of a request that is not released
NO_ADAPTER = 0  # vLLM's LoRA id for "no adapter" in a token→LoRA mapping


def mask_released(token_mapping: np.ndarray, sampled_mapping: np.ndarray, num_computed: np.ndarray,
                  num_scheduled: np.ndarray, release_pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Map every scheduled position at or after its request's release position to no adapter.

    token_mapping [Σn]: LoRA id per scheduled token, requests in batch order.
    sampled_mapping [R]: LoRA id per request's sampled (last scheduled) position.
    num_computed [R], num_scheduled [R]: request i schedules positions
    [num_computed[i], num_computed[i] + num_scheduled[i]).
    release_pos [R]: first position without adapter (:data:`NEVER` if not released).
    Returns new (token_mapping, sampled_mapping); the inputs are not modified.
    """
    num_scheduled = np.asarray(num_scheduled, dtype=np.int64)
    total = int(num_scheduled.sum())
    if len(token_mapping) != total or len(sampled_mapping) != len(num_scheduled):
        raise ValueError(f"mapping sizes ({len(token_mapping)} tokens, {len(sampled_mapping)} sampled) do not "
                         f"match the schedule ({total} tokens, {len(num_scheduled)} requests)")
    row = np.repeat(np.arange(len(num_scheduled)), num_scheduled)
    first = np.cumsum(num_scheduled) - num_scheduled
    position = np.asarray(num_computed, dtype=np.int64)[row] + (np.arange(total) - first[row])
    release_pos = np.asarray(release_pos, dtype=np.int64)
    tokens = np.where(position >= release_pos[row], NO_ADAPTER, token_mapping)
    last = np.asarray(num_computed, dtype=np.int64) + num_scheduled - 1
    sampled = np.where(last >= release_pos, NO_ADAPTER, sampled_mapping)
    return tokens, sampled


def lora_group_count(token_mapping: np.ndarray) -> int:
    """Distinct LoRA groups the kernels see: adapters plus the no-adapter group if present.

    0 when no token has an adapter (the batch needs no LoRA kernel at all). This is the
    count vLLM's kernel metadata uses for its launch grid; an adapter-count CUDA graph
    must be chosen with it, not with the number of adapters (DESIGN §4).
    """
    ids = np.unique(np.asarray(token_mapping))
    if not (ids != NO_ADAPTER).any():
        return 0
    return int(ids.size)


@dataclass
class RequestState:
    """Release state of one request, created when it is added and dropped when it finishes.

    adapter: its adapter name (None: a base-model request). slot: the adapter's StepTrim
    slot, or NO_SLOT when it must never be released. release: r once released (one-way).
    forwards: forwards completed so far (the last one was t = forwards − 1).
    """

    adapter: str | None
    slot: int
    num_prompt_tokens: int
    release: int | None = None
    forwards: int = 0

    @property
    def release_position(self) -> int:
        """First position that runs without the adapter (:data:`NEVER` if not released)."""
        return NEVER if self.release is None else self.num_prompt_tokens + self.release


@dataclass
class AdapterCounters:
    """Realized counts for one adapter, from the mappings handed to the engine."""

    requests: int = 0
    released: int = 0
    decode_forwards: int = 0
    skipped_forwards: int = 0

    def as_dict(self) -> dict[str, float]:
        return {"requests": self.requests, "released": self.released, "decode_forwards": self.decode_forwards,
                "skipped_forwards": self.skipped_forwards,
                "skip_fraction": self.skipped_forwards / self.decode_forwards if self.decode_forwards else 0.0}


@dataclass
class StepMapping:
    """The LoRA mapping for one step after release masking, and its kernel group count."""

    token_mapping: Sequence[int]
    sampled_mapping: Sequence[int]
    lora_groups: int


@dataclass
class _Plan:
    """Rows of the current step that completed a forward and may be released after it."""

    num_rows: int
    rows: list[int] = field(default_factory=list)
    states: list[RequestState] = field(default_factory=list)
    forwards: list[int] = field(default_factory=list)


@dataclass
class _Pending:
    """A launched decision whose result is read back before the next step."""

    states: list[RequestState]
    forwards: list[int]
    fired: torch.Tensor
    events: tuple[Any, Any] | None
    host_ms: float


class ReleaseRuntime:
    """Request states, release masking, batched decisions and counters for one model runner.

    bundle: the loaded bundle; steptrim: a StepTrim whose slot i is ``slot_names[i]``;
    verified: adapter name → local adapter path whose weights already matched the bundle.
    """

    def __init__(self, bundle: Bundle, steptrim: StepTrim, slot_names: Sequence[str],
                 verified: Mapping[str, str] | None = None, log_interval_s: float = 60.0,
                 finished_capacity: int = 65536) -> None:
        self.bundle = bundle
        self.steptrim = steptrim
        self.slot_of = {name: i for i, name in enumerate(slot_names)}
        self._verified: dict[tuple[str, str], bool] = {(n, _norm(p)): True for n, p in (verified or {}).items()}
        self._warned: set[str] = set()
        self.states: dict[str, RequestState] = {}
        self.adapters: dict[str, AdapterCounters] = {}
        self.finished_log: deque[dict[str, Any]] = deque(maxlen=finished_capacity)
        self.steps = self.decision_steps = self.decided_rows = 0
        self.decision_ms = self.mapping_ms = 0.0
        self.log_interval_s = log_interval_s
        self._last_log = time.monotonic()
        self._plan: _Plan | None = None
        self._pending: _Pending | None = None

    # -- request lifecycle -------------------------------------------------------------
    def add(self, req_id: str, adapter: str | None, adapter_path: str | None, num_prompt_tokens: int) -> None:
        """Track a new request (a request already tracked keeps its state)."""
        if req_id in self.states:
            return
        slot = NO_SLOT if adapter is None else self._slot(adapter, adapter_path)
        self.states[req_id] = RequestState(adapter=adapter, slot=slot, num_prompt_tokens=int(num_prompt_tokens))
        if adapter is not None:
            self.adapters.setdefault(adapter, AdapterCounters()).requests += 1

    def finish(self, req_id: str) -> None:
        """Drop a finished (or aborted) request, keeping a record in :attr:`finished_log`."""
        self.resolve()
        st = self.states.pop(req_id, None)
        if st is not None:
            self.finished_log.append({"req_id": req_id, "adapter": st.adapter, "forwards": st.forwards,
                                      "release": st.release})

    def _slot(self, adapter: str, path: str | None) -> int:
        """The adapter's StepTrim slot, or NO_SLOT (full LoRA, with one warning) when unusable."""
        entry = self.bundle.adapters.get(adapter)
        if entry is None:
            self._warn_once(adapter, f"adapter '{adapter}' has no policy in bundle {self.bundle.path}: it runs "
                                     f"full LoRA (never released).")
            return NO_SLOT
        key = (adapter, _norm(path or ""))
        if key not in self._verified:
            self._verified[key] = _weights_match(key[1], entry.weights_sha256)
        if not self._verified[key]:
            self._warn_once(adapter, f"adapter '{adapter}' at {path!r}: its weights could not be read from a local "
                                     f"directory or differ from those calibrated in {self.bundle.path}; it runs "
                                     f"full LoRA (never released). Serve the calibrated adapter from a local path.")
            return NO_SLOT
        return self.slot_of[adapter]

    def _warn_once(self, adapter: str, message: str) -> None:
        if adapter not in self._warned:
            self._warned.add(adapter)
            logger.warning(message)

    # -- one engine step -------------------------------------------------------------
    def begin_step(self, req_ids: Sequence[str], num_computed: np.ndarray, num_scheduled: np.ndarray,
                   num_tokens: np.ndarray, token_mapping: Sequence[int],
                   sampled_mapping: Sequence[int]) -> StepMapping:
        """Mask the step's LoRA mapping by release position, count forwards, plan decisions.

        req_ids [R] in batch order; num_computed, num_scheduled [R] as in
        :func:`mask_released`; num_tokens [R]: prompt plus generated tokens of each request.
        token_mapping [Σn] / sampled_mapping [R]: the engine's LoRA ids (0 = no adapter).
        """
        start = time.perf_counter()
        self.resolve()
        n_rows = len(req_ids)
        states = [self.states.get(r) for r in req_ids]
        release_pos = np.array([NEVER if s is None else s.release_position for s in states], dtype=np.int64)
        sampled = np.asarray(sampled_mapping)
        if (release_pos != NEVER).any():
            tokens, sampled = mask_released(np.asarray(token_mapping), sampled, num_computed, num_scheduled,
                                            release_pos)
            mapping = StepMapping(tokens, sampled, lora_group_count(tokens))
        else:
            mapping = StepMapping(token_mapping, sampled_mapping, lora_group_count(np.asarray(token_mapping)))
        end = np.asarray(num_computed, dtype=np.int64) + np.asarray(num_scheduled, dtype=np.int64)
        plan = _Plan(num_rows=n_rows)
        for i, st in enumerate(states):
            if st is None or end[i] < num_tokens[i]:
                continue  # untracked, or a partial prefill chunk: no forward completes
            t = int(end[i]) - st.num_prompt_tokens
            st.forwards = max(st.forwards, t + 1)
            if st.adapter is not None and t >= 1:
                c = self.adapters[st.adapter]
                c.decode_forwards += 1
                c.skipped_forwards += int(sampled[i] == NO_ADAPTER)
            if st.slot != NO_SLOT and st.release is None:
                plan.rows.append(i)
                plan.states.append(st)
                plan.forwards.append(t)
        self._plan = plan if plan.rows else None
        self.steps += 1
        self.mapping_ms += (time.perf_counter() - start) * 1e3
        return mapping

    def decide(self, hidden: torch.Tensor) -> None:
        """Launch this step's decisions on ``hidden`` [R, H], the final-norm hidden states of
        the sampled positions in batch order; they take effect from the next step on."""
        plan, self._plan = self._plan, None
        if plan is None:
            return
        if hidden.shape[0] != plan.num_rows:
            logger.warning("StepTrim skipped a step: %d hidden rows for %d requests.", hidden.shape[0],
                           plan.num_rows)
            return
        start = time.perf_counter()
        events = None
        if hidden.is_cuda:
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        meta = torch.tensor([plan.rows, [s.slot for s in plan.states], plan.forwards], dtype=torch.long)
        if hidden.is_cuda:  # pinned, so the copy is queued behind the forward instead of waiting for it
            meta = meta.pin_memory()
        meta = meta.to(hidden.device, non_blocking=True)
        released = torch.zeros(len(plan.rows), dtype=torch.bool, device=hidden.device)
        rows_hidden = hidden.index_select(0, meta[0]) if self.steptrim.needs_hidden else None
        fired = self.steptrim.step(meta[1], meta[2], released, rows_hidden)
        fired = fired.to("cpu", non_blocking=True)
        if events is not None:
            events[1].record()
        self._pending = _Pending(plan.states, plan.forwards, fired, events, (time.perf_counter() - start) * 1e3)

    def resolve(self) -> None:
        """Apply the last launched decision (waits for it); idempotent."""
        p, self._pending = self._pending, None
        if p is None:
            return
        if p.events is not None:
            p.events[1].synchronize()
            ms = p.events[0].elapsed_time(p.events[1])
        else:
            ms = p.host_ms
        for st, t, fire in zip(p.states, p.forwards, p.fired.tolist()):
            if fire:  # planned rows are unreleased, so release stays one-way
                st.release = t
                self.adapters[st.adapter].released += 1
        self.decision_steps += 1
        self.decided_rows += len(p.states)
        self.decision_ms += ms

    # -- read-out ----------------------------------------------------------------------
    def counters(self) -> dict[str, Any]:
        """All counters as plain data (what ``LLM.collective_rpc`` returns)."""
        self.resolve()
        decode = sum(c.decode_forwards for c in self.adapters.values())
        skipped = sum(c.skipped_forwards for c in self.adapters.values())
        return {
            "active_requests": len(self.states),
            "requests": sum(c.requests for c in self.adapters.values()),
            "released_requests": sum(c.released for c in self.adapters.values()),
            "decode_forwards": decode, "skipped_forwards": skipped,
            "skip_fraction": skipped / decode if decode else 0.0,
            "steps": self.steps, "decision_steps": self.decision_steps, "decided_rows": self.decided_rows,
            "decision_ms_total": self.decision_ms,
            "decision_ms_mean": self.decision_ms / self.decision_steps if self.decision_steps else 0.0,
            "mapping_ms_total": self.mapping_ms,
            "adapters": {name: c.as_dict() for name, c in sorted(self.adapters.items())},
        }

    def summary(self) -> str:
        """One log line of the main counters."""
        c = self.counters()
        return (f"LoRazor StepTrim: {c['requests']} adapter requests, {c['released_requests']} released, skip "
                f"{c['skip_fraction']:.3f} of {c['decode_forwards']} decode forwards, decision "
                f"{c['decision_ms_mean']:.3f} ms/step over {c['decision_steps']} steps")

    def maybe_log(self, now: float | None = None) -> None:
        """Log :meth:`summary` when the log interval has passed since the last one."""
        now = time.monotonic() if now is None else now
        if self.log_interval_s > 0 and now - self._last_log >= self.log_interval_s:
            self._last_log = now
            logger.info(self.summary())


def _norm(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path)) if path else ""


def _weights_match(path: str, sha256: str) -> bool:
    """True iff ``path`` is a local adapter whose weights file has this sha256."""
    try:
        return bool(path) and adapter_fingerprint(path) == sha256
    except (BundleError, OSError):
        return False


def build_runtime(settings: BridgeSettings, hidden_size: int, device: torch.device | str) -> ReleaseRuntime:
    """Load and check the bundle for a model of ``hidden_size``; one BundleError on the first problem.

    With ``settings.adapters`` the bundle must not name an unserved adapter, and each
    served adapter in the bundle must have the calibrated weights. A served adapter the
    bundle lacks runs full LoRA, with a warning.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", BundleWarning)
        bundle = load_bundle(settings.bundle, expected_hidden_size=hidden_size,
                             known_adapters=list(settings.adapters) or None)
    for w in caught:
        logger.warning(str(w.message))
    verified = {}
    for name, path in settings.adapters.items():
        entry = bundle.adapters.get(name)
        if entry is None:
            continue
        if adapter_fingerprint(_norm(path)) != entry.weights_sha256:
            raise BundleError(f"{_norm(path)}: the weights of adapter '{name}' differ from those calibrated in "
                              f"{bundle.path} (manifest 'weights_sha256'): serve the calibrated adapter or "
                              f"re-calibrate this one.")
        verified[name] = path
    names = sorted(bundle.adapters)
    steptrim = StepTrim([bundle.policies[n] for n in names], bundle.hidden_size, device)
    return ReleaseRuntime(bundle, steptrim, names, verified, settings.log_interval_s)
