"""Every vLLM symbol the integration hooks exists with the signature the hooks rely on, for the
installed vLLM line (docs/vllm_integration.md §10). Runs where vLLM is importable, skipped elsewhere."""
from __future__ import annotations

import importlib
import importlib.util
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


def test_version_is_one_the_hooks_were_written_for():
    from serve_bridge.vllm import versions

    assert versions.current().VERSION == vllm.__version__ in versions.SUPPORTED


V1 = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
V2 = "vllm.v1.worker.gpu.model_runner:GPUModelRunner"
# The V2 runner's hooks (0.33.0 and 0.34.0, §2b); 0.34's make_lora_inputs gains num_logits, and its
# engine core may take a frontend's prompt block hashes (§7).
V2_SIGNATURES = {
    f"{V2}.__init__": ["vllm_config", "device"],
    f"{V2}.finish_requests": ["scheduler_output"],
    f"{V2}.add_requests": ["scheduler_output"],
    f"{V2}.gather_batch_req_state": ["scheduler_output", "dummy_run"],
    f"{V2}._set_active_loras": ["prompt_lora_mapping", "token_lora_mapping", "lora_requests", "mapping_type"],
    f"{V2}._dummy_sampler_run": ["hidden_states"],
    f"{V2}.sample_tokens": ["grammar_output"],
    "vllm.v1.worker.gpu.model_runner:get_num_active_loras_for_dispatch":
        ["lora_config", "lora_state", "req_ids", "dummy_run"],
    "vllm.v1.worker.gpu.lora_utils:LoraState.__init__": ["max_num_reqs"],
    "vllm.v1.worker.gpu.lora_utils:LoraState.make_lora_inputs": ["req_ids", "idx_mapping", "num_scheduled_tokens"],
    "vllm.v1.worker.gpu.lora_utils:LoraState.get_activate_loras": ["req_ids"],
    "vllm.utils.gpu_sync_debug:gpu_sync_allowed": ["first_only"],
}
# The runner each line's StepTrim hooks (0.26.0: V1, §2; 0.33.0 and 0.34.0: V2, §2b).
RUNNER_SIGNATURES = {
    "0.26.0": {
        f"{V1}.__init__": ["vllm_config", "device"],
        f"{V1}._update_states": ["scheduler_output"],
        f"{V1}.set_active_loras": ["input_batch", "num_scheduled_tokens", "num_sampled_tokens", "mapping_type"],
        f"{V1}._set_active_loras": ["prompt_lora_mapping", "token_lora_mapping", "lora_requests", "mapping_type"],
        f"{V1}.execute_model": ["scheduler_output", "intermediate_tensors"],
        f"{V1}._dummy_sampler_run": ["hidden_states"],
        f"{V1}.sample_tokens": ["grammar_output"],
        "vllm.v1.worker.gpu_input_batch:InputBatch.make_lora_inputs": ["num_scheduled_tokens", "num_sampled_tokens"],
    },
    "0.33.0": V2_SIGNATURES,
    "0.34.0": V2_SIGNATURES | {
        "vllm.v1.worker.gpu.lora_utils:LoraState.make_lora_inputs":
            ["req_ids", "idx_mapping", "num_scheduled_tokens", "num_logits"],
        "vllm.v1.core.kv_cache_utils:frontend_block_hashes": ["request", "prefix_hash_config"],
        "vllm.v1.engine.core:frontend_block_hashes": ["request", "prefix_hash_config"],
    },
}
SIGNATURES = {
    "vllm.plugins:load_general_plugins": [],
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
    "vllm.v1.core.sched.scheduler:Scheduler.schedule": ["throttle_prefills"],
    "vllm.v1.core.sched.scheduler:Scheduler.update_from_output": ["scheduler_output", "model_runner_output"],
    "vllm.v1.core.sched.scheduler:Scheduler.add_request": ["request"],
    "vllm.v1.core.sched.scheduler:Scheduler._free_request": ["request", "delay_free_blocks"],
    "vllm.config.scheduler:SchedulerConfig.get_scheduler_cls": [],
    "vllm.compilation.caching:aot_compile_hash_factors": ["vllm_config"],
}


LINE = RUNNER_SIGNATURES.get(vllm.__version__, {})


@pytest.mark.parametrize("path, names", (SIGNATURES | LINE).items(), ids=list(SIGNATURES | LINE))
def test_hooked_function_signature(path, names):
    assert _names(_attr(path)) == names


