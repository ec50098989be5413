"""Slot hand-back (serve_bridge/vllm/scheduler.py) over a stand-in of vLLM 0.26's and 0.33's scheduler.

The stand-in restates the LoRA-relevant part of ``v1/core/sched/scheduler.py``: running requests
first (chunked under a token budget, preempting the last running request when the KV capacity
runs out, :425-650), ``scheduled_loras`` from the scheduled running requests (:656-663; 0.33.0:
from every running request, scheduled in this step or not, :1038-1047), waiting
requests admitted only into a free adapter slot (:695-706, :1023-1024) and none after a
preemption, ``num_computed_tokens`` advanced after scheduling, one token per completed forward in
``update_from_output``, ``_free_request`` on finish. A real :class:`ReleaseRuntime` plays the
worker: it masks each step's mapping, decides on deterministic hidden states and sends its
releases back on the step output, as the runner does.
"""
from __future__ import annotations

import pickle
import sys
from collections import deque
from dataclasses import dataclass, field
from types import ModuleType, SimpleNamespace

import numpy as np
import pytest
import torch

from serve_bridge.runtime import build_runtime
from serve_bridge.vllm import prefix_cache
from serve_bridge.vllm.settings import BridgeError, BridgeSettings, refuse, release_engine_fixes
from tests.serve_bridge.engine_walk import H, hidden_state
from tests.serve_bridge.test_runtime import _bundle, _reference_release, served  # noqa: F401 - fixture
from tests.serve_bridge.vllm.stubs import import_over

LORA_ID = {"prof0": 1, "prof2": 2, "learn": 3, "off": 4, "tampered": 5}


class FakeRequest:
    def __init__(self, req_id: str, adapter: str | None, path: str | None, prompt: int, max_tokens: int,
                 extra_args: dict | None = None) -> None:
        self.request_id, self.num_prompt_tokens, self.max_tokens = req_id, prompt, max_tokens
        self.lora_request = None if adapter is None else SimpleNamespace(
            lora_name=adapter, lora_path=path, lora_int_id=LORA_ID[adapter])
        self.sampling_params = SimpleNamespace(extra_args=extra_args)
        self.num_computed_tokens = self.num_output = self.num_preemptions = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output


class FakeScheduler:
    """vLLM 0.26's max_loras accounting, restated (module doc)."""

    count_all_running = False  # 0.33.0 counts the adapters of running requests not scheduled too

    def __init__(self, vllm_config, budget: int = 64, kv_tokens: int = 10_000, max_running: int = 64) -> None:
        self.lora_config = vllm_config.lora_config
        self.budget, self.kv_tokens, self.max_running = budget, kv_tokens, max_running
        self.running: list[FakeRequest] = []
        self.waiting: deque[FakeRequest] = deque()
        self.requests: dict[str, FakeRequest] = {}

    def add_request(self, request: FakeRequest) -> None:
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def _kv_used(self, scheduled: dict[str, int]) -> int:
        return sum(r.num_computed_tokens + scheduled.get(r.request_id, 0) for r in self.running)

    def _preempt(self, request: FakeRequest) -> None:
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def schedule(self):
        scheduled: dict[str, int] = {}
        budget, preempted = self.budget, []
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            while self._kv_used(scheduled) + n > self.kv_tokens:
                victim = self.running.pop()
                scheduled.pop(victim.request_id, None)
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if request in preempted:
                break
            scheduled[request.request_id] = n
            budget -= n
            i += 1
        loras = {r.lora_request.lora_int_id for r in self.running
                 if (self.count_all_running or r.request_id in scheduled)
                 and r.lora_request and r.lora_request.lora_int_id > 0}
        assert len(loras) <= self.lora_config.max_loras
        if not preempted:
            skipped = []
            while self.waiting and budget > 0 and len(self.running) < self.max_running:
                request = self.waiting.popleft()
                lora = request.lora_request
                if lora and len(loras) == self.lora_config.max_loras and lora.lora_int_id not in loras:
                    skipped.append(request)
                    continue
                n = min(request.num_tokens, budget)
                if self._kv_used(scheduled) + n > self.kv_tokens:
                    self.waiting.appendleft(request)
                    break
                self.running.append(request)
                scheduled[request.request_id] = n
                budget -= n
                if lora:
                    loras.add(lora.lora_int_id)
            self.waiting.extendleft(reversed(skipped))
        computed = {rid: self.requests[rid].num_computed_tokens for rid in scheduled}
        for rid, n in scheduled.items():
            self.requests[rid].num_computed_tokens += n
        return SimpleNamespace(num_scheduled_tokens=scheduled, computed_before=computed)

    def update_from_output(self, scheduler_output, model_runner_output):
        finished = []
        for rid in scheduler_output.num_scheduled_tokens:
            request = self.requests[rid]
            if request.num_computed_tokens == request.num_tokens:
                request.num_output += 1
                if request.num_output == request.max_tokens:
                    finished.append(request)
        for request in finished:
            self.running.remove(request)
            self._free_request(request)
            del self.requests[request.request_id]
        return finished

    def _free_request(self, request, delay_free_blocks: bool = False):
        return None, None


