"""The StepTrim runner for the V2 model runner of vLLM 0.33 and 0.34 (serve_bridge/vllm/model_runner_v2.py)
over a restatement of the parts of ``vllm/v1/worker/gpu/model_runner.py`` it hooks into, per line.

The stand-in runner keeps 0.33's order of work in ``execute_model`` (:1764-2102; 0.34.0: :1826-2169):
finish (finished and preempted requests, :1188-1200; 0.34: :1255-1269), add (:1215-1268; 0.34:
:1284-1338), update; ``gather_batch_req_state`` (:1306-1386; 0.34: :1376-1456, batch order:
decodes first, ``sort_batch_req_ids``); the CUDA-graph LoRA count from the module function
``get_num_active_loras_for_dispatch`` (:1818-1823; 0.34: :1880-1885); ``LoraState.make_lora_inputs``
into ``_set_active_loras`` (:1877-1884; 0.34: :1939-1947, with one logits row per request,
``cu_num_logits_np`` at :1484-1488); the forward's hidden states for every token, sampled at
``logits_indices`` (:1655; 0.34: :1729); ``sample_tokens`` returning, synchronous or not, an
``AsyncOutput`` (:2247-2347; 0.34: :2311-2411), a ``vllm.v1.outputs.AsyncModelRunnerOutput``
(``v1/outputs.py:354-372``; 0.34: :352-370) whose ``get_output()`` the executor calls and whose
``model_runner_output`` it returns (``v1/worker/gpu/async_utils.py:116-204``). 0.34 has no V1
runner module. A real :class:`ReleaseRuntime` decides.
"""
from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from types import ModuleType, SimpleNamespace

import numpy as np
import pytest
import torch

from serve_bridge.runtime import NO_SLOT, build_runtime, lora_group_count
from serve_bridge.vllm import versions
from serve_bridge.vllm.settings import RELEASES_ATTR, BridgeError
from tests.serve_bridge.test_runtime import W_LEARN, H, _bundle, served  # noqa: F401 - fixture
from tests.serve_bridge.vllm.stubs import import_over

LORA_ID = {"prof0": 1, "prof2": 2, "learn": 3, "off": 4}


class LoRARequest033:
    """vLLM 0.33's LoRARequest where the hooks read it; equal and hashed by name (lora/request.py:56-69)."""

    def __init__(self, lora_name, lora_int_id, lora_path):
        self.lora_name, self.lora_int_id, self.lora_path = lora_name, lora_int_id, lora_path

    def __eq__(self, other):
        return isinstance(other, self.__class__) and self.lora_name == other.lora_name

    def __hash__(self):
        return hash(self.lora_name)


class LoRARequest034(LoRARequest033):
    """vLLM 0.34's: equal and hashed by (name, id), so an adapter reloaded under its name, which gets
    a new id, is another request (lora/request.py:56-68)."""

    def __eq__(self, other):
        return isinstance(other, self.__class__) and (self.lora_name, self.lora_int_id) == (other.lora_name,
                                                                                          other.lora_int_id)

    def __hash__(self):
        return hash((self.lora_name, self.lora_int_id))


class LoraState:
    """vLLM 0.33's LoraState (v1/worker/gpu/lora_utils.py:79-112), restated."""

    def __init__(self, max_num_reqs):
        self.lora_ids = np.zeros(max_num_reqs, dtype=np.int32)
        self.lora_requests = {}

    def add_request(self, req_id, req_index, lora_request):
        if lora_request is not None:
            self.lora_requests[req_id] = lora_request
        self.lora_ids[req_index] = 0 if lora_request is None else lora_request.lora_int_id

    def remove_request(self, req_id):
        self.lora_requests.pop(req_id, None)

    def make_lora_inputs(self, req_ids, idx_mapping, num_scheduled_tokens):
        ids = self.lora_ids[idx_mapping]
        return tuple(ids), tuple(ids.repeat(num_scheduled_tokens)), self.get_activate_loras(req_ids)

    def get_activate_loras(self, req_ids):
        return {self.lora_requests[r] for r in req_ids if r in self.lora_requests}


