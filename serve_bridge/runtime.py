"""Per-request StepTrim release inside a serving engine, without the engine (docs/design.md §2, §4).

The engine glue (:mod:`serve_bridge.vllm.model_runner`) feeds this module plain arrays; all
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

Per-request arguments. A request may hold, in ``SamplingParams.extra_args``::

    {"lorazor": {"uid": "q17@0", "release_position": 412}}

both keys optional (:func:`request_args`). ``release_position`` P is a *forced release*: every
position ≥ P runs without the adapter, by the same masking, and the request takes no StepTrim
decision. It may lie inside the prompt: an OFF_t branch replayed as prompt + the first t+1 ON
tokens has P = its prompt length − 1, so the prefill applies the adapter to exactly the
positions the ON request consumed with it (forwards ≤ t) and runs the last token, consumed
by forward t+1, without it. ``uid`` names the request in the calibration runtime's records
(:mod:`serve_bridge.calibration`); serving ignores it. Malformed arguments are logged and
ignored (the request runs as if it had none).
"""
from __future__ import annotations

import logging
import math
import os
import time
import warnings
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from serve_bridge.bundle import (Bundle, BundleError, BundleWarning, adapter_fingerprint, adapter_weights_file,
                                 load_bundle)
from serve_bridge.decision import DecisionLauncher, Launched
from serve_bridge.steptrim import NO_SLOT, ProfiledPolicy, StepTrim

# A child of vLLM's "vllm" logger, so records go wherever vLLM's logging sends them.
logger = logging.getLogger("vllm.lorazor")

NEVER = np.iinfo(np.int64).max  # release position of a request that is not released
NO_ADAPTER = 0  # vLLM's LoRA id for "no adapter" in a token→LoRA mapping
REQUEST_ARGS_KEY = "lorazor"  # SamplingParams.extra_args[REQUEST_ARGS_KEY] = {"uid", "release_position"}
_REQUEST_ARG_NAMES = ("uid", "release_position")


def request_args(extra_args: Mapping[str, Any] | None) -> tuple[str | None, int | None]:
    """(uid, forced release position) from a request's ``SamplingParams.extra_args``.

    ``extra_args[REQUEST_ARGS_KEY]`` is a mapping with optional ``uid`` (a string) and
    ``release_position`` (an int ≥ 0, an absolute token position). Absent → (None, None).
    Raises ValueError naming the problem on anything else.
    """
    spec = (extra_args or {}).get(REQUEST_ARGS_KEY)
    if spec is None:
        return None, None
    if not isinstance(spec, Mapping):
        raise ValueError(f"extra_args[{REQUEST_ARGS_KEY!r}] must be a mapping with keys {_REQUEST_ARG_NAMES}, got "
                         f"{type(spec).__name__}")
    unknown = sorted(set(spec) - set(_REQUEST_ARG_NAMES))
    if unknown:
        raise ValueError(f"extra_args[{REQUEST_ARGS_KEY!r}] has unknown keys {unknown}; known: {_REQUEST_ARG_NAMES}")
    uid, pos = spec.get("uid"), spec.get("release_position")
    if uid is not None and not isinstance(uid, str):
        raise ValueError(f"extra_args[{REQUEST_ARGS_KEY!r}]['uid'] must be a string, got {uid!r}")
    if pos is not None and (isinstance(pos, bool) or not isinstance(pos, (int, np.integer)) or pos < 0):
        raise ValueError(f"extra_args[{REQUEST_ARGS_KEY!r}]['release_position'] must be an int ≥ 0 (an absolute "
                         f"token position), got {pos!r}")
    return uid, None if pos is None else int(pos)


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
    must be chosen with it, not with the number of adapters (docs/design.md §4).
    """
    return step_mapping(token_mapping, ()).lora_groups


def step_mapping(token_mapping: Sequence[int] | np.ndarray, sampled_mapping: Sequence[int]) -> StepMapping:
    """A step's (masked) mapping with its group count and used adapter ids (one np.unique)."""
    ids = np.unique(np.asarray(token_mapping))
    used = ids[ids != NO_ADAPTER].tolist()
    return StepMapping(token_mapping, sampled_mapping, int(ids.size) if used else 0, used)