class FakeScheduler033(FakeScheduler):
    """vLLM 0.33's max_loras accounting, restated (module doc)."""

    count_all_running = True


def async_stand_in(base: type) -> type:
    """vLLM's AsyncScheduler over ``base``, restated where it touches a request: each scheduled
    decode's token in flight is a placeholder until its output arrives (async_scheduler.py:24-56)."""

    class FakeAsyncScheduler(base):
        placeholders = 0  # placeholders added over the run

        def schedule(self):
            so = super().schedule()
            for rid in so.num_scheduled_tokens:
                request = self.requests[rid]
                if request.num_computed_tokens >= request.num_prompt_tokens:  # not a prefill chunk
                    request.num_output_placeholders = getattr(request, "num_output_placeholders", 0) + 1
                    self.placeholders += 1
            return so

        def update_from_output(self, scheduler_output, model_runner_output):
            for rid in scheduler_output.num_scheduled_tokens:
                request = self.requests[rid]
                request.num_output_placeholders = max(0, getattr(request, "num_output_placeholders", 0) - 1)
            return super().update_from_output(scheduler_output, model_runner_output)

    return FakeAsyncScheduler


@pytest.fixture(params=[FakeScheduler, FakeScheduler033], ids=["vllm-0.26", "vllm-0.33"])
def sched(monkeypatch, request):
    """serve_bridge.vllm.scheduler imported over stand-ins of vllm.v1.core.sched.scheduler and
    async_scheduler of each line."""
    names = ["vllm", "vllm.v1", "vllm.v1.core", "vllm.v1.core.sched", "vllm.v1.core.sched.scheduler",
             "vllm.v1.core.sched.async_scheduler"]
    modules = {n: ModuleType(n) for n in names}
    modules["vllm.v1.core.sched.scheduler"].Scheduler = request.param
    modules["vllm.v1.core.sched.async_scheduler"].AsyncScheduler = async_stand_in(request.param)
    modules["vllm.v1.core.sched"].scheduler = modules["vllm.v1.core.sched.scheduler"]
    modules["vllm.v1.core.sched"].async_scheduler = modules["vllm.v1.core.sched.async_scheduler"]
    return import_over(monkeypatch, modules, "serve_bridge.vllm.scheduler")


def vllm_config(max_loras: int, scheduler_cls=None, backend="mp"):
    return SimpleNamespace(lora_config=SimpleNamespace(max_loras=max_loras),
                           model_config=SimpleNamespace(get_hidden_size=lambda: H),
                           cache_config=SimpleNamespace(enable_prefix_caching=False, block_size=4),
                           scheduler_config=SimpleNamespace(scheduler_cls=scheduler_cls),
                           parallel_config=SimpleNamespace(distributed_executor_backend=backend))


