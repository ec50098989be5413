"""Every vLLM symbol the integration hooks exists with the signature the hooks rely on
(docs/vllm_integration.md §10). Runs where vLLM is importable, skipped elsewhere."""
from __future__ import annotations

import importlib
import inspect

import pytest

vllm = pytest.importorskip("vllm")

P = inspect.Parameter


def _params(func) -> list[tuple[str, object]]:
    """(name, default) of each parameter but ``self``/``cls``; ``*``/``**`` ones as ``*name``/``**name``."""
    out = []
    for p in inspect.signature(func).parameters.values():
        if p.name in ("self", "cls"):
            continue
        name = {P.VAR_POSITIONAL: f"*{p.name}", P.VAR_KEYWORD: f"**{p.name}"}.get(p.kind, p.name)
        out.append((name, p.default))
    return out


def _names(func) -> list[str]:
    return [name for name, _ in _params(func)]


def _fields(cls: type) -> set[str]:
    """Declared fields of a dataclass, msgspec Struct, NamedTuple or config class (annotations over the MRO)."""
    return {name for klass in cls.__mro__ for name in getattr(klass, "__annotations__", {})}


def _attr(path: str):
    module, _, name = path.rpartition(":")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def test_version_is_the_one_the_hooks_were_written_for():
    from serve_bridge.vllm.settings import SUPPORTED_VLLM

    assert vllm.__version__ == SUPPORTED_VLLM


SIGNATURES = {
    "vllm.plugins:load_general_plugins": [],
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.__init__": ["vllm_config", "device"],
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._update_states": ["scheduler_output"],
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.set_active_loras":
        ["input_batch", "num_scheduled_tokens", "num_sampled_tokens", "mapping_type"],
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._set_active_loras":
        ["prompt_lora_mapping", "token_lora_mapping", "lora_requests", "mapping_type"],
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.execute_model": ["scheduler_output", "intermediate_tensors"],
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._dummy_sampler_run": ["hidden_states"],
    "vllm.v1.worker.gpu_input_batch:InputBatch.make_lora_inputs": ["num_scheduled_tokens", "num_sampled_tokens"],
    "vllm.lora.punica_wrapper.punica_gpu:PunicaWrapperGPU.__init__":
        ["max_num_batched_tokens", "max_batches", "device", "**kwargs"],
    "vllm.lora.punica_wrapper.punica_gpu:PunicaWrapperGPU.update_metadata":
        ["mapping", "lora_index_to_id", "max_loras", "vocab_size", "**kwargs"],
    "vllm.lora.punica_wrapper.punica_gpu:PunicaWrapperGPU.add_lora_linear":
        ["y", "x", "lora_a_stacked", "lora_b_stacked", "scale", "output_slices", "buffer", "**kwargs"],
    "vllm.lora.punica_wrapper.punica_gpu:PunicaWrapperGPU.add_lora_logits":
        ["y", "x", "lora_a_stacked", "lora_b_stacked", "scale", "buffer", "**kwargs"],
    "vllm.lora.punica_wrapper.punica_gpu:PunicaWrapperGPU.add_shrink": ["y", "x", "lora_a_stacked", "scale", "**kwargs"],
    "vllm.lora.punica_wrapper.punica_gpu:PunicaWrapperGPU.add_expand":
        ["y", "x", "lora_b_stacked", "output_slices", "offset_start", "add_inputs", "**kwargs"],
    "vllm.lora.ops.triton_ops.lora_kernel_metadata:LoRAKernelMeta.meta_args": ["token_nums", "specialize_active_lora"],
    "vllm.lora.punica_wrapper.punica_selector:get_punica_wrapper": ["*args", "**kwargs"],
    "vllm.platforms.interface:Platform.get_punica_wrapper": [],
    "vllm.lora.worker_manager:LRUCacheWorkerLoRAManager._apply_adapters": ["lora_requests"],
    "vllm.lora.worker_manager:LRUCacheWorkerLoRAManager.add_adapter": ["lora_request"],
    "vllm.lora.worker_manager:LRUCacheWorkerLoRAManager.list_adapters": [],
    "vllm.lora.model_manager:LoRAModelManager.activate_adapter": ["lora_id"],
    "vllm.lora.model_manager:LoRAModelManager._get_lora_layer_weights": ["lora_model", "module_name"],
    "vllm.lora.layers.base_linear:BaseLinearLayerWithLoRA.set_lora": ["index", "lora_a", "lora_b"],
    "vllm.lora.layers.base_linear:BaseLinearLayerWithLoRA.reset_lora": ["index"],
    "vllm.v1.core.kv_cache_utils:generate_block_hash_extra_keys":
        ["request", "start_token_idx", "end_token_idx", "start_mm_idx"],
    "vllm.entrypoints.llm:LLM.collective_rpc": ["method", "timeout", "args", "kwargs"],
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.sample_tokens": ["grammar_output"],
    "vllm.v1.core.sched.scheduler:Scheduler.schedule": ["throttle_prefills"],
    "vllm.v1.core.sched.scheduler:Scheduler.update_from_output": ["scheduler_output", "model_runner_output"],
    "vllm.v1.core.sched.scheduler:Scheduler.add_request": ["request"],
    "vllm.v1.core.sched.scheduler:Scheduler._free_request": ["request", "delay_free_blocks"],
    "vllm.config.scheduler:SchedulerConfig.get_scheduler_cls": [],
}


