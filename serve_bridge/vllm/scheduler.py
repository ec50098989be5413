"""Release-aware scheduling in vLLM (0.26.0 and 0.33.0, whenever a bundle is served): adapter slots
(``LORAZOR_SLOTS``, on by default) and the prefix-cache keys of released blocks.

A request holds a slot of ``max_loras`` while a forward still needs its adapter: with release
position p (docs/design.md §2: the adapter runs at positions < p; :class:`serve_bridge.runtime.
RequestState`), a step that starts at ``num_computed_tokens`` c needs it iff c < p. So from the
forward after its release point on, a request stops counting, and waiting requests of other
adapters are admitted into the freed slot at the next ``schedule()``. A preempted request
restarts at c = 0 and holds a slot again until its recompute has passed p, then never again.

Where p comes from (the same sources as the worker's :class:`~serve_bridge.runtime.ReleaseRuntime`,
with the same :class:`~serve_bridge.runtime.CalibratedAdapters` check, so both sides agree):
profiled k → p = P + k, known at admission (:func:`serve_bridge.steptrim.release_point_profiled`);
a forced release (``extra_args``) → its position; learned → p = P + r once the worker's decision
arrives with a step's output (:data:`RELEASES_ATTR`, set by ``serve_bridge.vllm.model_runner`` and
``model_runner_v2``): with decision lag L, a decision after forward t (r = t + L) arrives with
forward r's output, and on the V2 runner already with forward t's (read where vLLM waits for that
step's copy to the host), so under async scheduling the slot is handed on from the first step
planned without the adapter; either way before the token whose KV first runs without the adapter
is appended and its block hashed. The same r may arrive twice. An adapter
without a usable policy always holds its slot. Each known p is marked on vLLM's request
(:func:`serve_bridge.vllm.prefix_cache.mark_release`), so blocks reaching it hash apart.

:class:`ReleaseScheduler` shows vLLM's ``max_loras`` accounting, for the duration of ``schedule()``,
an :class:`UncountedLoRA` in place of the ``lora_request`` of running requests that hold no slot
(with hand-back on), reads learned releases from each step's output in
``update_from_output``, keeps per-request state from ``add_request`` to ``_free_request``, and
counts prefix-cache hits (:func:`serve_bridge.vllm.prefix_cache.count_hits`);
:class:`ReleaseAsyncScheduler` is the same over vLLM's ``AsyncScheduler``. :func:`install` makes
them vLLM's default scheduler classes. Which vLLM code this relies on, per line:
docs/vllm_integration.md §7, §9, §11.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from vllm.v1.core.sched import async_scheduler as vllm_async_scheduler
from vllm.v1.core.sched import scheduler as vllm_scheduler

from serve_bridge.bundle import Bundle
from serve_bridge.runtime import NEVER, CalibratedAdapters, RequestState, load_served_bundle, logger, request_args
from serve_bridge.steptrim import NO_SLOT, ProfiledPolicy, release_point_profiled
from serve_bridge.vllm import prefix_cache
from serve_bridge.vllm.settings import RELEASES_ATTR, BridgeSettings, refuse, release_engine_fixes

_BaseScheduler = vllm_scheduler.Scheduler
_BaseAsyncScheduler = vllm_async_scheduler.AsyncScheduler  # a subclass of _BaseScheduler


class SlotTracker:
    """Release positions of the requests that may release, and whether one holds a slot.

    Requests that can never release (no usable policy, no forced release) are not tracked:
    they always hold their slot. ``hand_back``: released requests hand their slot on
    (``LORAZOR_SLOTS``); without it every adapter request holds its slot to the end, as in vLLM,
    and the release positions serve the prefix-cache keys only.
    """

    def __init__(self, bundle: Bundle, verified: Mapping[str, str] | None = None, hand_back: bool = True) -> None:
        self.bundle = bundle
        self.calibrated = CalibratedAdapters(bundle, verified)  # the worker logs the warnings
        self.hand_back = hand_back
        self.states: dict[str, RequestState] = {}
        self._mismatch_logged = False

    def add(self, req_id: str, adapter: str, path: str | None, num_prompt_tokens: int,
            extra_args: Mapping[str, Any] | None) -> None:
        """Track a new request of ``adapter`` (served from ``path``) with P prompt tokens."""
        try:
            forced = request_args(extra_args)[1]
        except ValueError:
            forced = None  # the worker ignores malformed arguments too
        usable = self.calibrated.check(adapter, path)
        policy = self.bundle.policies.get(adapter) if usable else None
        if policy is None and forced is None:
            return
        release = release_point_profiled(policy.k) if isinstance(policy, ProfiledPolicy) else None
        self.states[req_id] = RequestState(adapter=adapter, slot=NO_SLOT,  # decisions are the worker's
                                           num_prompt_tokens=int(num_prompt_tokens), release=release,
                                           forced_release_position=forced)

    def report(self, releases: Mapping[str, int] | None) -> None:
        """Apply the worker's releases of one step (req_id → r); a request released once stays so."""
        for req_id, r in (releases or {}).items():
            st = self.states.get(req_id)
            if st is None:
                continue
            if st.release is None:
                st.release = int(r)
            elif st.release != r and not self._mismatch_logged:
                self._mismatch_logged = True
                logger.warning("LoRazor slots: request %s released at %d by the worker, %d expected; the "
                               "scheduler keeps %d.", req_id, r, st.release, st.release)

    def release_position(self, req_id: str) -> int:
        """The request's first position without adapter, as known now (:data:`NEVER` if none)."""
        st = self.states.get(req_id)
        return NEVER if st is None else st.release_position

    def holds_slot(self, req_id: str, num_computed_tokens: int) -> bool:
        """Whether a step starting at ``num_computed_tokens`` counts against ``max_loras``: it needs
        the request's adapter, or slots are not handed back."""
        return not self.hand_back or num_computed_tokens < self.release_position(req_id)

    def drop(self, req_id: str) -> None:
        self.states.pop(req_id, None)


