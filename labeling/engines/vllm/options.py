"""``engine=vllm``'s options (the config schema of conf/engine/vllm.yaml) and what they become:
``vllm.LLM``'s arguments, the environment every vLLM process needs, and the hf engine's stop set."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from labeling.adapters import AdapterSpec
from labeling.options import CheckedOptions
from serve_bridge.vllm.settings import BUNDLE_ENV, CALIBRATION_ENV
from serve_bridge.vllm.versions import SUPPORTED as SUPPORTED_VLLM  # these three also serve engine=auto
from serve_bridge.vllm.versions import installed_version as installed_vllm
from serve_bridge.vllm.versions import runner_environment
from serve_bridge.vllm.versions import supported_text as supported_vllm_text

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # config/lora.py:27 MaxLoRARanks


@dataclass
class VLLMOptions(CheckedOptions):
    """vLLM engine options (a supported vLLM, docs/serving.md), GPU only (``pip install 'lorazor[vllm]'``).

    The engine runs serve_bridge's calibration runtime inside vLLM (it sets
    LORAZOR_CALIBRATION=1 and the runner its vLLM line needs itself, and runs vLLM's engine core
    in-process), so release, s_t and h_t come from the same StepTrim code as serving. Fixed, not
    options: LoRA on and async scheduling off (``serve_bridge.vllm.settings.require_supported_engine``).
    """

    rules = {"dtype": ("bfloat16", "float16", "float32", "auto"), "gpu_memory_utilization": "fraction",
             "max_num_seqs": "optional_positive_int", "max_num_batched_tokens": "optional_positive_int",
             "max_model_len": "optional_positive_int", "kv_cache_memory_bytes": "optional_positive_int",
             "tensor_parallel_size": "positive_int",
             "data_parallel_size": "positive_int", "max_cudagraph_capture_size": "optional_positive_int",
             "max_lora_rank": "auto_or_positive_int"}

    name: str = "vllm"
    # Model dtype in vLLM (bfloat16 | float16 | float32 | auto). Greedy tokens can differ from the
    # float32 hf engine where two logits are within rounding (benchmarks/engines/compare_engines.py).
    dtype: str = "bfloat16"
    # Fraction of each GPU's memory vLLM may use (weights + KV cache + activations).
    gpu_memory_utilization: float = 0.85
    # KV cache per GPU in bytes; None = what gpu_memory_utilization leaves after vLLM's profiling pass.
    # Set it to start the engine beside other GPU processes: vLLM then skips its memory-profiling
    # check, which stops start-up when another process's memory changes meanwhile
    # (v1/worker/gpu_worker.py:656-680 in 0.33.0, :688-712 in 0.34.0; an EngineArgs field in 0.26.0).
    kv_cache_memory_bytes: int | None = None
    # Scheduler limits: concurrent requests, and tokens per step (long prompts are chunked).
    # None = vLLM's own default for the GPU (vllm/engine/arg_utils.py:2459-2480, 0.26.0): 1024 and
    # 16384 on GPUs with >= 70 GiB (H100, H200), else 256 and 8192. On SmolLM2-135M, 1024 labeled
    # 1.47x faster than 256 (benchmarks/results/2026-11-30-engines.md); lower them if KV-cache memory is short.
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    # Longest prompt + response in tokens; None = the model's own limit.
    max_model_len: int | None = None
    # GPUs per engine (tensor parallel), and engines (data parallel: independent replicas, one
    # process each on its own tensor_parallel_size GPUs; requests are split among them).
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    # true: no CUDA graphs (slower decode, faster start-up).
    enforce_eager: bool = False
    # Largest batch (tokens) replayed as a CUDA graph; larger steps run without one. None = vLLM's
    # default, min(2 x max_num_seqs, 512) (config/compilation.py, max_cudagraph_capture_size). The
    # OFF pass runs about 1000 branches at once with 1024 sequences, so its decode steps exceed
    # 512; on a small backbone those steps are bound by the host. 1024 captures them: on the H200,
    # GSM8K, 512 requests, SmolLM2, it labeled 1.34x faster than None (16167 vs 12041 tokens/s, no
    # slower start-up), with 98.2% of labels equal to the hf engine's on 128 requests
    # (benchmarks/results/2026-11-30-engines.md).
    max_cudagraph_capture_size: int | None = 1024
    # vLLM's LoRA rank bound: auto = the adapters' largest rank rounded up to one vLLM supports.
    max_lora_rank: str = "auto"
    # vLLM's progress bars, named after the pass.
    progress: bool = True
    # Labeling and sweep passes: start each request's OFF branches as soon as its ON response
    # finishes, in the same engine run (false: one generate for all ON responses, then one for all
    # OFF branches). Same requests and semantics either way; only the batching differs.
    # Data-parallel replicas always run the two generates.
    pipeline: bool = True
    # true: vLLM caches prefix KV blocks, keyed by forced release position
    # (serve_bridge.vllm.prefix_cache), so each OFF branch reuses the prompt and ON-prefix blocks of its
    # ON request instead of re-prefilling them. Passes with a release policy (test and agreement
    # stages) are then refused: run those with false. Off by default: a whole pipeline with true
    # stops at its test stage, and the gain is not clear (on the H200, 1.30x and 1.55x faster on
    # 128 requests but 0.86x on 512; labels equal to the hf engine's on 97.1-97.5% of points,
    # benchmarks/results/2026-11-30-engines.md).
    prefix_caching: bool = False


def lora_rank(adapters: list[AdapterSpec]) -> int:
    """The smallest vLLM ``max_lora_rank`` that holds every adapter's rank (rank_pattern included)."""
    rank = 1
    for spec in adapters:
        cfg = json.loads((Path(spec.path) / "adapter_config.json").read_text())
        rank = max([rank, int(cfg.get("r", 8)), *(int(v) for v in (cfg.get("rank_pattern") or {}).values())])
    for allowed in LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(f"adapter rank {rank} exceeds vLLM's largest max_lora_rank {LORA_RANKS[-1]}")