@pytest.mark.parametrize("path, names", SIGNATURES.items(), ids=list(SIGNATURES))
def test_hooked_function_signature(path, names):
    assert _names(_attr(path)) == names


def test_defaults_the_overrides_repeat():
    runner = _attr("vllm.v1.worker.gpu_model_runner:GPUModelRunner")
    from vllm.lora.layers import LoRAMappingType

    assert dict(_params(runner.set_active_loras))["num_sampled_tokens"] is None
    assert dict(_params(runner.set_active_loras))["mapping_type"] == LoRAMappingType.LANGUAGE
    assert dict(_params(runner.execute_model))["intermediate_tensors"] is None
    padding = dict(_params(runner._determine_batch_execution_and_padding))
    assert "force_num_active_loras" in padding and padding["force_num_active_loras"] is None
    expand = dict(_params(_attr("vllm.lora.punica_wrapper.punica_gpu:PunicaWrapperGPU.add_expand")))
    assert expand["offset_start"] == 0 and expand["add_inputs"] is True
    assert inspect.signature(_attr("vllm.lora.punica_wrapper.punica_gpu:PunicaWrapperGPU.add_lora_linear")
                             ).parameters["buffer"].kind is P.KEYWORD_ONLY


def test_data_the_hooks_read():
    from vllm.config import CompilationConfig, ParallelConfig
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import NewRequestData
    from vllm.v1.worker.gpu_model_runner import ExecuteModelState

    assert "sample_hidden_states" in _fields(ExecuteModelState)
    assert {"req_id", "sampling_params", "lora_request"} <= _fields(NewRequestData)
    assert "extra_args" in _fields(SamplingParams)
    assert {"lora_name", "lora_path", "lora_int_id", "load_inplace"} <= _fields(LoRARequest)
    assert "cudagraph_specialize_lora" in _fields(CompilationConfig)
    assert "worker_extension_cls" in _fields(ParallelConfig)


@pytest.mark.parametrize("path, fragments", [
    ("vllm.v1.worker.gpu_input_batch:InputBatch.__init__",
     ["self.request_lora_mapping", "self.lora_id_to_lora_request", "self._req_ids", "self.num_computed_tokens_cpu",
      "self.num_tokens_no_spec"]),
    ("vllm.v1.worker.gpu_input_batch:CachedRequestState.__post_init__", ["self.num_prompt_tokens"]),
    ("vllm.lora.punica_wrapper.punica_base:PunicaWrapperBase.__init__",
     ["self._token_lora_indices", "self._sampler_indices", "self._sampler_indices_padded", "self._embeddings_indices",
      "self.indices_len"]),
    ("vllm.lora.punica_wrapper.punica_gpu:PunicaWrapperGPU.__init__", ["self.token_mapping_meta",
                                                                       "self.prompt_mapping_meta"]),
    ("vllm.lora.punica_wrapper.punica_selector:get_punica_wrapper", ["current_platform.get_punica_wrapper()"]),
    ("vllm.v1.worker.gpu_worker:Worker.init_device", ["from vllm.v1.worker.gpu_model_runner import"]),
    ("vllm.lora.model_manager:LoRAModelManager", ["self.punica_wrapper_mapping"]),
])
def test_attributes_set_where_the_hooks_expect_them(path, fragments):
    source = inspect.getsource(_attr(path))
    missing = [f for f in fragments if f not in source]
    assert not missing, f"{path} no longer sets {missing}"


def test_block_pool_imports_the_extra_keys_function_by_name():
    from vllm.v1.core import block_pool, kv_cache_utils

    assert block_pool.generate_block_hash_extra_keys is kv_cache_utils.generate_block_hash_extra_keys or getattr(
        block_pool.generate_block_hash_extra_keys, "lorazor_keyed", False)