def lora_ids(mapping: Sequence[int] | np.ndarray) -> tuple[int, ...]:
    """A LoRA mapping as the tuple of Python ints vLLM's ``LoRAMapping`` is typed with; vLLM loops
    over it element by element, where numpy scalars are slower (docs/vllm_integration.md §2)."""
    return tuple(np.asarray(mapping).tolist())


@dataclass
class RequestState:
    """Release state of one request, created when it is added and dropped when it finishes.

    adapter: its adapter name (None: a base-model request). slot: the adapter's StepTrim
    slot, or NO_SLOT when it must never be released. release: r once released (one-way).
    forwards: forwards completed so far (the last one was t = forwards − 1).
    uid: the request's calibration name (``extra_args``), if any.
    forced_release_position: a forced release (``extra_args``): positions ≥ it run without
    the adapter, and the request takes no decision.
    profiled: its adapter's profiled policy, whose rule (:meth:`ProfiledPolicy.fires`) is applied
    on the host when a forward is planned (no decision to launch or wait for).
    margins: t → s_t − τ of each learned decision after forward t, kept only while the runtime
    records them (:attr:`ReleaseRuntime.record_margins`).
    """

    adapter: str | None
    slot: int
    num_prompt_tokens: int
    release: int | None = None
    forwards: int = 0
    uid: str | None = None
    forced_release_position: int | None = None
    profiled: ProfiledPolicy | None = None
    margins: dict[int, float] = field(default_factory=dict)

    def record(self, req_id: str) -> dict[str, Any]:
        """The request's read-out (:func:`serve_bridge.vllm.rpc.lorazor_requests`), plain data."""
        return {"req_id": req_id, "adapter": self.adapter, "forwards": self.forwards, "release": self.release,
                "margins": sorted(self.margins.items())}

    @property
    def release_position(self) -> int:
        """First position that runs without the adapter (:data:`NEVER` if not released)."""
        pos = NEVER if self.release is None else self.num_prompt_tokens + self.release
        if self.forced_release_position is not None:
            pos = min(pos, self.forced_release_position)
        return pos

    @property
    def releasable(self) -> bool:
        """Whether its policy may still release it: it has a StepTrim slot, is not released yet
        and takes no forced release."""
        return self.slot != NO_SLOT and self.release is None and self.forced_release_position is None

    @property
    def decides(self) -> bool:
        """Whether StepTrim's decision launch still decides for this request after its next
        forward (a profiled policy is applied on the host)."""
        return self.releasable and self.profiled is None


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
    """The LoRA mapping for one step after release masking, its kernel group count, and the
    LoRA ids its positions still use (the adapters that must be resident)."""

    token_mapping: Sequence[int]
    sampled_mapping: Sequence[int]
    lora_groups: int
    adapter_ids: list[int]


def rows_match(plan: Any, hidden: torch.Tensor, what: str) -> bool:
    """Whether a step's ``plan`` (None: nothing to do) may use ``hidden``: one row per request
    of the step (``plan.num_rows``); a mismatch skips the step with a warning."""
    if plan is None:
        return False
    if hidden.shape[0] != plan.num_rows:
        logger.warning("%s skipped a step: %d hidden rows for %d requests.", what, hidden.shape[0], plan.num_rows)
        return False
    return True


@dataclass
class _Plan:
    """Rows of the current step that completed a forward and may be released after it."""

    num_rows: int
    rows: list[int] = field(default_factory=list)
    states: list[RequestState] = field(default_factory=list)
    forwards: list[int] = field(default_factory=list)
    req_ids: list[str] = field(default_factory=list)


@dataclass
class _Pending:
    """A launched decision (its result sits in the launcher) to apply before the next step."""

    states: list[RequestState]
    forwards: list[int]
    req_ids: list[str]
    host_ms: float  # engine-thread time spent in decide()

    def new_releases(self, fired: np.ndarray, steptrim: StepTrim) -> Iterator[tuple[RequestState, str, int]]:
        """(state, req_id, r) of each row that ``fired`` whose request has no release yet: the
        earliest firing decision wins, since release is one-way; r from ``steptrim``'s lag."""
        for i in np.flatnonzero(fired).tolist():
            st = self.states[i]
            if st.release is None:
                yield st, self.req_ids[i], steptrim.release_point(st.slot, self.forwards[i])