class LoraState034(LoraState):
    """vLLM 0.34's: ``make_lora_inputs`` takes ``num_logits`` and gives one lm_head id per logits
    row (lora_utils.py:94-107)."""

    def make_lora_inputs(self, req_ids, idx_mapping, num_scheduled_tokens, num_logits):
        ids = self.lora_ids[idx_mapping]
        return tuple(ids.repeat(num_logits)), tuple(ids.repeat(num_scheduled_tokens)), self.get_activate_loras(req_ids)


LINES = {"0.33.0": (LoraState, LoRARequest033), "0.34.0": (LoraState034, LoRARequest034)}


def stock_dispatch_count(lora_config, lora_state, req_ids, dummy_run):
    """get_num_active_loras_for_dispatch (lora_utils.py:38-49, both lines), restated."""
    if lora_config and not dummy_run:
        return len(lora_state.get_activate_loras(req_ids))
    return lora_config.max_loras + 1 if dummy_run and lora_config else 0


def hidden_for(req_id: str, fire: bool) -> torch.Tensor:
    """A sampled row whose learned score is far below τ (fires) or far above it."""
    return torch.tensor(W_LEARN * (-10.0 if fire else 10.0), dtype=torch.float32)


class AsyncModelRunnerOutput(ABC):
    """vllm.v1.outputs.AsyncModelRunnerOutput (v1/outputs.py:354-372 in 0.33.0, :352-370 in 0.34.0), restated."""

    @abstractmethod
    def get_output(self):
        ...

    @abstractmethod
    def get_kv_connector_output(self):
        ...


class AsyncOutput(AsyncModelRunnerOutput):
    """The V2 runner's step output (v1/worker/gpu/async_utils.py:116-222): its ModelRunnerOutput
    once the copy to the host is done."""

    def __init__(self, model_runner_output):
        self.model_runner_output = model_runner_output

    def get_output(self):
        return self.model_runner_output

    def get_kv_connector_output(self):
        return "kv connector output"