class UncountedLoRA:
    """A released request's ``LoRARequest`` as vLLM's scheduler sees it during ``schedule()``:
    every attribute of the real one (name, path, ``adapter_id``, which KV-cache events and block
    keys read), but ``lora_int_id`` 0, which vLLM's ``max_loras`` accounting skips
    (``v1/core/sched/scheduler.py:1041-1046`` in 0.33.0, :656-662 in 0.26.0)."""

    __slots__ = ("lora",)
    lora_int_id = 0

    def __init__(self, lora: Any) -> None:
        self.lora = lora

    def __getattr__(self, name: str) -> Any:
        return getattr(self.lora, name)

    @property
    def adapter_id(self) -> int:
        return self.lora.lora_int_id


def slot_tracker(vllm_config: Any, settings: BridgeSettings | None = None) -> SlotTracker | None:
    """The tracker for this engine, or None (vLLM's scheduler unchanged) unless a bundle is served
    with LoRA; refuses unsupported engine settings with one BridgeError."""
    settings = BridgeSettings.from_env() if settings is None else settings
    if settings is None or settings.calibration or vllm_config.lora_config is None:
        return None
    refuse(release_engine_fixes(vllm_config))
    # The workers hash LORAZOR_ADAPTERS' weights at start-up and refuse a mismatch (before the
    # engine core builds its scheduler); no second read here.
    bundle, verified = load_served_bundle(settings.bundle, vllm_config.model_config.get_hidden_size(),
                                          settings.adapters, hash_weights=False, digest=settings.bundle_digest)
    if settings.slots:
        logger.info("LoRazor slot hand-back active: released requests stop counting against max_loras=%d.",
                    vllm_config.lora_config.max_loras)
    return SlotTracker(bundle, verified, hand_back=settings.slots)