@dataclass
class Output:
    """Stands in for ModelRunnerOutput (a plain dataclass, pickled by the mp executor)."""

    req_ids: list[str] = field(default_factory=list)


@dataclass
class Served:
    steps: int
    seen: dict[str, list[tuple[int, int]]]  # req_id → (position, LoRA id the worker mapped it to)
    held: dict[str, list[tuple[int, bool]]]  # req_id → (num_computed at schedule, held a slot)
    resident: list[int]  # adapters the worker had to make resident, per step
    releases: dict[str, int | None]


def serve(module, tmp_path, paths, specs, *, env, max_loras=2, budget=64, kv_tokens=10_000,
          scheduler_cls=None, lag: int = 0) -> Served:
    """Run requests ``specs`` [(req_id, adapter, prompt, max_tokens)] through ``scheduler_cls``
    (default: ReleaseScheduler) and a real ReleaseRuntime as the worker, whose learned policy has
    decision lag ``lag``. A spec may end in (LoRA id, weights): the adapter loaded under its name
    with that id from ``paths[weights]``."""
    bundle = _bundle(tmp_path, paths, lag=lag)
    environ = {"LORAZOR_BUNDLE": str(bundle)} | env
    for k in ("LORAZOR_BUNDLE", "LORAZOR_SLOTS", "LORAZOR_CALIBRATION"):
        environ.setdefault(k, "")
    with pytest.MonkeyPatch.context() as mp:
        for k, v in environ.items():
            mp.setenv(k, v)
        cls = scheduler_cls or module.ReleaseScheduler
        s = cls(vllm_config(max_loras), budget=budget, kv_tokens=kv_tokens)
        rt = build_runtime(bundle, H, "cpu")
    rt.report_releases = True
    for rid, adapter, prompt, max_tokens, *load in specs:
        lora_id, weights = load[0] if load else (LORA_ID.get(adapter), adapter)
        path = str(paths[weights]) if adapter else None
        request = FakeRequest(rid, adapter, path, prompt, max_tokens)
        if adapter:
            request.lora_request.lora_int_id = lora_id
        s.add_request(request)
        rt.add(rid, adapter, path, prompt)
    seen = {rid: [] for rid, *_ in specs}
    held = {rid: [] for rid, *_ in specs}
    resident, steps = [], 0
    releases = {}
    while s.requests:
        steps += 1
        assert steps < 10_000
        holds = getattr(s, "holds_slot", lambda r: r.lora_request is not None)
        before = {r.request_id: (r.num_computed_tokens, holds(r)) for r in list(s.running) + list(s.waiting)}
        so = s.schedule()
        rows = list(so.num_scheduled_tokens)
        for rid in rows:
            held[rid].append(before[rid])
        req = {rid: s.requests[rid] for rid in rows}
        computed = np.array([so.computed_before[r] for r in rows])
        n = np.array([so.num_scheduled_tokens[r] for r in rows])
        lora = [req[r].lora_request.lora_int_id if req[r].lora_request else 0 for r in rows]
        tokens = np.repeat(lora, n)
        step = rt.begin_step(rows, computed, n, np.array([req[r].num_tokens for r in rows]), tuple(tokens),
                             tuple(lora))
        resident.append(len(step.adapter_ids))
        off = 0
        for rid, c, k in zip(rows, computed, n):
            seen[rid] += [(int(c) + q, int(step.token_mapping[off + q])) for q in range(k)]
            off += k
        hidden = torch.from_numpy(np.stack([hidden_state(r, int(c + k) - req[r].num_prompt_tokens)
                                            for r, c, k in zip(rows, computed, n)]))
        rt.decide(hidden)
        out = Output(rows)
        taken = rt.take_releases()
        if taken:
            setattr(out, module.RELEASES_ATTR, taken)
        out = pickle.loads(pickle.dumps(out))  # the mp executor's path
        for request in s.update_from_output(so, out):
            releases[request.request_id] = rt.states[request.request_id].release
            rt.finish(request.request_id)
    return Served(steps, seen, held, resident, releases)