@pytest.fixture(params=list(LINES))
def v2(monkeypatch, request):
    """serve_bridge.vllm.model_runner_v2 over stand-ins of the modules of vLLM ``line`` it imports
    (0.33 also ships the V1 runner's module, which its seam refuses)."""
    line = request.param
    lora_state_cls, lora_request_cls = LINES[line]
    names = ["vllm", "vllm.v1", "vllm.v1.worker", "vllm.v1.worker.gpu", "vllm.v1.worker.gpu.model_runner",
             "vllm.v1.worker.gpu.lora_utils", "vllm.v1.outputs"] + (
                 ["vllm.v1.worker.gpu_model_runner"] if line == "0.33.0" else [])
    modules = {name: ModuleType(name) for name in names}
    runner_module = modules["vllm.v1.worker.gpu.model_runner"]

    class GPUModelRunner:
        """The V2 runner's request bookkeeping and execute_model order (module doc), restated."""

        def __init__(self, vllm_config, device):
            self.lora_config, self.max_num_reqs = vllm_config.lora_config, 8
            self.lora_state = lora_state_cls(self.max_num_reqs)
            self.req_index, self.free = {}, list(range(self.max_num_reqs))
            self.num_computed = np.zeros(self.max_num_reqs, dtype=np.int32)
            self.prefill_len = np.zeros(self.max_num_reqs, dtype=np.int32)
            self.req_states = SimpleNamespace(num_computed_tokens_np=self.num_computed)
            self.calls, self.execute_model_state, self.hidden_rows = [], None, {}

        def finish_requests(self, so):
            for req_id in sorted(so.finished_req_ids | so.preempted_req_ids):
                self.free.append(self.req_index.pop(req_id))
                self.lora_state.remove_request(req_id)

        def add_requests(self, so):
            for new in so.scheduled_new_reqs:
                i = self.req_index[new.req_id] = self.free.pop()
                self.num_computed[i], self.prefill_len[i] = new.num_computed_tokens, len(new.prefill_token_ids)
                self.lora_state.add_request(new.req_id, i, new.lora_request)

        def update_requests(self, so):
            for req_id, c in so.cached.items():
                self.num_computed[self.req_index[req_id]] = c

        def gather_batch_req_state(self, so, dummy_run):
            if dummy_run:
                return None, None
            # sort_batch_req_ids: decodes (one token) first, then by scheduler order
            req_ids = sorted(so.num_scheduled_tokens, key=lambda r: so.num_scheduled_tokens[r] != 1)
            idx = np.array([self.req_index[r] for r in req_ids], dtype=np.intp)
            n = np.array([so.num_scheduled_tokens[r] for r in req_ids], dtype=np.int32)
            return SimpleNamespace(req_ids=req_ids, num_scheduled_tokens=n, idx_mapping_np=idx,
                                   prefill_len_np=self.prefill_len[idx]), None

        def _set_active_loras(self, prompt_mapping, token_mapping, lora_requests):
            self.calls.append((prompt_mapping, token_mapping, lora_requests))

        def execute_model(self, so, intermediate_tensors=None, dummy_run=False):
            if not dummy_run:
                self.finish_requests(so)
                self.add_requests(so)
                self.update_requests(so)
            batch, _ = self.gather_batch_req_state(so, dummy_run)
            self.dispatched = runner_module.get_num_active_loras_for_dispatch(
                self.lora_config, self.lora_state, list(so.num_scheduled_tokens), dummy_run)
            if dummy_run:
                return None
            n = batch.num_scheduled_tokens
            logits = np.cumsum(n) - 1
            input_batch = SimpleNamespace(req_ids=batch.req_ids, num_reqs=len(n),
                                          logits_indices=torch.tensor(np.r_[logits, logits[-1]]),  # padded
                                          cu_num_logits_np=np.arange(len(n) + 1, dtype=np.int32))  # no drafts
            lora_inputs = (batch.req_ids, batch.idx_mapping_np, n)
            if line == "0.34.0":
                lora_inputs += (np.diff(input_batch.cu_num_logits_np),)
            self._set_active_loras(*self.lora_state.make_lora_inputs(*lora_inputs))
            hidden = torch.full((int(n.sum()), H), float("nan"))  # only the sampled rows are read
            for row, req_id in zip(logits, batch.req_ids):
                hidden[row] = self.hidden_rows.get(req_id, torch.zeros(H))
            self.execute_model_state = SimpleNamespace(input_batch=input_batch, hidden_states=hidden)
            return None

        def sample_tokens(self, grammar_output):
            self.execute_model_state = None
            return AsyncOutput(SimpleNamespace(req_ids=["stand-in output"]))

        def _dummy_sampler_run(self, hidden_states):
            pass

    runner_module.GPUModelRunner = GPUModelRunner
    runner_module.get_num_active_loras_for_dispatch = stock_dispatch_count
    modules["vllm.v1.worker.gpu.lora_utils"].LoraState = lora_state_cls
    modules["vllm.v1.outputs"].AsyncModelRunnerOutput = AsyncModelRunnerOutput
    modules["vllm.v1.worker.gpu"].model_runner = runner_module
    if line == "0.33.0":
        modules["vllm.v1.worker.gpu_model_runner"].GPUModelRunner = type("GPUModelRunner", (), {})
        modules["vllm.v1.worker"].gpu_model_runner = modules["vllm.v1.worker.gpu_model_runner"]
    module = import_over(monkeypatch, modules, "serve_bridge.vllm.model_runner_v2")
    return SimpleNamespace(line=line, module=module, modules=modules, LoRARequest=lora_request_cls)


def make_runner(v2, tmp_path, served, slots=True, lag=0):  # noqa: F811
    v2.module.install()  # as the plugin does: the dispatch count is the module function's
    rt = build_runtime(_bundle(tmp_path, served, lag=lag), H, "cpu")
    rt.report_releases = slots
    runner = object.__new__(v2.module.LoRazorGPUModelRunner)
    v2.module._BaseRunner.__init__(runner, SimpleNamespace(lora_config=SimpleNamespace(max_loras=4)), "cpu")
    runner.lorazor, runner.lora_state = rt, v2.module.ReleaseLoraState(runner.max_num_reqs, rt)
    return runner