# Source fragments per V2 line: where the hooks' calls and module attributes are read (§2b, §0).
V2_SOURCES = {
    "0.33.0": [("vllm.v1.worker.gpu_worker:Worker._make_model_runner",
                ["from vllm.v1.worker.gpu.model_runner import", "from vllm.v1.worker.gpu_model_runner import"])],
    "0.34.0": [("vllm.v1.worker.gpu_worker:Worker._make_model_runner", ["from vllm.v1.worker.gpu.model_runner import"]),
               (V2 + ".execute_model", ["np.diff(input_batch.cu_num_logits_np)"]),
               ("vllm.v1.engine.core:EngineCore.preprocess_add_request",
                ["frontend_block_hashes(request, self.prefix_hash_config)"]),
               ("vllm.platforms.interface:Platform.validate_environ", ['"VLLM_USE_V2_MODEL_RUNNER"', 'value != "1"'])],
}


def test_v2_runner_data_the_hooks_read():
    if vllm.__version__ not in V2_SOURCES:
        pytest.skip("the V2 runner is hooked on vLLM 0.33.0 and 0.34.0")
    from vllm.v1.core.sched.output import NewRequestData
    from vllm.v1.worker.gpu.async_utils import AsyncOutput
    from vllm.v1.worker.gpu.input_batch import InputBatch
    from vllm.v1.worker.gpu.model_runner import BatchReqState, ExecuteModelState

    assert {"input_batch", "hidden_states"} <= set(ExecuteModelState._fields)
    assert {"req_ids", "num_scheduled_tokens", "idx_mapping_np", "prefill_len_np"} <= set(BatchReqState._fields)
    assert {"req_ids", "num_reqs", "logits_indices"} <= _fields(InputBatch)
    assert isinstance(NewRequestData.prompt_len, property)
    for path, fragments in ((V2 + ".__init__", ["self.lora_state = LoraState(", "self.req_states", "self.max_num_reqs"]),
                            (V2 + ".execute_model", ["get_num_active_loras_for_dispatch(", "self.gather_batch_req_state(",
                                                     "self.lora_state.make_lora_inputs(", "hidden_states=hidden_states"]),
                            (V2 + ".finish_requests", ["preempted_req_ids"]),
                            *V2_SOURCES[vllm.__version__]):
        source = inspect.getsource(_attr(path))
        assert all(f in source for f in fragments), (path, [f for f in fragments if f not in source])
    assert "self.model_runner_output" in inspect.getsource(AsyncOutput.get_output)
    # ReleasesAhead: the step output is an AsyncModelRunnerOutput of these two abstract methods,
    # whose get_output() waits for a copy that waited for the main stream
    from vllm.v1.outputs import AsyncModelRunnerOutput

    assert issubclass(AsyncOutput, AsyncModelRunnerOutput)
    assert AsyncModelRunnerOutput.__abstractmethods__ == {"get_output", "get_kv_connector_output"}
    assert "copy_stream.wait_stream(main_stream)" in inspect.getsource(AsyncOutput.__init__)
    assert "self.copy_event.synchronize()" in inspect.getsource(AsyncOutput.get_output)
    assert "AsyncOutput(" in inspect.getsource(_attr(V2 + ".sample_tokens"))


def test_vllm_0_34_has_no_v1_runner_and_takes_frontend_block_hashes():
    if vllm.__version__ != "0.34.0":
        pytest.skip("vLLM 0.34.0's seam")
    from vllm.v1.engine import EngineCoreRequest

    assert importlib.util.find_spec("vllm.v1.worker.gpu_model_runner") is None  # nothing for the seam to refuse
    assert {"block_hashes", "sampling_params"} <= _fields(EngineCoreRequest)


def test_engine_calls_of_calibration_and_the_benchmarks():
    """What labeling.engines.vllm and benchmarks/serving drive besides the hooks: LLMEngine's request
    loop, LLM.generate, output kinds, and the in-process engine core's scheduler (SlotStats)."""
    from vllm.sampling_params import RequestOutputKind

    add = _names(_attr("vllm.v1.engine.llm_engine:LLMEngine.add_request"))
    assert add[:3] == ["request_id", "prompt", "params"] and "lora_request" in add
    assert _names(_attr("vllm.v1.engine.llm_engine:LLMEngine.abort_request"))[0] == "request_ids"
    assert _names(_attr("vllm.v1.engine.llm_engine:LLMEngine.step")) == []
    assert _names(_attr("vllm.v1.engine.llm_engine:LLMEngine.has_unfinished_requests")) == []
    generate = _names(_attr("vllm.entrypoints.llm:LLM.generate"))
    assert generate[:2] == ["prompts", "sampling_params"] and {"use_tqdm", "lora_request"} <= set(generate)
    assert {"DELTA", "FINAL_ONLY"} <= set(RequestOutputKind.__members__)
    for path, fragment in (("vllm.entrypoints.llm:LLM.__init__", "self.llm_engine = LLMEngine"),
                           ("vllm.v1.engine.core_client:InprocClient.__init__", "self.engine_core = EngineCore("),
                           ("vllm.v1.engine.core:EngineCore.__init__", "self.scheduler"),
                           ("vllm.v1.engine.llm_engine:LLMEngine.__init__", "self.vllm_config = vllm_config")):
        assert fragment in inspect.getsource(_attr(path)), path
    # SlotStats: a step's token count against the engine's largest CUDA graph (bench.largest_graph_tokens)
    from vllm.config import CompilationConfig
    from vllm.v1.core.sched.output import SchedulerOutput

    assert "total_num_scheduled_tokens" in _fields(SchedulerOutput)
    assert {"cudagraph_mode", "max_cudagraph_capture_size"} <= _fields(CompilationConfig)