class ReleasePreview:
    """The releases that launched, still unread decisions will make, read once the GPU has run
    them: what an asynchronous step output can bring the scheduler a step before
    :meth:`ReleaseRuntime.take_releases` does (docs/vllm_integration.md §11, learned releases).

    Semantics: req_id → r for each row that fired and whose request had no release when
    :meth:`releases` ran, the earliest of the decisions firing, r from the StepTrim that launched
    it: exactly what reading those decisions in order will release, since a request's release
    comes from its earliest firing decision and every older one was read before the preview was
    taken. It only reads runtime state, so it may run on another thread than the runner (vLLM's
    output thread under multiprocessing), before the launcher's lanes are reused ``depth``
    launches later.
    """

    def __init__(self, pending: Iterable[tuple[_Pending, Launched]], steptrim: StepTrim) -> None:
        self._pending = list(pending)
        self._steptrim = steptrim

    def releases(self) -> dict[str, int]:
        """Wait for the decisions (each behind its own step's forward) and return their releases."""
        out: dict[str, int] = {}
        for p, launched in self._pending:
            for _, req_id, r in p.new_releases(launched.fired(), self._steptrim):
                out.setdefault(req_id, r)
        return out


class ReleaseRuntime:
    """Request states, release masking, batched decisions and counters for one model runner.

    bundle: the loaded bundle; steptrim: a StepTrim whose slot i is ``slot_names[i]``;
    verified: adapter name → local adapter path whose weights already matched the bundle.
    """

    def __init__(self, bundle: Bundle, steptrim: StepTrim, slot_names: Sequence[str],
                 verified: Mapping[str, str] | None = None, log_interval_s: float = 60.0,
                 finished_capacity: int = 65536, max_rows: int = 256, cuda_graphs: bool = True,
                 latency_window: int = 4096) -> None:
        self.bundle = bundle
        self.steptrim = steptrim
        self.slot_of = {name: i for i, name in enumerate(slot_names)}
        self._warned: set[str] = set()
        self.calibrated = CalibratedAdapters(bundle, verified, self._warn_once)
        self.states: dict[str, RequestState] = {}
        self.adapters: dict[str, AdapterCounters] = {}
        # (req_id, state) of finished requests, oldest first; read as records after resolve(), so
        # that decisions read after a request finished are in its record
        self.finished_log: deque[tuple[str, RequestState]] = deque(maxlen=finished_capacity)
        self.steps = self.decision_steps = self.decided_rows = 0
        self.decision_ms = self.mapping_ms = 0.0
        self.log_interval_s = log_interval_s
        self._last_log = time.monotonic()
        self._plan: _Plan | None = None
        self._pending: deque[_Pending] = deque()  # launched decisions, oldest first
        # (batch row, state, t) of the rows of the last begun step that completed forward t
        self.completed: list[tuple[int, RequestState, int]] = []
        # with report_releases (slot hand-back): req_id → r of the releases decided since the
        # last take_releases()
        self.report_releases = False
        self.new_releases: dict[str, int] = {}
        # decisions: preallocated buffers for up to max_rows rows (more on demand), optionally
        # replayed as CUDA graphs; latency samples (ms) of the last latency_window decisions.
        self._launcher_args = {"max_rows": max_rows, "cuda_graphs": cuda_graphs}
        self._launcher = self._new_launcher(steptrim)
        self._lat_decide: deque[float] = deque(maxlen=latency_window)  # host, in decide()
        self._lat_resolve: deque[float] = deque(maxlen=latency_window)  # host, in resolve()
        self._lat_gpu: deque[float] = deque(maxlen=latency_window)  # GPU events (host decide off CUDA)

    def set_steptrim(self, steptrim: StepTrim, slot_names: Sequence[str]) -> None:
        """Decide with ``steptrim`` (slot i is ``slot_names[i]``) for the requests added from now
        on; the decision launcher holds its StepTrim (buffers, CUDA graphs), so it is rebuilt."""
        self.resolve()
        self.steptrim = steptrim
        self.slot_of = {name: i for i, name in enumerate(slot_names)}
        record = self.record_margins
        self._launcher = self._new_launcher(steptrim)
        self.record_margins = record

    def _new_launcher(self, steptrim: StepTrim) -> DecisionLauncher:
        """The launcher for ``steptrim``: :attr:`hold` + 1 decisions may be in flight."""
        return DecisionLauncher(steptrim, depth=steptrim.min_lag + 1, **self._launcher_args)

    @property
    def hold(self) -> int:
        """Launched decisions that may stay unread when a step is planned or its releases are
        reported: the smallest decision lag of the learned policies. A decision after forward t
        releases at r = t + lag, so with lag ≥ 1 the next forward runs with the adapter whatever it
        decided, and reading it can wait a step (under async scheduling, until the GPU has long
        finished it) without changing any release."""
        return self.steptrim.min_lag

    @property
    def record_margins(self) -> bool:
        """Whether each learned decision's s_t − τ is kept in its request's state (off by default:
        a device-to-host read per step; for checks that tell a decision near-tie from a fault)."""
        return self._launcher.keep_scores

    @record_margins.setter
    def record_margins(self, on: bool) -> None:
        self._launcher.keep_scores = bool(on)

    # -- request lifecycle -------------------------------------------------------------
    def add(self, req_id: str, adapter: str | None, adapter_path: str | None, num_prompt_tokens: int,
            extra_args: Mapping[str, Any] | None = None) -> None:
        """Track a new request (a request already tracked keeps its state).

        extra_args: the request's ``SamplingParams.extra_args`` (uid, forced release; see
        :func:`request_args`); malformed arguments are logged once per message and ignored.
        """
        if req_id in self.states:
            return
        try:
            uid, forced = request_args(extra_args)
        except ValueError as err:
            self._warn_once(f"request-args:{err}", f"request {req_id}: {err}; the request runs without them.")
            uid, forced = None, None
        slot = NO_SLOT if adapter is None else self._slot(adapter, adapter_path)
        policy = None if slot == NO_SLOT else self.steptrim.policies[slot]
        self.states[req_id] = RequestState(adapter=adapter, slot=slot, num_prompt_tokens=int(num_prompt_tokens),
                                           uid=uid, forced_release_position=forced,
                                           profiled=policy if isinstance(policy, ProfiledPolicy) else None)
        if adapter is not None:
            self.adapters.setdefault(adapter, AdapterCounters()).requests += 1

    def finish(self, req_id: str) -> None:
        """Drop a finished (or aborted) request, keeping its state in :attr:`finished_log`; its
        decisions still in flight are read later, as if it were still tracked."""
        st = self.states.pop(req_id, None)
        if st is not None:
            self.finished_log.append((req_id, st))

    def _slot(self, adapter: str, path: str | None) -> int:
        """The adapter's StepTrim slot, or NO_SLOT (full LoRA, with one warning) when unusable."""
        return self.slot_of[adapter] if self.calibrated.check(adapter, path) else NO_SLOT

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
        self.resolve(self.hold)
        n_rows = len(req_ids)
        states = [self.states.get(r) for r in req_ids]
        release_pos = np.array([NEVER if s is None else s.release_position for s in states], dtype=np.int64)
        sampled = np.asarray(sampled_mapping)
        if (release_pos != NEVER).any():
            tokens, sampled = mask_released(np.asarray(token_mapping), sampled, num_computed, num_scheduled,
                                            release_pos)
            mapping = step_mapping(tokens, sampled)
        else:
            mapping = step_mapping(token_mapping, sampled_mapping)
        end = np.asarray(num_computed, dtype=np.int64) + np.asarray(num_scheduled, dtype=np.int64)
        # Rows whose forward completes (a partial prefill chunk does not), found with numpy; the
        # per-row Python below reads plain lists (numpy scalar access costs ~5× more per row).
        done = np.flatnonzero(end >= np.asarray(num_tokens, dtype=np.int64)).tolist()
        end_at = end.tolist()
        no_adapter = (np.asarray(sampled) == NO_ADAPTER).tolist()
        plan = _Plan(num_rows=n_rows)
        completed: list[tuple[int, RequestState, int]] = []
        for i in done:
            st = states[i]
            if st is None:
                continue  # untracked
            t = end_at[i] - st.num_prompt_tokens
            completed.append((i, st, t))
            if st.forwards <= t:
                st.forwards = t + 1
            if st.adapter is not None and t >= 1:
                c = self.adapters[st.adapter]
                c.decode_forwards += 1
                c.skipped_forwards += no_adapter[i]
            if st.decides:
                plan.rows.append(i)
                plan.states.append(st)
                plan.forwards.append(t)
                plan.req_ids.append(req_ids[i])
            elif st.releasable and st.profiled is not None and st.profiled.fires(t):
                self._release(st, t, req_ids[i])  # r = t: from the next forward on, as a lag-0 decision
        self.completed = completed
        self._plan = plan if plan.rows else None
        self.steps += 1
        self.mapping_ms += (time.perf_counter() - start) * 1e3
        return mapping

    def wants_hidden(self) -> bool:
        """Whether this step's :meth:`decide` has rows to decide (a runner that must gather the
        sampled rows' hidden states first can skip that when it has none)."""
        return self._plan is not None

    def decide(self, hidden: torch.Tensor) -> None:
        """Launch this step's decisions on ``hidden`` [R, H], the final-norm hidden states of
        the sampled positions in batch order; a row that fires after forward t is released at
        r = t + its policy's lag (:meth:`StepTrim.release_point`), so its adapter runs through
        forward r."""
        plan, self._plan = self._plan, None
        if not rows_match(plan, hidden, "StepTrim"):
            return
        self.resolve(self._launcher.depth - 1)  # room for this launch (begin_step has normally made it)
        start = time.perf_counter()
        self._launcher.launch(plan.rows, [s.slot for s in plan.states], plan.forwards, hidden)
        self._pending.append(_Pending(plan.states, plan.forwards, plan.req_ids, (time.perf_counter() - start) * 1e3))

    def warm_up(self, hidden: torch.Tensor) -> None:
        """Compile and capture the decision launcher's work for hidden states like ``hidden``
        before serving (:meth:`DecisionLauncher.warm_up`; nothing to do off CUDA)."""
        start = time.perf_counter()
        if n := self._launcher.warm_up(hidden):
            logger.info("LoRazor StepTrim decisions warmed up: %d row buckets, %s, %.2f s.", n, self._launcher.mode,
                        time.perf_counter() - start)

    def resolve(self, keep: int = 0) -> None:
        """Apply launched decisions, oldest first, until at most ``keep`` are unread (waits for
        each one it reads); idempotent."""
        while len(self._pending) > keep:
            self._apply(self._pending.popleft())

    def _apply(self, p: _Pending) -> None:
        """Read one launched decision and release its fired rows (those still tracked)."""
        start = time.perf_counter()
        fired, gpu_ms = self._launcher.result()
        if self.record_margins:
            slots = torch.tensor([st.slot for st in p.states], dtype=torch.long)
            margins = self.steptrim.margins(slots, self._launcher.last_scores()).tolist()
            for st, t, m in zip(p.states, p.forwards, margins):
                if math.isfinite(m):
                    st.margins[t] = m
        for st, req_id, r in p.new_releases(fired, self.steptrim):
            self._release(st, r, req_id)
        self.decision_steps += 1
        self.decided_rows += len(p.states)
        ms = p.host_ms if gpu_ms is None else gpu_ms
        self.decision_ms += ms
        self._lat_gpu.append(ms)
        self._lat_decide.append(p.host_ms)
        self._lat_resolve.append((time.perf_counter() - start) * 1e3)

    def _release(self, st: RequestState, r: int, req_id: str) -> None:
        """Release ``st`` at r (its adapter runs through forward r), counted and, with
        ``report_releases``, reported."""
        st.release = r
        self.adapters[st.adapter].released += 1
        if self.report_releases:
            self.new_releases[req_id] = r

    def take_releases(self) -> dict[str, int]:
        """req_id → release point r of every release read since the last call, after reading the
        decisions older than the :attr:`hold` newest: what the step output brings to the scheduler
        (slot hand-back, prefix-cache keys). A decision after forward t with lag L is thus reported
        with forward t + L's output, before the scheduler appends that forward's token (the first
        one whose KV runs without the adapter)."""
        self.resolve(self.hold)
        out, self.new_releases = self.new_releases, {}
        return out

    def preview_releases(self) -> ReleasePreview | None:
        """After :meth:`take_releases`: the releases of the decisions it left unread (None if there
        are none), for an output the scheduler reads once the GPU has run this step. A decision
        after forward t with lag L ≥ 1 is then reported with forward t's output as well as with
        forward t + L's; the scheduler, which under async scheduling plans step t + 2 after reading
        step t's output, then hands the slot on from the first step without the adapter when L = 1."""
        if not (self._pending and self.report_releases):
            return None
        # the launcher's unread launches are these decisions', in the same order (decide and _apply)
        return ReleasePreview(zip(self._pending, self._launcher.unread(), strict=True), self.steptrim)

    def reset_latency(self) -> None:
        """Forget the latency samples (e.g. after a warm-up); totals and counts are kept."""
        for window in (self._lat_decide, self._lat_resolve, self._lat_gpu):
            window.clear()

    def latency(self) -> dict[str, float]:
        """Decision latency over the last ``latency_window`` decisions (ms): engine-thread time
        (perf_counter) in decide() and in resolve() and their sum per step (``*_host``), and
        the GPU time between the decision's two CUDA events (``decision_gpu``; where the
        decision runs on the host — off CUDA, or without a learned policy — the host time of
        decide()); p50/p95/p99 and means. ``decision_ms_mean`` in :meth:`counters` is the
        mean of ``decision_gpu`` over all decisions."""
        out: dict[str, float] = {"latency_samples": len(self._lat_gpu)}
        dec, res, gpu = (np.fromiter(x, np.float64, len(x)) for x in (self._lat_decide, self._lat_resolve,
                                                                          self._lat_gpu))
        for name, x in (("decide_host", dec), ("resolve_host", res), ("decision_host", dec + res),
                        ("decision_gpu", gpu)):
            q = np.percentile(x, (50, 95, 99)) if x.size else (0.0, 0.0, 0.0)
            out |= {f"{name}_ms_p50": float(q[0]), f"{name}_ms_p95": float(q[1]), f"{name}_ms_p99": float(q[2]),
                    f"{name}_ms_mean": float(x.mean()) if x.size else 0.0}
        return out

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
            "decision_mode": self._launcher.mode, **self.latency(),
            "mapping_ms_total": self.mapping_ms,
            "adapters": {name: c.as_dict() for name, c in sorted(self.adapters.items())},
        }

    def summary(self) -> str:
        """One log line of the main counters."""
        c = self.counters()
        return (f"LoRazor StepTrim: {c['requests']} adapter requests, {c['released_requests']} released, skip "
                f"{c['skip_fraction']:.3f} of {c['decode_forwards']} decode forwards, decision "
                f"{c['decision_ms_mean']:.3f} ms/step over {c['decision_steps']} steps ({c['decision_mode']}; last "
                f"{c['latency_samples']}: GPU p50/p95 {c['decision_gpu_ms_p50'] * 1e3:.0f}/"
                f"{c['decision_gpu_ms_p95'] * 1e3:.0f} µs, host decide+resolve p50/p95 "
                f"{c['decision_host_ms_p50'] * 1e3:.0f}/{c['decision_host_ms_p95'] * 1e3:.0f} µs)")

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