def llm_kwargs(model_dir: str, adapters: list[AdapterSpec], options: VLLMOptions) -> dict[str, Any]:
    """``vllm.LLM`` arguments from the options.

    Fixed by the bridge (``serve_bridge.vllm.settings.require_supported_engine``): LoRA on, async
    scheduling off. Prefix caching follows ``prefix_caching``. ``max_lora_rank: auto`` → the
    adapters' largest rank, rounded up to a rank vLLM supports. ``max_cudagraph_capture_size``
    goes into ``compilation_config``. ``data_parallel_size`` is not an ``LLM`` argument (vLLM 0.26
    refuses it in one process, ``entrypoints/llm.py:280-292``): see
    :mod:`labeling.engines.vllm.data_parallel`.
    """
    if not adapters:
        raise ValueError("engine=vllm needs at least one adapter (the bridge runs with LoRA enabled).")
    kw: dict[str, Any] = {
        "model": str(model_dir), "tokenizer": str(model_dir), "dtype": options.dtype,
        "enable_lora": True, "max_loras": len(adapters), "max_cpu_loras": len(adapters),
        "max_lora_rank": lora_rank(adapters) if options.max_lora_rank == "auto" else int(options.max_lora_rank),
        "enable_prefix_caching": options.prefix_caching, "async_scheduling": False,
        "gpu_memory_utilization": options.gpu_memory_utilization,
        "tensor_parallel_size": options.tensor_parallel_size, "enforce_eager": options.enforce_eager, "seed": 0}
    for key in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "kv_cache_memory_bytes"):
        if getattr(options, key) is not None:
            kw[key] = getattr(options, key)
    if options.max_cudagraph_capture_size is not None:
        kw["compilation_config"] = {"max_cudagraph_capture_size": options.max_cudagraph_capture_size}
    return kw


def stop_ids_for(model_dir: str, tokenizer: Any, spec: Any) -> set[int]:
    """The hf engine's stop set (``labeling.backbone.stop_token_ids``) without loading weights:
    the generation config as ``from_pretrained`` would give it to the model."""
    from transformers import AutoConfig, GenerationConfig

    from labeling.backbone import stop_token_ids

    try:
        gen = GenerationConfig.from_pretrained(model_dir)
    except OSError:
        gen = GenerationConfig.from_model_config(AutoConfig.from_pretrained(model_dir))
    return stop_token_ids(gen, tokenizer, spec)


def prepare_environment(environ: dict[str, str] | os._Environ = os.environ, vllm_version: str | None = None) -> None:
    """The variables every vLLM process must see before ``LLM`` starts: the calibration runtime
    (no bundle), the runner switch of the vLLM line (``vllm_version``, default the installed one,
    read without importing it: V1 on 0.26, V2 on 0.33, none on 0.34, whose only runner is V2), and
    the engine core in this process (so ``collective_rpc`` callables need no insecure
    serialization, see :mod:`serve_bridge.vllm.rpc`)."""
    environ.pop(BUNDLE_ENV, None)
    environ[CALIBRATION_ENV] = "1"
    # another vLLM gets no runner switch: the plugin refuses it, in one line, when the engine starts
    environ.update(runner_environment(vllm_version))
    environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