def lora(v2, adapter, served, lora_id=None, path=None):  # noqa: F811
    """The line's LoRARequest for ``adapter``: its usual id and directory unless given."""
    if adapter is None:
        return None
    return v2.LoRARequest(adapter, lora_id or LORA_ID[adapter], str(path or served[adapter]))


def new_req(v2, req_id, adapter, prompt, served, computed=0, generated=0, extra=None, lora_request=None):  # noqa: F811
    return SimpleNamespace(req_id=req_id, lora_request=lora_request or lora(v2, adapter, served), prompt_len=prompt,
                           prefill_token_ids=list(range(prompt + generated)), num_computed_tokens=computed,
                           sampling_params=SimpleNamespace(extra_args=extra))


def step(new=(), cached=None, scheduled=None, finished=(), preempted=()):
    return SimpleNamespace(scheduled_new_reqs=list(new), cached=cached or {}, num_scheduled_tokens=scheduled,
                           finished_req_ids=set(finished), preempted_req_ids=set(preempted))


def test_the_masked_mapping_reaches_set_active_loras_and_picks_the_cuda_graph(v2, tmp_path, served):  # noqa: F811
    runner = make_runner(v2, tmp_path, served)
    # a: forced release at position 6, chunked prefill of 8 prompt tokens; b: no adapter; c: adapter, not released
    runner.execute_model(step(new=[new_req(v2, "a", "prof2", 8, served, extra={"lorazor": {"release_position": 6}}),
                                   new_req(v2, "b", None, 3, served), new_req(v2, "c", "off", 5, served)],
                              scheduled={"a": 4, "b": 3, "c": 5}))
    (sampled, tokens, requests), = runner.calls
    assert all(type(v) is int for v in tokens + sampled)
    assert tokens == (2,) * 4 + (0,) * 3 + (4,) * 5 and sampled == (2, 0, 4)  # a's positions 0-3: adapter on
    assert requests == {lora(v2, "prof2", served), lora(v2, "off", served)}
    runner.sample_tokens(None)
    runner.execute_model(step(cached={"a": 4, "b": 3, "c": 5}, scheduled={"a": 4, "b": 1, "c": 1}))
    sampled, tokens, requests = runner.calls[-1]
    # batch order: decodes b, c first, then a's last chunk (positions 4-7: 6 and 7 without the adapter)
    assert tokens == (0, 4, 2, 2, 0, 0) and sampled == (0, 4, 0)
    assert runner.dispatched == lora_group_count(np.array(tokens)) == 3  # vLLM would count 2 adapters
    assert requests == {lora(v2, "prof2", served), lora(v2, "off", served)}
    runner.execute_model(step(cached={"a": 8, "b": 4, "c": 6}, scheduled={"a": 1, "c": 1}))
    sampled, tokens, requests = runner.calls[-1]
    assert tokens == (0, 4) and requests == {lora(v2, "off", served)}  # a's adapter need not be resident
    runner.execute_model(step(scheduled={"x": 1}), dummy_run=True)
    assert runner.dispatched == 5  # dummy runs keep vLLM's count (max_loras + 1)


def test_decisions_read_the_sampled_rows_in_batch_order_and_ride_on_the_output(v2, tmp_path, served):  # noqa: F811
    runner = make_runner(v2, tmp_path, served)
    runner.execute_model(step(new=[new_req(v2, "l1", "learn", 5, served), new_req(v2, "l2", "learn", 3, served)],
                              scheduled={"l1": 5, "l2": 3}))
    runner.hidden_rows = {"l1": hidden_for("l1", fire=False), "l2": hidden_for("l2", fire=False)}
    out = runner.sample_tokens(None)
    assert not hasattr(out.model_runner_output, RELEASES_ATTR)  # the prefill rows (zeros) did not fire
    runner.hidden_rows = {"l1": hidden_for("l1", fire=True), "l2": hidden_for("l2", fire=False)}
    # both decode; the scheduler lists l2 first, the sampled rows are in batch order
    runner.execute_model(step(cached={"l2": 3, "l1": 5}, scheduled={"l2": 1, "l1": 1}))
    out = runner.sample_tokens(None).model_runner_output
    assert getattr(out, RELEASES_ATTR) == {"l1": 1}  # decided at forward 1, on l1's own row
    runner.execute_model(step(cached={"l2": 4, "l1": 6}, scheduled={"l2": 1, "l1": 1}))
    sampled, tokens, _ = runner.calls[-1]
    assert dict(zip(["l2", "l1"], tokens)) == {"l2": 3, "l1": 0}  # l1 runs without its adapter from forward 2
    assert not hasattr(runner.sample_tokens(None).model_runner_output, RELEASES_ATTR)  # reported once