def _workload(n: int = 24, seed: int = 0):
    rng = np.random.default_rng(seed)
    adapters = ["prof0", "prof2", "learn", "off", "tampered", None]
    return [(f"q{i}", adapters[i % len(adapters)], int(rng.integers(3, 9)), int(rng.integers(2, 12)))
            for i in range(n)]


def _check_positions(served_run: Served, specs, paths) -> None:
    """Every scheduled position ran with the adapter iff it lies before the reference release."""
    for rid, adapter, prompt, max_tokens in specs:
        ref = _reference_release(adapter if adapter != "tampered" else None)(rid, max_tokens)
        lid = LORA_ID.get(adapter, 0)
        for pos, got in served_run.seen[rid]:
            assert got == (lid if ref is None or pos < prompt + ref else 0), (rid, pos, ref)


@pytest.mark.parametrize("kv_tokens", [10_000, 60])  # 60: requests get preempted and recomputed
def test_hand_back_keeps_every_mapping_and_admits_sooner(sched, tmp_path, served, kv_tokens):  # noqa: F811
    specs = _workload()
    on = serve(sched, tmp_path / "on", served, specs, env={}, kv_tokens=kv_tokens)
    off = serve(sched, tmp_path / "off", served, specs, env={"LORAZOR_SLOTS": "0"}, kv_tokens=kv_tokens)
    # the worker never needs more adapters resident than max_loras
    assert max(on.resident) <= 2 and max(off.resident) <= 2
    # tokens: each position's adapter is decided by the release point alone, identical either way
    _check_positions(on, specs, served)
    _check_positions(off, specs, served)
    assert on.releases == off.releases
    assert sum(r is not None for r in on.releases.values()) >= 8
    assert on.steps < off.steps  # freed slots admitted waiting adapters sooner
    if kv_tokens == 60:
        assert any(len([c for c, _ in h if c == 0]) > 1 for h in on.held.values())  # recomputes happened


def test_released_request_never_reacquires_a_slot_unless_recomputed(sched, tmp_path, served):  # noqa: F811
    specs = _workload(30, seed=3)
    run = serve(sched, tmp_path, served, specs, env={}, kv_tokens=60)
    for rid, adapter, prompt, _ in specs:
        held = run.held[rid]
        ref = _reference_release(adapter if adapter != "tampered" else None)(rid, 10**6)
        for (c, h) in held:
            # holds a slot exactly while the step starts before the release position
            assert h == (adapter is not None and (ref is None or c < prompt + ref)), (rid, c, h, ref)
        # after the first step without a slot, a slot again only from a recompute (start at 0)
        first_free = next((i for i, (_, h) in enumerate(held) if not h), None)
        if first_free is not None:
            again = [c for c, h in held[first_free:] if h]
            assert all(c < prompt + (ref or 0) for c in again)
            if again:
                assert any(c == 0 for c, _ in held[first_free:])


def test_one_slot_is_handed_on_after_the_release(sched, tmp_path, served):  # noqa: F811
    # max_loras = 1: b (prof2) waits for a's (prof0, k = 0) slot; a holds it for its prefill only
    specs = [("a", "prof0", 4, 6), ("b", "prof2", 4, 6)]
    on = serve(sched, tmp_path / "on", served, specs, env={}, max_loras=1)
    off = serve(sched, tmp_path / "off", served, specs, env={"LORAZOR_SLOTS": "0"}, max_loras=1)
    assert [h for _, h in on.held["a"]] == [True] + [False] * 5
    assert on.held["b"][0][0] == 0 and len(on.seen["b"]) and on.steps == 1 + 6  # b starts at step 2
    assert off.steps == 6 + 6  # b waits until a finishes