def test_bench_serve_the_benchmark_client_runs():
    """benchmarks/serving/bench_client.py runs `vllm bench serve` as its command line does: vLLM's
    parser from add_cli_args, then main(args), which seeds from --seed on every call."""
    from vllm.benchmarks import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    assert _names(serve.add_cli_args) == ["parser"] and _names(serve.main) == ["args"]
    assert "random.seed(args.seed)" in inspect.getsource(serve.main_async)
    assert "main(args)" in inspect.getsource(_attr("vllm.entrypoints.cli.benchmark.serve:BenchmarkServingSubcommand.cmd"))
    parser = FlexibleArgumentParser()
    serve.add_cli_args(parser)
    args = parser.parse_args(["--dataset-name", "custom", "--lora-assignment", "round-robin", "--save-detailed"])
    assert (args.dataset_name, args.lora_assignment, args.save_detailed) == ("custom", "round-robin", True)


def test_defaults_the_overrides_repeat():
    if vllm.__version__ != "0.26.0":
        pytest.skip("the V1 runner is hooked on vLLM 0.26.0")
    runner = _attr(V1)
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

    if vllm.__version__ == "0.26.0":
        from vllm.v1.worker.gpu_model_runner import ExecuteModelState

        assert "sample_hidden_states" in _fields(ExecuteModelState)
    assert {"req_id", "sampling_params", "lora_request"} <= _fields(NewRequestData)
    assert "extra_args" in _fields(SamplingParams)
    assert {"lora_name", "lora_path", "lora_int_id", "load_inplace"} <= _fields(LoRARequest)
    assert "cudagraph_specialize_lora" in _fields(CompilationConfig)
    assert "worker_extension_cls" in _fields(ParallelConfig)


V1_ATTRIBUTES = [
    ("vllm.v1.worker.gpu_input_batch:InputBatch.__init__",
     ["self.request_lora_mapping", "self.lora_id_to_lora_request", "self._req_ids", "self.num_computed_tokens_cpu",
      "self.num_tokens_no_spec"]),
    ("vllm.v1.worker.gpu_input_batch:CachedRequestState.__post_init__", ["self.num_prompt_tokens"]),
    ("vllm.v1.worker.gpu_worker:Worker.init_device", ["from vllm.v1.worker.gpu_model_runner import"]),
]


@pytest.mark.parametrize("path, fragments", (V1_ATTRIBUTES if vllm.__version__ == "0.26.0" else []) + [
    ("vllm.lora.punica_wrapper.punica_base:PunicaWrapperBase.__init__",
     ["self._token_lora_indices", "self._sampler_indices", "self._sampler_indices_padded", "self._embeddings_indices",
      "self.indices_len"]),
    ("vllm.lora.punica_wrapper.punica_gpu:PunicaWrapperGPU.__init__", ["self.token_mapping_meta",
                                                                       "self.prompt_mapping_meta"]),
    ("vllm.lora.punica_wrapper.punica_selector:get_punica_wrapper", ["current_platform.get_punica_wrapper()"]),
    ("vllm.lora.model_manager:LoRAModelManager", ["self.punica_wrapper_mapping"]),
])
def test_attributes_set_where_the_hooks_expect_them(path, fragments):
    source = inspect.getsource(_attr(path))
    missing = [f for f in fragments if f not in source]
    assert not missing, f"{path} no longer sets {missing}"


def test_compile_cache_factors_are_read_at_call_time():
    """The compiled model imports ``aot_compile_hash_factors`` when it compiles (docs/vllm_integration.md
    §4b), so GridTrim's wrapper of the caching module's function is the one it calls."""
    from vllm.compilation import decorators

    assert "\n            from .caching import aot_compile_hash_factors\n" in inspect.getsource(decorators)
    assert not hasattr(decorators, "aot_compile_hash_factors")


def test_block_pool_imports_the_extra_keys_function_by_name():
    from vllm.v1.core import block_pool, kv_cache_utils

    assert block_pool.generate_block_hash_extra_keys is kv_cache_utils.generate_block_hash_extra_keys or getattr(
        block_pool.generate_block_hash_extra_keys, "lorazor_keyed", False)
