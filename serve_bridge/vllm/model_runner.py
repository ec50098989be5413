"""StepTrim inside vLLM 0.26's V1 GPU model runner: one subclass, installed in place of vLLM's.

Per step the runner masks the LoRA mapping by each request's release position (positions at or
after it run without the adapter) and activates only the adapters the masked mapping still uses,
picks the CUDA graph for the real LoRA group count, and launches the step's release decisions on
the sampled rows' final hidden states; with slot hand-back it reports the step's releases to the
scheduler on the step output. The logic lives in :mod:`serve_bridge.runtime`. Which vLLM 0.26.0
methods are hooked, and why tensor-parallel ranks agree without communication:
docs/vllm_integration.md §2-3.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
import vllm.v1.worker.gpu_model_runner as gpu_model_runner
from vllm.lora.layers import LoRAMappingType

from serve_bridge.runtime import ReleaseRuntime, lora_ids
from serve_bridge.vllm.runner_setup import start_runtime
from serve_bridge.vllm.settings import RELEASES_ATTR

_BaseRunner = gpu_model_runner.GPUModelRunner


class LoRazorGPUModelRunner(_BaseRunner):
    """vLLM's V1 GPU model runner with StepTrim release. With ``LORAZOR_GRIDTRIM`` on, the GridTrim
    punica wrapper reads the masked mapping this runner hands to ``_set_active_loras``."""

    def __init__(self, vllm_config: Any, device: Any) -> None:
        runtime = start_runtime(vllm_config, device)
        super().__init__(vllm_config, device)
        self.lorazor: ReleaseRuntime = runtime
        self._lorazor_groups: int | None = None

    def _update_states(self, scheduler_output: Any) -> Any:
        rt = self.lorazor
        for req_id in scheduler_output.finished_req_ids:
            rt.finish(req_id)
        out = super()._update_states(scheduler_output)
        for new in scheduler_output.scheduled_new_reqs:
            lora, params = new.lora_request, new.sampling_params
            rt.add(new.req_id, lora.lora_name if lora else None, lora.lora_path if lora else None,
                   self.requests[new.req_id].num_prompt_tokens, params.extra_args if params is not None else None)
        rt.maybe_log()
        return out

    def set_active_loras(self, input_batch: Any, num_scheduled_tokens: np.ndarray,
                         num_sampled_tokens: np.ndarray | None = None,
                         mapping_type: LoRAMappingType = LoRAMappingType.LANGUAGE) -> None:
        if mapping_type != LoRAMappingType.LANGUAGE:
            return super().set_active_loras(input_batch, num_scheduled_tokens, num_sampled_tokens, mapping_type)
        if num_sampled_tokens is None:
            num_sampled_tokens = np.ones_like(num_scheduled_tokens, dtype=np.int32)
        n = input_batch.num_reqs
        # What InputBatch.make_lora_inputs computes, kept in numpy: each request's LoRA id repeated per
        # scheduled and per sampled token, and the active LoRA requests. Its tuples of numpy scalars
        # would cost ~0.4 ms per 2k-token step to build and read back.
        # Only the adapters of positions that still run with one are activated: a released
        # request's adapter need not be resident (its slot may serve another adapter).
        per_request = input_batch.request_lora_mapping[:n]
        tokens, sampled = per_request.repeat(num_scheduled_tokens), per_request.repeat(num_sampled_tokens)
        step = self.lorazor.begin_step(input_batch.req_ids[:n], input_batch.num_computed_tokens_cpu[:n],
                                       num_scheduled_tokens, input_batch.num_tokens_no_spec[:n], tokens, sampled)
        by_id = input_batch.lora_id_to_lora_request
        lora_requests = {by_id[i] for i in step.adapter_ids}
        self._lorazor_groups = step.lora_groups
        self._set_active_loras(lora_ids(step.sampled_mapping), lora_ids(step.token_mapping), lora_requests,
                               mapping_type)

    def _determine_batch_execution_and_padding(self, *args: Any, **kwargs: Any) -> Any:
        groups, self._lorazor_groups = self._lorazor_groups, None
        if (groups is not None and kwargs.get("force_num_active_loras") is None
                and self.compilation_config.cudagraph_specialize_lora):
            kwargs["force_num_active_loras"] = groups
        return super()._determine_batch_execution_and_padding(*args, **kwargs)

    def _dummy_sampler_run(self, hidden_states: Any) -> Any:
        # vLLM's worker runs the sampler on a dummy batch of max_num_reqs rows at the end of its
        # warm-up, after CUDA graph capture: the decision kernel and its graphs are prepared there too.
        out = super()._dummy_sampler_run(hidden_states)
        with torch.inference_mode():
            self.lorazor.warm_up(hidden_states)
        return out

    def execute_model(self, scheduler_output: Any, intermediate_tensors: Any = None) -> Any:
        out = super().execute_model(scheduler_output, intermediate_tensors)
        state = self.execute_model_state
        if out is None and state is not None:
            capture = getattr(self.lorazor, "capture", None)  # calibration mode only
            if capture is not None:
                capture(state.sample_hidden_states)
            self.lorazor.decide(state.sample_hidden_states)
        return out

    def sample_tokens(self, grammar_output: Any) -> Any:
        out = super().sample_tokens(grammar_output)
        if self.lorazor.report_releases:
            releases = self.lorazor.take_releases()
            if releases:  # only steps that ran a forward decide, and those build a fresh output
                setattr(out, RELEASES_ATTR, releases)
        return out


def install() -> None:
    """Make vLLM's workers build :class:`LoRazorGPUModelRunner` (idempotent)."""
    gpu_model_runner.GPUModelRunner = LoRazorGPUModelRunner