def _weights_identity(path: str) -> tuple[int, int, int, int] | None:
    """(device, inode, size, mtime in ns) of the weights file of the adapter at ``path`` (its peft
    directory or the file), None where there is none: rewriting or replacing it changes this."""
    if not path:
        return None
    try:
        st = adapter_weights_file(path).stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class CalibratedAdapters:
    """Which served adapters follow their bundle policy: those in the bundle whose weights at
    the served path are the calibrated ones, checked once per (adapter, path) and again whenever
    the weights file there changes (:func:`_weights_identity`), so an adapter reloaded under its
    name from rewritten weights is judged by those. Any other adapter runs full LoRA (never
    released); ``warn(key, message)`` is told once why. The worker's runtime and the scheduler use
    this one check, so they agree as long as a served file is not rewritten between the two."""

    def __init__(self, bundle: Bundle | None, verified: Mapping[str, str] | None = None,
                 warn: Any = None) -> None:
        self.bundle = bundle
        # (adapter, path) → (the weights file's identity, verdict) as last hashed, or as the caller
        # verified it (true until that identity changes)
        self._verified: dict[tuple[str, str], tuple[tuple[int, int, int, int] | None, bool]] = {}
        for name, path in (verified or {}).items():
            self._verified[(name, _norm(path))] = (_weights_identity(_norm(path)), True)
        self._warn = warn or (lambda key, message: None)

    def check(self, adapter: str, path: str | None) -> bool:
        """Whether requests of ``adapter`` served from ``path`` follow the bundle's policy."""
        entry = None if self.bundle is None else self.bundle.adapters.get(adapter)
        if entry is None:
            self._warn(adapter, f"adapter '{adapter}' has no policy in bundle "
                                f"{getattr(self.bundle, 'path', None)}: it runs full LoRA (never released).")
            return False
        key = (adapter, _norm(path or ""))
        identity = _weights_identity(key[1])
        known = self._verified.get(key)
        if known is None or known[0] != identity:
            known = self._verified[key] = (identity, identity is not None and
                                           _weights_match(key[1], entry.weights_sha256))
        if not known[1]:
            self._warn(adapter, f"adapter '{adapter}' at {path!r}: its weights could not be read from a local "
                                f"directory or differ from those calibrated in {self.bundle.path}; it runs "
                                f"full LoRA (never released). Serve the calibrated adapter from a local path.")
            return False
        return True


