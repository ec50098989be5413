"""StepTrim inside the V2 GPU model runner of vLLM 0.33 and 0.34 (``vllm/v1/worker/gpu/model_runner.py``).

The same per-step work as the V1 runner's (:mod:`serve_bridge.vllm.model_runner`), at the V2
runner's seams: the step is planned where the batch is gathered, before the CUDA-graph dispatch
(the masked mapping's group count picks the graph); :class:`ReleaseLoraState`, a subclass of
vLLM's ``LoraState``, hands the masked mapping to ``_set_active_loras``; decisions launch on the
forward's hidden states at the sampled rows; learned releases ride on the step output for the
scheduler, those of the step's own decisions too (:class:`ReleasesAhead`). A preempted request
keeps its release state: the V2 runner drops and re-adds it
(``preempted_req_ids``, ``scheduled_new_reqs``), and its recompute is masked by position like
any step. The two lines differ here only in ``make_lora_inputs``' signature; what else differs
is in their seams (:mod:`serve_bridge.vllm.versions`). vLLM lines: docs/vllm_integration.md §2b.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
import vllm.v1.worker.gpu.model_runner as v2_runner
from vllm.v1.outputs import AsyncModelRunnerOutput
from vllm.v1.worker.gpu.lora_utils import LoraState

from serve_bridge.runtime import ReleasePreview, ReleaseRuntime, StepMapping, lora_ids
from serve_bridge.vllm.runner_setup import start_runtime
from serve_bridge.vllm.settings import RELEASES_ATTR

_BaseRunner = v2_runner.GPUModelRunner
_stock_dispatch_count = v2_runner.get_num_active_loras_for_dispatch


class ReleaseLoraState(LoraState):
    """vLLM's per-request LoRA ids (``lora_ids`` by request slot, ``lora_requests`` by id), whose
    step inputs are the release runtime's masked mapping.

    :meth:`plan` masks a step in batch order and keeps it; :meth:`make_lora_inputs` returns it
    once, as vLLM's method would return the unmasked mapping, activating only the adapters the
    masked positions still use.
    """

    def __init__(self, max_num_reqs: int, runtime: ReleaseRuntime) -> None:
        super().__init__(max_num_reqs)
        self.runtime = runtime
        self.step: StepMapping | None = None

    def plan(self, req_ids: list[str], idx_mapping: np.ndarray, num_computed: np.ndarray,
             num_scheduled: np.ndarray, num_tokens: np.ndarray) -> StepMapping:
        """Mask this step: rows ``req_ids`` (batch order) at request slots ``idx_mapping``, each
        scheduling positions [num_computed, num_computed + num_scheduled) of num_tokens known."""
        per_request = self.lora_ids[idx_mapping]
        self.step = self.runtime.begin_step(req_ids, num_computed, num_scheduled, num_tokens,
                                            per_request.repeat(num_scheduled), per_request)
        return self.step

    def make_lora_inputs(self, req_ids: list[str], idx_mapping: np.ndarray, num_scheduled_tokens: np.ndarray,
                         num_logits: np.ndarray | None = None) -> tuple[tuple[int, ...], tuple[int, ...], set[Any]]:
        """The planned step's (lm_head mapping, token mapping, LoRA requests still used). vLLM 0.34
        passes ``num_logits``, the logits rows per request: one each, since speculative decoding is
        refused, so the lm_head mapping is one id per request on both lines. LoRA requests are
        found by request and keyed by id, never compared: vLLM 0.33 equates two requests of one
        name, 0.34 two of one name and id (an adapter reloaded under its name gets a new id)."""
        step, self.step = self.step, None
        if step is None:
            raise RuntimeError("ReleaseLoraState.make_lora_inputs: no step was planned for this batch")
        by_id = {lora.lora_int_id: lora for lora in map(self.lora_requests.get, req_ids) if lora is not None}
        return lora_ids(step.sampled_mapping), lora_ids(step.token_mapping), {by_id[i] for i in step.adapter_ids}


class ReleasesAhead(AsyncModelRunnerOutput):
    """vLLM's asynchronous step output whose ``ModelRunnerOutput`` also holds the releases of the
    decisions still unread on the worker (:class:`serve_bridge.runtime.ReleasePreview`), read where
    vLLM waits for the step's copy to the host: the decisions ran on the same stream before it.
    Releases already read take precedence (they are the same or older)."""

    def __init__(self, inner: AsyncModelRunnerOutput, preview: ReleasePreview) -> None:
        self.inner = inner
        self.preview = preview

    def get_output(self) -> Any:
        out = self.inner.get_output()
        ahead = self.preview.releases()
        if ahead:
            setattr(out, RELEASES_ATTR, ahead | (getattr(out, RELEASES_ATTR, None) or {}))
        return out

    def get_kv_connector_output(self) -> Any:
        return self.inner.get_kv_connector_output()


def num_active_loras_for_dispatch(lora_config: Any, lora_state: Any, req_ids: list[str], dummy_run: bool) -> int:
    """The CUDA-graph LoRA count of a planned step: its masked mapping's kernel groups (the
    no-adapter group included), which released rows can raise above vLLM's adapter count."""
    step = getattr(lora_state, "step", None)
    if lora_config is not None and not dummy_run and step is not None:
        return step.lora_groups
    return _stock_dispatch_count(lora_config, lora_state, req_ids, dummy_run)