def test_a_lag_1_release_rides_on_the_output_of_the_step_that_decided_it(v2, tmp_path, served):  # noqa: F811
    """Under a decision lag of 1 the runtime reads a decision a step late, but the step's own output
    already brings its releases, read where vLLM waits for the step's copy (ReleasesAhead): the
    scheduler, which under async scheduling plans step t + 2 after reading step t's output, hands
    the slot on from the first forward without the adapter. The later read reports the same r."""
    runner = make_runner(v2, tmp_path, served, lag=1)
    runner.execute_model(step(new=[new_req(v2, "l1", "learn", 5, served), new_req(v2, "l2", "learn", 3, served)],
                              scheduled={"l1": 5, "l2": 3}))
    runner.hidden_rows = {"l1": hidden_for("l1", fire=False), "l2": hidden_for("l2", fire=False)}
    out = runner.sample_tokens(None)
    assert isinstance(out, v2.module.ReleasesAhead) and out.get_kv_connector_output() == "kv connector output"
    assert not hasattr(out.get_output(), RELEASES_ATTR)
    runner.hidden_rows = {"l1": hidden_for("l1", fire=True), "l2": hidden_for("l2", fire=False)}
    runner.execute_model(step(cached={"l2": 3, "l1": 5}, scheduled={"l2": 1, "l1": 1}))
    assert runner.lorazor.states["l1"].release is None  # not read on the worker yet
    assert getattr(runner.sample_tokens(None).get_output(), RELEASES_ATTR) == {"l1": 2}  # fired at t = 1, lag 1
    runner.hidden_rows = {"l1": hidden_for("l1", fire=True), "l2": hidden_for("l2", fire=True)}
    runner.execute_model(step(cached={"l2": 4, "l1": 6}, scheduled={"l2": 1, "l1": 1}))
    _, tokens, _ = runner.calls[-1]
    assert dict(zip(["l2", "l1"], tokens)) == {"l2": 3, "l1": 3}  # forward 2 still runs l1's adapter
    out = runner.sample_tokens(None)
    # l1's release read on the worker (the same r); l2 fired at t = 2; l1's second firing changes nothing
    assert getattr(out.get_output(), RELEASES_ATTR) == {"l1": 2, "l2": 3}
    runner.execute_model(step(cached={"l2": 5, "l1": 7}, scheduled={"l2": 1, "l1": 1}))
    _, tokens, _ = runner.calls[-1]
    assert dict(zip(["l2", "l1"], tokens)) == {"l2": 3, "l1": 0}
    assert getattr(runner.sample_tokens(None).get_output(), RELEASES_ATTR) == {"l2": 3}  # read now; nothing new


def test_a_preempted_request_keeps_its_release(v2, tmp_path, served):  # noqa: F811
    runner = make_runner(v2, tmp_path, served)
    runner.execute_model(step(new=[new_req(v2, "p", "prof0", 4, served)], scheduled={"p": 4}))
    runner.sample_tokens(None)  # k = 0: released after its prefill, at position 4
    runner.execute_model(step(cached={"p": 4}, scheduled={"p": 1}))
    assert runner.calls[-1][1] == (0,)
    runner.sample_tokens(None)
    # preempted: the V2 runner drops it, then re-adds it with all its tokens to recompute
    runner.execute_model(step(scheduled={"q": 1}, preempted=["p"],
                              new=[new_req(v2, "q", None, 1, served)]))
    assert "p" in runner.lorazor.states
    runner.execute_model(step(new=[new_req(v2, "p", "prof0", 4, served, generated=2)], cached={"q": 1},
                              scheduled={"p": 6, "q": 1}))
    sampled, tokens, _ = runner.calls[-1]
    assert tokens == (0, 1, 1, 1, 1, 0, 0)  # q decodes first; p's recompute: positions 4, 5 without
    runner.execute_model(step(finished=["p"], cached={"q": 2}, scheduled={"q": 1}))
    assert "p" not in runner.lorazor.states