class ReleaseScheduler(_BaseScheduler):
    """vLLM's scheduler whose ``max_loras`` accounting skips requests past their release
    position (module doc). Without a tracker it is vLLM's scheduler unchanged.

    While the requests in the scheduler (waiting or running) hold at most ``max_loras``
    distinct adapters, vLLM's accounting can block no admission (a full count then holds every
    adapter present), so ``schedule()`` is vLLM's own, with no per-request work.
    """

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        self.lorazor_slots: SlotTracker | None = slot_tracker(vllm_config)
        self._adapter_of: dict[str, int] = {}  # req_id → LoRA id, for requests with an adapter
        self._adapters: Counter[int] = Counter()  # LoRA id → requests in the scheduler
        if self.lorazor_slots is not None and vllm_config.cache_config.enable_prefix_caching:
            prefix_cache.count_hits(self.kv_cache_manager, vllm_config.cache_config.block_size)

    def add_request(self, request: Any) -> None:
        known = request.request_id in self.requests
        super().add_request(request)
        lora = request.lora_request
        if lora is not None and not known:
            self._adapter_of[request.request_id] = lora.lora_int_id
            self._adapters[lora.lora_int_id] += 1
        if self.lorazor_slots is not None and lora is not None and not known:
            params = request.sampling_params
            self.lorazor_slots.add(request.request_id, lora.lora_name, lora.lora_path, request.num_prompt_tokens,
                                   params.extra_args if params is not None else None)
            self._mark(request.request_id)

    def _mark(self, req_id: str) -> None:
        """Put the request's known release position where its block hashes read it."""
        request = self.requests.get(req_id)
        position = self.lorazor_slots.release_position(req_id)
        if request is not None and position != NEVER:
            prefix_cache.mark_release(request, position)

    def holds_slot(self, request: Any) -> bool:
        """Whether ``request`` counts against ``max_loras`` in the next step."""
        if request.lora_request is None:
            return False
        return self.lorazor_slots is None or self.lorazor_slots.holds_slot(request.request_id,
                                                                         request.num_computed_tokens)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        tracker = self.lorazor_slots
        if tracker is None or not tracker.hand_back or len(self._adapters) <= self.lora_config.max_loras:
            return super().schedule(*args, **kwargs)
        hidden = [(r, r.lora_request) for r in self.running if r.lora_request is not None and not self.holds_slot(r)]
        for request, lora in hidden:
            request.lora_request = UncountedLoRA(lora)
        try:
            return super().schedule(*args, **kwargs)
        finally:
            for request, lora in hidden:
                request.lora_request = lora

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        if self.lorazor_slots is not None:  # before vLLM appends the step's tokens and hashes their blocks
            releases = getattr(model_runner_output, RELEASES_ATTR, None) or {}
            self.lorazor_slots.report(releases)
            for req_id in releases:
                self._mark(req_id)
        return super().update_from_output(scheduler_output, model_runner_output)

    def _free_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        lora_id = self._adapter_of.pop(request.request_id, None)
        if lora_id is not None:
            self._adapters[lora_id] -= 1
            if not self._adapters[lora_id]:
                del self._adapters[lora_id]
        if self.lorazor_slots is not None:
            self.lorazor_slots.drop(request.request_id)
        return super()._free_request(request, *args, **kwargs)


class ReleaseAsyncScheduler(ReleaseScheduler, _BaseAsyncScheduler):
    """:class:`ReleaseScheduler`'s accounting over vLLM's ``AsyncScheduler``, which counts each
    scheduled decode's token in flight (``v1/core/sched/async_scheduler.py:24-56``), as vLLM's own
    ``DiffusionAsyncScheduler`` combines its scheduler with it."""


def scheduled_occupancy(scheduler: Any, scheduler_output: Any) -> tuple[int, int, int]:
    """(requests scheduled in ``scheduler_output``, distinct adapters holding a slot among them,
    distinct adapters among them at all), for any vLLM 0.26 scheduler, right after its
    ``schedule()``: with a :class:`ReleaseScheduler` handing slots back, released requests hold no
    slot; otherwise every adapter request holds one (vLLM's accounting). ``schedule()`` has already
    advanced ``num_computed_tokens`` by the scheduled tokens."""
    tracker = getattr(scheduler, "lorazor_slots", None)
    held, present = set(), set()
    for req_id, n in scheduler_output.num_scheduled_tokens.items():
        request = scheduler.requests[req_id]
        lora = request.lora_request
        if lora is None:
            continue
        present.add(lora.lora_int_id)
        if tracker is None or tracker.holds_slot(req_id, request.num_computed_tokens - n):
            held.add(lora.lora_int_id)
    return len(scheduler_output.num_scheduled_tokens), len(held), len(present)


def install() -> None:
    """Make vLLM's default schedulers :class:`ReleaseScheduler` and, under async scheduling,
    :class:`ReleaseAsyncScheduler` (``config/scheduler.py:231-239`` looks both up by module
    attribute; idempotent)."""
    vllm_scheduler.Scheduler = ReleaseScheduler
    vllm_async_scheduler.AsyncScheduler = ReleaseAsyncScheduler