def test_an_adapter_reloaded_under_its_name_holds_a_slot_of_its_own(sched, tmp_path, served):  # noqa: F811
    """vLLM 0.34: "prof2" loaded again from other weights gets a new id (9) while a request of the
    first load runs. The scheduler counts the two loads as two adapters, as vLLM counts ids; the
    first load's request hands its slot back at its release (k = 2), the second load's requests
    (not the calibrated weights) hold theirs to the end, and every request finishes."""
    reload = (9, "tampered")
    specs = [("old", "prof2", 4, 8), ("new", "prof2", 3, 6, reload), ("newer", "prof2", 3, 4, reload)]
    run = serve(sched, tmp_path, served, specs, env={}, max_loras=1)
    assert run.releases == {"old": 2, "new": None, "newer": None}
    assert all(lora == (2 if pos < 4 + 2 else 0) for pos, lora in run.seen["old"])
    assert all(lora == 9 for rid in ("new", "newer") for _, lora in run.seen[rid])
    assert [h for _, h in run.held["old"]][:3] == [True] * 3 and not any(h for _, h in run.held["old"][3:])
    assert all(h for rid in ("new", "newer") for _, h in run.held[rid])
    assert max(run.resident) == 1  # one slot: the first load left it before the second load came in
    # the second load came in at step 4, beside the first load's request (8 steps); without hand-back after it
    kept = serve(sched, tmp_path / "kept", served, specs, env={"LORAZOR_SLOTS": "0"}, max_loras=1)
    assert (run.steps, kept.steps) == (3 + 6, 8 + 6) and (kept.seen, kept.releases) == (run.seen, run.releases)


def test_policy_off_is_vllms_scheduler(sched, tmp_path, served, monkeypatch):  # noqa: F811
    specs = _workload(18, seed=5)
    stock = serve(sched, tmp_path / "s", served, specs, env={"LORAZOR_SLOTS": "0"}, scheduler_cls=FakeScheduler)
    for env in ({"LORAZOR_SLOTS": "0"}, {"LORAZOR_BUNDLE": "", "LORAZOR_GRIDTRIM": "1"}):
        run = serve(sched, tmp_path / str(len(env)), served, specs, env=env)
        assert run.held == stock.held and run.seen == stock.seen and run.steps == stock.steps
    monkeypatch.delenv("LORAZOR_BUNDLE", raising=False)
    assert sched.slot_tracker(vllm_config(2)) is None


def test_scheduler_restores_lora_requests_and_counts_occupancy(sched, tmp_path, served, monkeypatch):  # noqa: F811
    monkeypatch.setenv("LORAZOR_BUNDLE", str(_bundle(tmp_path, served)))
    s = sched.ReleaseScheduler(vllm_config(2))
    a = FakeRequest("a", "prof0", str(served["prof0"]), 4, 5)
    b = FakeRequest("b", "off", str(served["off"]), 4, 5)
    for r in (a, b):
        s.add_request(r)
    so = s.schedule()
    assert sched.scheduled_occupancy(s, so) == (2, 2, 2)  # both prefill with their adapters
    s.update_from_output(so, Output())
    lora = a.lora_request
    so = s.schedule()
    assert a.lora_request is lora  # hidden during schedule() only
    assert sched.scheduled_occupancy(s, so) == (2, 1, 2)  # a released after its prefill: only b holds a slot
    stock = FakeScheduler(vllm_config(2))
    stock.requests, stock.running = s.requests, s.running
    assert sched.scheduled_occupancy(stock, so) == (2, 2, 2)  # vLLM's accounting: both hold one