def load_served_bundle(bundle_dir: str | os.PathLike[str], hidden_size: int, adapters: Mapping[str, str] | None = None,
                       hash_weights: bool = True, digest: str | None = None) -> tuple[Bundle, dict[str, str]]:
    """The bundle in ``bundle_dir`` checked for a model of ``hidden_size``, against ``digest`` (the
    pinned :func:`serve_bridge.bundle.bundle_digest`, if given: any other bundle is one
    BundleError) and, with ``adapters`` (served name → local directory), against the served
    adapters (a bundle adapter not served, or served with other weights, is one BundleError);
    returns it and the served adapters it verified. Without ``hash_weights`` the served adapters
    are taken as verified unread: for a caller in an engine whose workers run this check in full
    at start-up (the scheduler)."""
    adapters = dict(adapters or {})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", BundleWarning)
        bundle = load_bundle(bundle_dir, expected_hidden_size=hidden_size, known_adapters=list(adapters) or None)
    if digest is not None and bundle.digest != digest:
        raise BundleError(f"bundle {bundle.path} has digest {bundle.digest}, not the pinned {digest} "
                          f"(LORAZOR_BUNDLE_DIGEST): serve the bundle that digest names, or pin this one.")
    for w in caught:
        logger.warning(str(w.message))
    verified = {}
    for name, path in adapters.items():
        entry = bundle.adapters.get(name)
        if entry is None:
            continue
        if hash_weights and adapter_fingerprint(_norm(path)) != entry.weights_sha256:
            raise BundleError(f"{_norm(path)}: the weights of adapter '{name}' differ from those calibrated in "
                              f"{bundle.path} (manifest 'weights_sha256'): serve the calibrated adapter or "
                              f"re-calibrate this one.")
        verified[name] = path
    return bundle, verified


def build_runtime(bundle_dir: str | os.PathLike[str], hidden_size: int, device: torch.device | str,
                  adapters: Mapping[str, str] | None = None, log_interval_s: float = 60.0,
                  digest: str | None = None) -> ReleaseRuntime:
    """The serving runtime of the bundle in ``bundle_dir`` (:func:`load_served_bundle`'s checks, with
    the pinned ``digest``; one BundleError on the first problem). A served adapter the bundle lacks
    runs full LoRA, with a warning."""
    bundle, verified = load_served_bundle(bundle_dir, hidden_size, adapters, digest=digest)
    names = sorted(bundle.adapters)
    steptrim = StepTrim([bundle.policies[n] for n in names], bundle.hidden_size, device)
    return ReleaseRuntime(bundle, steptrim, names, verified, log_interval_s)