class LoRazorGPUModelRunner(_BaseRunner):
    """vLLM's V2 GPU model runner with StepTrim release (module doc)."""

    def __init__(self, vllm_config: Any, device: Any) -> None:
        runtime = start_runtime(vllm_config, device, async_capable=True)
        super().__init__(vllm_config, device)
        self.lorazor: ReleaseRuntime = runtime
        self.lora_state = ReleaseLoraState(self.max_num_reqs, runtime)

    def finish_requests(self, scheduler_output: Any) -> None:
        rt = self.lorazor
        for req_id in scheduler_output.finished_req_ids:  # not preempted_req_ids: those come back
            rt.finish(req_id)
        super().finish_requests(scheduler_output)

    def add_requests(self, scheduler_output: Any) -> None:
        super().add_requests(scheduler_output)
        rt = self.lorazor
        for new in scheduler_output.scheduled_new_reqs:  # a resumed request keeps its state (ReleaseRuntime.add)
            lora, params = new.lora_request, new.sampling_params
            rt.add(new.req_id, lora.lora_name if lora else None, lora.lora_path if lora else None, new.prompt_len,
                   params.extra_args if params is not None else None)
        rt.maybe_log()

    def gather_batch_req_state(self, scheduler_output: Any, dummy_run: bool) -> Any:
        batch, uniform = super().gather_batch_req_state(scheduler_output, dummy_run)
        if batch is not None and self.lora_config:
            idx = batch.idx_mapping_np
            num_computed = self.req_states.num_computed_tokens_np[idx]
            # A row completes a forward unless it is a prefill chunk short of prefill_len
            # (prompt plus, after preemption, the tokens generated before it).
            known = np.maximum(batch.prefill_len_np, num_computed + batch.num_scheduled_tokens)
            self.lora_state.plan(batch.req_ids, idx, num_computed, batch.num_scheduled_tokens, known)
        return batch, uniform

    def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        out = super().execute_model(scheduler_output, *args, **kwargs)
        state, rt = self.execute_model_state, self.lorazor
        if out is None and state is not None and not kwargs.get("dummy_run") and rt.wants_hidden():
            batch = state.input_batch
            hidden = state.hidden_states[batch.logits_indices[:batch.num_reqs]]  # sampled rows, batch order
            capture = getattr(rt, "capture", None)  # calibration mode only
            if capture is not None:
                capture(hidden)
            rt.decide(hidden)
        return out

    def sample_tokens(self, grammar_output: Any) -> Any:
        out = super().sample_tokens(grammar_output)
        rt = self.lorazor
        if rt.report_releases and out is not None:
            releases = rt.take_releases()
            if releases:  # AsyncOutput.get_output() returns this ModelRunnerOutput
                setattr(getattr(out, "model_runner_output", out), RELEASES_ATTR, releases)
            preview = rt.preview_releases()
            if preview is not None and isinstance(out, AsyncModelRunnerOutput):
                out = ReleasesAhead(out, preview)
        return out

    def _dummy_sampler_run(self, hidden_states: torch.Tensor) -> None:
        # profile_run samples a dummy batch (docs/vllm_integration.md §2b): the decision kernel and
        # its CUDA graphs are prepared there, inside the memory profile; 0.34's worker samples once
        # more after capture, and finds them made.
        super()._dummy_sampler_run(hidden_states)
        with torch.inference_mode():
            self.lorazor.warm_up(hidden_states)


def install() -> None:
    """Make vLLM's workers build :class:`LoRazorGPUModelRunner` and dispatch CUDA graphs by the
    masked group count (idempotent)."""
    v2_runner.GPUModelRunner = LoRazorGPUModelRunner
    v2_runner.get_num_active_loras_for_dispatch = num_active_loras_for_dispatch