def test_an_adapter_reloaded_under_its_name_keeps_both_loads_apart(v2, tmp_path, served):  # noqa: F811
    """vLLM 0.34: "prof2" unloaded and loaded again from other weights gets a new id while a request
    of the first load still runs; that request keeps its release, the new one runs full LoRA (its
    weights are not the calibrated ones), and both adapters stay resident while they are used."""
    if v2.line == "0.33.0":
        pytest.skip("vLLM 0.33 equates LoRA requests by name: one name serves one adapter at a time")
    runner = make_runner(v2, tmp_path, served)
    first = lora(v2, "prof2", served)
    runner.execute_model(step(new=[new_req(v2, "old", "prof2", 4, served)], scheduled={"old": 4}))
    runner.sample_tokens(None)
    reloaded = lora(v2, "prof2", served, lora_id=9, path=served["tampered"])
    assert reloaded != first  # 0.34's rule: same name, new id
    runner.execute_model(step(new=[new_req(v2, "new", "prof2", 3, served, lora_request=reloaded)],
                              cached={"old": 4}, scheduled={"old": 1, "new": 3}))
    sampled, tokens, requests = runner.calls[-1]
    assert tokens == (2, 9, 9, 9) and sampled == (2, 9) and requests == {first, reloaded}
    assert runner.dispatched == 2
    runner.sample_tokens(None)
    states = runner.lorazor.states
    assert states["old"].slot == runner.lorazor.slot_of["prof2"] and states["new"].slot == NO_SLOT
    runner.execute_model(step(cached={"old": 5, "new": 3}, scheduled={"old": 1, "new": 1}))
    runner.sample_tokens(None)  # old: forward 2, k = 2: released from here on
    runner.execute_model(step(cached={"old": 6, "new": 4}, scheduled={"old": 1, "new": 1}))
    sampled, tokens, requests = runner.calls[-1]
    assert tokens == (0, 9) and requests == {reloaded}  # the first load need not be resident any more
    assert (states["old"].release, states["new"].release) == (2, None)
    counters = runner.lorazor.counters()["adapters"]["prof2"]  # counted under the served name
    assert (counters["requests"], counters["released"]) == (2, 1)


def test_install_replaces_the_v2_runner_and_the_dispatch_count(v2):
    v2.module.install()
    v2.module.install()  # idempotent
    runner_module = v2.modules["vllm.v1.worker.gpu.model_runner"]
    assert runner_module.GPUModelRunner is v2.module.LoRazorGPUModelRunner
    assert runner_module.get_num_active_loras_for_dispatch is v2.module.num_active_loras_for_dispatch


def test_the_seam_refuses_the_v1_runner_of_0_33_and_0_34_has_none(v2, monkeypatch):
    monkeypatch.setattr(sys.modules["serve_bridge.vllm"], "model_runner_v2", v2.module)  # what the seam imports
    seam = versions.seam(v2.line)
    seam.install_runner()
    seam.install_runner()  # idempotent
    assert v2.modules["vllm.v1.worker.gpu.model_runner"].GPUModelRunner is v2.module.LoRazorGPUModelRunner
    if v2.line == "0.34.0":
        assert "vllm.v1.worker.gpu_model_runner" not in sys.modules  # nothing to refuse, nothing imported
        return
    v1 = v2.modules["vllm.v1.worker.gpu_model_runner"].GPUModelRunner
    assert v1.lorazor_refused and v1.__mro__[2] is object  # wrapped once
    with pytest.raises(BridgeError, match="0.33.0 built its V1 GPU model runner.*runs in the V2 runner"):
        v1(SimpleNamespace(), "cpu")