def test_learned_release_reaches_the_scheduler_with_the_output(sched, tmp_path, served, monkeypatch):  # noqa: F811
    monkeypatch.setenv("LORAZOR_BUNDLE", str(_bundle(tmp_path, served)))
    s = sched.ReleaseScheduler(vllm_config(2))
    s.add_request(FakeRequest("l", "learn", str(served["learn"]), 4, 50))
    assert s.lorazor_slots.states["l"].release is None  # learned: unknown until the worker decides
    so = s.schedule()
    out = pickle.loads(pickle.dumps(setattr(o := Output(["l"]), sched.RELEASES_ATTR, {"l": 0, "gone": 3}) or o))
    s.update_from_output(so, out)
    assert s.lorazor_slots.states["l"].release == 0 and not s.holds_slot(s.requests["l"])
    s.lorazor_slots.report({"l": 5})  # one-way: a later report does not move it
    assert s.lorazor_slots.states["l"].release == 0


def test_forced_release_and_unusable_adapters(sched, tmp_path, served, monkeypatch):  # noqa: F811
    monkeypatch.setenv("LORAZOR_BUNDLE", str(_bundle(tmp_path, served)))
    s = sched.ReleaseScheduler(vllm_config(2))
    tr = s.lorazor_slots
    tr.add("f", "off", str(served["off"]), 4, {"lorazor": {"release_position": 6}})
    tr.add("t", "tampered", str(served["tampered"]), 4, None)  # other weights than calibrated
    tr.add("x", "stranger", str(served["stranger"]), 4, None)  # not in the bundle
    tr.add("m", "prof2", str(served["prof2"]), 4, {"lorazor": {"release_position": "bad"}})
    assert tr.holds_slot("f", 5) and not tr.holds_slot("f", 6)
    assert "t" not in tr.states and "x" not in tr.states and tr.holds_slot("t", 100)
    assert tr.holds_slot("m", 5) and not tr.holds_slot("m", 6)  # malformed args ignored: profiled k = 2


def test_refusals(sched, tmp_path, served, monkeypatch):  # noqa: F811
    with pytest.raises(BridgeError, match=r"scheduler_cls.*'my.Scheduler'"):
        refuse(release_engine_fixes(vllm_config(2, scheduler_cls="my.Scheduler")))
    with pytest.raises(BridgeError, match=r"distributed_executor_backend 'mp' or 'uni' \(found 'ray'\)"):
        refuse(release_engine_fixes(vllm_config(2, backend="ray")))
    assert release_engine_fixes(vllm_config(2, scheduler_cls="serve_bridge.vllm.scheduler.ReleaseScheduler",
                                            backend="uni")) == []
    assert release_engine_fixes(vllm_config(2, scheduler_cls="serve_bridge.vllm.scheduler.ReleaseAsyncScheduler")) == []
    with pytest.raises(BridgeError, match="LORAZOR_SLOTS is on in calibration mode"):
        BridgeSettings.from_env({"LORAZOR_CALIBRATION": "1", "LORAZOR_SLOTS": "1"})
    assert not BridgeSettings.from_env({"LORAZOR_CALIBRATION": "1"}).slots
    assert BridgeSettings.from_env({"LORAZOR_BUNDLE": "/b"}).slots
    assert not BridgeSettings.from_env({"LORAZOR_BUNDLE": "/b", "LORAZOR_SLOTS": "off"}).slots
    with pytest.raises(BridgeError, match="LORAZOR_SLOTS='maybe'"):
        BridgeSettings.from_env({"LORAZOR_BUNDLE": "/b", "LORAZOR_SLOTS": "maybe"})
    monkeypatch.setenv("LORAZOR_BUNDLE", str(_bundle(tmp_path, served)))
    with pytest.raises(BridgeError, match="found 'ray'"):
        sched.ReleaseScheduler(vllm_config(2, backend="ray"))


