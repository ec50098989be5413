"""The private vLLM 0.26.0 APIs the bridge hooks, all in one runner subclass.

Imported only when the bridge is active (vLLM is a hard dependency here). Every hook names
the file:line of vLLM 0.26.0 it relies on (paths inside the ``vllm`` package); the logic
itself lives in :mod:`serve_bridge.runtime`.

- ``v1/worker/gpu_worker.py:412-416``: ``Worker.init_device`` imports
  ``vllm.v1.worker.gpu_model_runner.GPUModelRunner`` lazily and builds the V1 runner from it,
  so :func:`install` replaces that module attribute with :class:`LoRazorGPUModelRunner`
  before any worker starts.
- ``v1/worker/gpu_model_runner.py:1169`` ``_update_states``: requests finish
  (``scheduler_output.finished_req_ids``) and start (``scheduled_new_reqs``, whose
  ``CachedRequestState`` — ``v1/worker/gpu_input_batch.py:34``, ``num_prompt_tokens`` at :68 —
  is in ``self.requests``). Each ``NewRequestData`` (``v1/core/sched/output.py:33``) carries
  the request's ``SamplingParams`` (:37, copied from the request at :59; the runner keeps it at
  ``gpu_model_runner.py:1251,1278``), whose ``extra_args`` (``sampling_params.py:324``) hold the
  per-request LoRazor arguments (uid, forced release; :func:`serve_bridge.runtime.request_args`).
- ``v1/worker/lora_model_runner_mixin.py:73`` ``set_active_loras``, called once per step by
  ``_prepare_inputs`` (``gpu_model_runner.py:2252``): the mapping is what
  ``InputBatch.make_lora_inputs`` (``gpu_input_batch.py:979-1002``) computes from
  ``request_lora_mapping`` and ``lora_id_to_lora_request``, is masked by release position, and
  goes to ``_set_active_loras`` (``lora_model_runner_mixin.py:48``) with only the adapters the
  masked mapping still uses: a released request's adapter need not be resident, so its slot
  can serve another adapter (:mod:`serve_bridge.vllm.scheduler`). Per-row
  inputs: ``req_ids`` (:307), ``num_computed_tokens_cpu`` (:171, positions are
  ``num_computed + query offset`` as in ``gpu_model_runner.py:1969-1972``),
  ``num_tokens_no_spec`` (:157).
- ``v1/worker/gpu_model_runner.py:3877`` ``_determine_batch_execution_and_padding``: the
  adapter count for CUDA graph dispatch is ``len(input_batch.lora_id_to_lora_request)``
  (:3913-3917), which omits the no-adapter group that the kernel metadata counts
  (``lora/ops/triton_ops/lora_kernel_metadata.py:143-162``); the hook passes the real group
  count as ``force_num_active_loras`` (DESIGN §4).
- ``v1/worker/gpu_model_runner.py:4111`` ``execute_model``: when it returns None it has left
  ``ExecuteModelState.sample_hidden_states`` (:436-445, set at :4460) — the final-norm hidden
  states of the sampled positions, one row per request in batch order — for
  ``sample_tokens``; the hook launches the step's decisions on them there (and, in calibration
  mode, records s_t and h_t from the same rows).
- ``v1/worker/gpu_model_runner.py:4497`` ``sample_tokens``: with slot hand-back, the releases
  decided in the step ride on the ``ModelRunnerOutput`` it returns (built fresh at :4711) as
  ``RELEASES_ATTR``, for the scheduler (``docs/vllm_integration.md``, "Release-aware slots").

Tensor parallelism (``tensor_parallel_size`` N > 1; pipeline parallelism is refused,
``serve_bridge.vllm.settings.require_supported_engine``). Every rank is a worker process with its own
runner (``v1/executor/multiproc_executor.py:985-1001``: each worker dequeues the same broadcast
``execute_model`` / ``sample_tokens`` call with the same ``SchedulerOutput``; only rank 0's
output goes back, ``:310-320``, ``:498-510``), so every rank has its own
:class:`~serve_bridge.runtime.ReleaseRuntime` and decides on its own. The release mapping must be
the same on all ranks: a rank that masked a row the others did not would add a partial LoRA term
in row-parallel layers (``lora/layers/row_parallel_linear.py:72-76``) and give silently wrong
outputs. It is, without any communication, because every input of a decision is replicated:

- The plan (rows, slots, forwards t) comes from the scheduler output and the runner's request
  states, identical on all ranks; each runner appends its own sampled tokens to its input batch
  (``gpu_model_runner.py:3785-3791``; only ranks that are not the last pipeline stage take them
  from the scheduler, :1385-1405), so vLLM itself already relies on every TP rank sampling the
  same tokens: it all-gathers the logits to every rank (``model_executor/layers/
  logits_processor.py:85-97``, ``use_all_gather`` True on CUDA, ``platforms/interface.py:
  1096-1100``) and seeds every worker alike (``v1/worker/gpu_worker.py:380-381``).
- The hidden states (``sample_hidden_states``, ``gpu_model_runner.py:4428``) are the final norm
  of the residual stream (``model_executor/models/llama.py:435``), which every rank computes
  redundantly from all-reduced values: the embedding (``vocab_parallel_embedding.py:491``, its
  LoRA added after, with the full B, ``lora/layers/vocal_parallel_embedding.py:106-121``), and
  each row-parallel o/down projection (``model_executor/layers/linear.py:1694-1695``; the LoRA
  terms, sharded or not, enter before that all-reduce or through an all-gather of the LoRA buffer,
  see :mod:`serve_bridge.gridtrim`). Norms and residual adds are deterministic per-element
  kernels. At N = 2 each all-reduced element is one sum a + b of the two ranks' values, and IEEE
  addition is commutative, so both ranks hold the same bits whichever rank adds (NCCL, vLLM's
  custom all-reduce); nondeterminism before the all-reduce (vLLM's split-K shrink adds with
  float atomics) changes the value, not its equality across ranks. At N > 2 this rests on the
  all-reduce giving every rank the same result (reduce-then-broadcast, or a sum in rank order),
  which the CUDA sources decide (not in the Python package; not checked here).
- The decision (:meth:`serve_bridge.steptrim.StepTrim.fires`: a gather, a row dot product, a
  comparison; the profiled rule on the host) is deterministic on identical inputs and GPUs.

So the ranks take identical decisions on identical GPUs, and no broadcast of rank 0's decision
is added (it would put a collective, and a dependency on the TP group, on every decision step).
Ranks on different GPU models could pick different kernels for the replicated norm and
decision and lose bit equality; that is not supported. ``benchmarks/serve_bridge/
check_correctness.py --tensor-parallel-size 2`` checks it on the device: every rank's release
records and counters must match (its check (e)).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
import vllm.v1.worker.gpu_model_runner as gpu_model_runner
from vllm.lora.layers import LoRAMappingType

from serve_bridge.runtime import ReleaseRuntime, build_runtime, logger, lora_ids
from serve_bridge.vllm.settings import (RELEASES_ATTR, BridgeError, BridgeSettings, require_slot_engine,
                                        require_supported_engine)

_BaseRunner = gpu_model_runner.GPUModelRunner


class LoRazorGPUModelRunner(_BaseRunner):
    """vLLM's V1 GPU model runner with StepTrim release.

    GridTrim sits beside it without touching the release path:
    :class:`serve_bridge.vllm.punica_wrapper.GridTrimPunicaWrapper`, selected by qualname through
    ``CudaPlatform.get_punica_wrapper`` (``platforms/cuda.py:551``, resolved in
    ``lora/punica_wrapper/punica_selector.py:13-15``) when ``LORAZOR_GRIDTRIM`` is on; it reads
    the masked mapping this runner hands to ``_set_active_loras``.
    """

    def __init__(self, vllm_config: Any, device: Any) -> None:
        settings = BridgeSettings.from_env()
        if settings is None:
            raise BridgeError("LoRazorGPUModelRunner was built without LORAZOR_BUNDLE or LORAZOR_CALIBRATION; the "
                              "plugin installs it only when one of them is set in every vLLM process.")
        require_supported_engine(vllm_config, calibration=settings.calibration)
        if settings.slots:
            require_slot_engine(vllm_config)
        hidden_size = vllm_config.model_config.get_hidden_size()
        runtime = build_runtime(settings, hidden_size, device,
                                prefix_caching=bool(vllm_config.cache_config.enable_prefix_caching))
        runtime.report_releases = settings.slots
        super().__init__(vllm_config, device)
        self.lorazor: ReleaseRuntime = runtime
        self._lorazor_groups: int | None = None
        if settings.calibration:
            logger.info("LoRazor calibration runtime active (hidden size %d); policies come over collective_rpc.",
                        hidden_size)
        else:
            logger.info("LoRazor StepTrim active: bundle %s (%d adapters with policies, hidden size %d).",
                        settings.bundle, len(runtime.slot_of), hidden_size)

    def _update_states(self, scheduler_output: Any) -> Any:
        rt = self.lorazor
        rt.resolve()
        for req_id in scheduler_output.finished_req_ids:
            rt.finish(req_id)
        out = super()._update_states(scheduler_output)
        for new in scheduler_output.scheduled_new_reqs:
            lora, params = new.lora_request, new.sampling_params  # output.py:37,41
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
        # What InputBatch.make_lora_inputs computes (gpu_input_batch.py:994-1000), kept in numpy: each
        # request's LoRA id repeated per scheduled and per sampled token, and the active LoRA requests.
        # Its tuples of numpy scalars would cost ~0.4 ms per 2k-token step to build and read back.
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
        # warm-up, after CUDA graph capture (v1/worker/gpu_worker.py:876-884; also in profile_run,
        # gpu_model_runner.py:6431): the decision kernel and its graphs are prepared there too.
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
