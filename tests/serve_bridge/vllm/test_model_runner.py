"""The StepTrim runner's ``set_active_loras`` (serve_bridge/vllm/model_runner.py) against stand-ins for
the two vLLM 0.26 modules it imports: the masked mapping it hands to ``_set_active_loras`` equals
``InputBatch.make_lora_inputs``'s (``v1/worker/gpu_input_batch.py:979-1002``) with released
positions mapped to no adapter, as Python ints."""
from __future__ import annotations

import enum
from types import ModuleType, SimpleNamespace

import numpy as np
import pytest
import torch

from serve_bridge.runtime import build_runtime, lora_group_count
from serve_bridge.vllm.settings import RELEASES_ATTR
from tests.serve_bridge.test_runtime import H, _bundle, served  # noqa: F401 - served is a fixture
from tests.serve_bridge.vllm.stubs import import_over


def make_lora_inputs(batch, num_scheduled, num_sampled):
    """vLLM 0.26's InputBatch.make_lora_inputs (gpu_input_batch.py:994-1002), restated."""
    per_request = batch.request_lora_mapping[:batch.num_reqs]
    return (tuple(per_request.repeat(num_sampled)), tuple(per_request.repeat(num_scheduled)),
            set(batch.lora_id_to_lora_request.values()))


@pytest.fixture
def hooks(monkeypatch):
    """serve_bridge.vllm.model_runner imported over stand-ins of vllm.v1.worker.gpu_model_runner (a base
    runner that records _set_active_loras) and vllm.lora.layers (LoRAMappingType)."""
    class GPUModelRunner:
        def _set_active_loras(self, prompt_mapping, token_mapping, lora_requests, mapping_type):
            self.calls.append((prompt_mapping, token_mapping, lora_requests, mapping_type))

        def set_active_loras(self, input_batch, num_scheduled, num_sampled=None, mapping_type=None):
            self.calls.append(("stock", mapping_type))

        def sample_tokens(self, grammar_output):
            return SimpleNamespace(req_ids=["stand-in output"])

    mapping_type = enum.Enum("LoRAMappingType", "LANGUAGE TOWER CONNECTOR")
    modules = {"vllm": ModuleType("vllm"), "vllm.v1": ModuleType("vllm.v1"),
               "vllm.v1.worker": ModuleType("vllm.v1.worker"),
               "vllm.v1.worker.gpu_model_runner": ModuleType("vllm.v1.worker.gpu_model_runner"),
               "vllm.lora": ModuleType("vllm.lora"), "vllm.lora.layers": ModuleType("vllm.lora.layers")}
    modules["vllm.v1.worker.gpu_model_runner"].GPUModelRunner = GPUModelRunner
    modules["vllm.lora.layers"].LoRAMappingType = mapping_type
    modules["vllm.v1.worker"].gpu_model_runner = modules["vllm.v1.worker.gpu_model_runner"]
    module = import_over(monkeypatch, modules, "serve_bridge.vllm.model_runner")
    return module, mapping_type


def test_set_active_loras_masks_released_positions_and_hands_over_ints(hooks, tmp_path, served):  # noqa: F811
    module, mapping_type = hooks
    rt = build_runtime(_bundle(tmp_path, served), H, "cpu")
    # a: adapter id 3, forced release at position 6; b: no adapter; c: adapter id 5, not released
    rt.add("a", "prof2", str(served["prof2"]), 4, {"lorazor": {"release_position": 6}})
    rt.add("b", None, None, 3)
    rt.add("c", "off", str(served["off"]), 5)
    batch = SimpleNamespace(num_reqs=3, req_ids=["a", "b", "c", "stale"],
                            request_lora_mapping=np.array([3, 0, 5, 7], dtype=np.int32),
                            lora_id_to_lora_request={3: "lora-3", 5: "lora-5"},
                            num_computed_tokens_cpu=np.array([4, 3, 0, 0]), num_tokens_no_spec=np.array([8, 4, 5, 0]))
    runner = object.__new__(module.LoRazorGPUModelRunner)
    runner.calls, runner.lorazor, runner._lorazor_groups = [], rt, None
    scheduled = np.array([4, 1, 5], dtype=np.int32)
    runner.set_active_loras(batch, scheduled, None, mapping_type.LANGUAGE)

    (sampled, tokens, requests, kind), = runner.calls
    ref_sampled, ref_tokens, ref_requests = make_lora_inputs(batch, scheduled, np.ones(3, dtype=np.int32))
    # a schedules positions 4..7: 6 and 7 run without the adapter, and so does its sampled row (7)
    assert tokens == (3, 3, 0, 0, 0, 5, 5, 5, 5, 5) == tuple(0 if i in (2, 3) else v for i, v in enumerate(ref_tokens))
    assert sampled == (0, 0, 5) and ref_sampled == (3, 0, 5)
    assert all(type(v) is int for v in tokens + sampled)
    assert requests == ref_requests == {"lora-3", "lora-5"} and kind is mapping_type.LANGUAGE
    assert runner._lorazor_groups == lora_group_count(np.array(tokens)) == 3  # 3, 5 and no adapter

    runner.set_active_loras(batch, scheduled, None, mapping_type.TOWER)  # other mappings: vLLM's own
    assert runner.calls[-1] == ("stock", mapping_type.TOWER)


def test_released_adapters_are_not_made_resident_and_releases_ride_on_the_output(hooks, tmp_path, served):  # noqa: F811
    module, mapping_type = hooks
    rt = build_runtime(_bundle(tmp_path, served), H, "cpu")
    rt.add("a", "prof0", str(served["prof0"]), 4)  # profiled k = 0: released after its prefill
    rt.add("c", "off", str(served["off"]), 4)
    rt.report_releases = True
    batch = SimpleNamespace(num_reqs=2, req_ids=["a", "c"], request_lora_mapping=np.array([3, 5], dtype=np.int32),
                            lora_id_to_lora_request={3: "lora-3", 5: "lora-5"},
                            num_computed_tokens_cpu=np.array([0, 0]), num_tokens_no_spec=np.array([4, 4]))
    runner = object.__new__(module.LoRazorGPUModelRunner)
    runner.calls, runner.lorazor, runner._lorazor_groups = [], rt, None
    runner.set_active_loras(batch, np.array([4, 4], dtype=np.int32), None, mapping_type.LANGUAGE)
    assert runner.calls[-1][2] == {"lora-3", "lora-5"}  # both prefill with their adapters
    rt.decide(torch.zeros(2, H))
    out = runner.sample_tokens(None)
    assert getattr(out, RELEASES_ATTR) == {"a": 0}  # the scheduler learns a's release with this step's output
    assert not hasattr(runner.sample_tokens(None), RELEASES_ATTR)  # reported once
    batch.num_computed_tokens_cpu[:], batch.num_tokens_no_spec[:] = 4, 5
    runner.set_active_loras(batch, np.array([1, 1], dtype=np.int32), None, mapping_type.LANGUAGE)
    sampled, tokens, requests, _ = runner.calls[-1]
    assert tokens == (0, 5) and requests == {"lora-5"}  # a's adapter need not be resident any more
    assert runner._lorazor_groups == 2
    rt.report_releases = False
    assert not hasattr(runner.sample_tokens(None), RELEASES_ATTR)