def test_install_replaces_the_default_scheduler(sched):
    base = sys.modules["vllm.v1.core.sched.scheduler"]
    base_async = sys.modules["vllm.v1.core.sched.async_scheduler"]
    stand_in = base_async.AsyncScheduler
    sched.install()
    sched.install()
    assert base.Scheduler is sched.ReleaseScheduler and issubclass(sched.ReleaseScheduler.__mro__[1], FakeScheduler)
    assert base_async.AsyncScheduler is sched.ReleaseAsyncScheduler
    assert sched.ReleaseAsyncScheduler.__mro__[1:3] == (sched.ReleaseScheduler, stand_in)


def test_async_scheduler_keeps_the_slot_accounting(sched, tmp_path, served):  # noqa: F811
    """Profiled, forced-off and adapter-less requests (the bundles async scheduling accepts): the
    same steps, slots held, worker mappings and releases as the synchronous scheduler, with the
    async stand-in's placeholders counted on the way."""
    specs = [spec for spec in _workload(36, seed=5) if spec[1] in ("prof0", "prof2", "off", None)]
    sync = serve(sched, tmp_path / "sync", served, specs, env={})
    placeholders = []

    class Counting(sched.ReleaseAsyncScheduler):
        def update_from_output(self, scheduler_output, model_runner_output):
            placeholders.append(self.placeholders)
            return super().update_from_output(scheduler_output, model_runner_output)

    run = serve(sched, tmp_path / "async", served, specs, env={}, scheduler_cls=Counting)
    assert (run.steps, run.held, run.seen, run.releases) == (sync.steps, sync.held, sync.seen, sync.releases)
    assert any(not h for req in run.held.values() for _, h in req)  # some requests did hand their slot back
    assert placeholders[-1] > 0


def test_scheduler_trusts_the_workers_start_up_weight_check(sched, tmp_path, served, monkeypatch):  # noqa: F811
    from serve_bridge.bundle import BundleError
    from serve_bridge.runtime import load_served_bundle

    bundle = _bundle(tmp_path, served)
    adapters = {n: str(served[n]) for n in ("prof0", "learn", "off")} | {"tampered": str(served["prof2"])}
    served_adapters = adapters | {"prof2": str(served["tampered"])}
    with pytest.raises(BundleError, match="weights of adapter 'prof2' differ"):
        load_served_bundle(bundle, H, served_adapters)  # the worker: refuses the engine at start-up
    _, verified = load_served_bundle(bundle, H, served_adapters, hash_weights=False)  # the scheduler: no second read
    assert verified["prof2"] == str(served["tampered"])
    monkeypatch.setenv("LORAZOR_BUNDLE", str(bundle))
    served_ok = adapters | {"prof2": str(served["prof2"])}
    monkeypatch.setenv("LORAZOR_ADAPTERS", ",".join(f"{k}={v}" for k, v in served_ok.items()))
    tracker = sched.ReleaseScheduler(vllm_config(2)).lorazor_slots
    assert tracker.calibrated._verified[("prof2", str(served["prof2"]))][1] is True


def test_with_slots_to_spare_the_schedule_is_vllms_own(sched, tmp_path, served, monkeypatch):  # noqa: F811
    """At most max_loras distinct adapters in the scheduler: no lora_request is hidden, and the steps
    are vLLM's; with fewer slots than adapters, hiding is what admits sooner."""
    specs = _workload(18, seed=7)  # five distinct adapters and requests without one
    base = sys.modules["vllm.v1.core.sched.scheduler"].Scheduler
    original, hid = base.schedule, []

    def spy(self, *args, **kwargs):
        hid.append(any(isinstance(r.lora_request, sched.UncountedLoRA) for r in self.running))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(base, "schedule", spy)
    spare = serve(sched, tmp_path / "spare", served, specs, env={}, max_loras=5)
    stock = serve(sched, tmp_path / "stock", served, specs, env={"LORAZOR_SLOTS": "0"}, max_loras=5)
    assert not any(hid) and spare.steps == stock.steps and spare.held.keys() == stock.held.keys()
    _check_positions(spare, specs, served)
    hid.clear()
    short = serve(sched, tmp_path / "short", served, specs, env={}, max_loras=2)
    assert any(hid) and short.steps > 0



class RecordingRequest(FakeRequest):
    """A request that logs, as each output token is appended (the moment vLLM hashes the block it
    fills), its position and the release position marked on the request then."""

    log: list[tuple[str, int, int | None]] = []

    @property
    def num_output(self) -> int:
        return self._num_output

    @num_output.setter
    def num_output(self, value: int) -> None:
        if value > getattr(self, "_num_output", 0):
            self.log.append((self.request_id, self.num_prompt_tokens + self._num_output,
                             getattr(self, prefix_cache.RELEASE_ATTR, None)))
        self._num_output = value


@pytest.mark.parametrize("lag", [0, 1])
@pytest.mark.parametrize("asynchronous", [False, True])
def test_releases_are_marked_before_their_first_released_token_is_appended(sched, tmp_path, served, lag,  # noqa: F811
                                                                           asynchronous, monkeypatch):
    """vLLM hashes a block when the token that fills it is appended (``update_from_output``); the
    token that forward r produces sits at position P + r, the first whose KV runs without the
    adapter. Every release (profiled at admission, learned with the output of forward r = t + lag)
    is marked on the request before that token is appended, so its block and every later one hash
    with the release point; no other position is ever marked."""
    monkeypatch.setattr(RecordingRequest, "log", [])
    monkeypatch.setitem(globals(), "FakeRequest", RecordingRequest)
    specs = _workload(30, seed=11)
    cls = sched.ReleaseAsyncScheduler if asynchronous else None
    serve(sched, tmp_path, served, specs, env={}, scheduler_cls=cls, lag=lag, kv_tokens=60)
    prompt = {rid: p for rid, _, p, _ in specs}
    ref = {rid: _reference_release(a if a != "tampered" else None, lag)(rid, 10**6) for rid, a, *_ in specs}
    released_appends = 0
    for rid, position, mark in RecordingRequest.log:
        p = None if ref[rid] is None else prompt[rid] + ref[rid]
        assert mark in (None, p), (rid, position, mark, p)
        if p is not None and position >= p:
            assert mark == p, (rid, position, p)
            released_appends += 1
    assert released_appends > 20 and any(a == "learn" and ref[rid] for rid, a, *_ in specs)


def test_released_requests_keep_their_lora_for_events_and_keys_during_schedule(sched, tmp_path, served,  # noqa: F811
                                                                              monkeypatch):
    """While ``schedule()`` runs, a request that holds no slot shows vLLM's accounting LoRA id 0
    (skipped: ``lora_int_id > 0``), while its name, path and adapter id, which the block pool's
    KV-cache events and block keys read during the same call, stay the real ones."""
    monkeypatch.setenv("LORAZOR_BUNDLE", str(_bundle(tmp_path, served)))
    s = sched.ReleaseScheduler(vllm_config(1))
    a = FakeRequest("a", "prof0", str(served["prof0"]), 4, 5)
    b = FakeRequest("b", "prof2", str(served["prof2"]), 4, 5)
    s.add_request(a)
    s.update_from_output(s.schedule(), Output())  # a's prefill; a is released after it (k = 0)
    s.add_request(b)
    base = sys.modules["vllm.v1.core.sched.scheduler"].Scheduler
    seen = []
    original = base.schedule

    def spy(self, *args, **kwargs):
        seen.append(a.lora_request)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(base, "schedule", spy)
    lora = a.lora_request
    so = s.schedule()
    shown = seen[0]
    assert isinstance(shown, sched.UncountedLoRA) and shown.lora_int_id == 0 and bool(shown)
    assert (shown.lora_name, shown.lora_path, shown.adapter_id) == (lora.lora_name, lora.lora_path, lora.lora_int_id)
    assert "b" in so.num_scheduled_tokens  # b took a's slot in the same step
    assert a.lora_request is lora
