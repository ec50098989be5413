"""``engine=auto``: the engine to run, chosen from facts probed on this machine.

vLLM when CUDA is available and a supported vLLM (docs/serving.md) is installed; else the hf engine on
CUDA when CUDA is available; else the hf engine on the CPU. On vLLM, one replica per visible GPU (data
parallel), unless the model's weights do not fit one GPU: then the smallest power-of-two
tensor-parallel size whose share of the weights fits, and as many replicas as the GPUs hold.
"Fits" leaves room for the KV cache: the weights' share may take at most
:data:`WEIGHT_SHARE` of the memory vLLM may use on a GPU (``gpu_memory_utilization`` × the
GPU's memory). Every choice comes with one line saying what was chosen and why.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from labeling.engines.hf import HFOptions
from labeling.engines.vllm.options import SUPPORTED_VLLM, VLLMOptions, installed_vllm, supported_vllm_text

WEIGHT_SHARE = 0.5  # of the memory vLLM may use per GPU; the rest is KV cache and activations
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 2}
GIB = 1024 ** 3


@dataclass
class AutoOptions:
    """``engine=auto``'s options: only what every engine has."""

    name: str = "auto"
    progress: bool = True


@dataclass(frozen=True)
class MachineFacts:
    """What the choice depends on. gpu_memory: bytes of the smallest visible GPU (0 without CUDA);
    vllm_version: the installed vLLM's version, None when it is not installed."""

    cuda: bool
    gpus: int
    gpu_memory: int
    vllm_version: str | None


@dataclass(frozen=True)
class EngineChoice:
    options: HFOptions | VLLMOptions
    reason: str


def probe_facts() -> MachineFacts:
    """This machine's facts (torch's view of CUDA, honouring CUDA_VISIBLE_DEVICES)."""
    import torch

    cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if cuda else 0
    memory = min((torch.cuda.get_device_properties(i).total_memory for i in range(gpus)), default=0)
    return MachineFacts(cuda=cuda and gpus > 0, gpus=gpus, gpu_memory=memory, vllm_version=installed_vllm())


def tensor_parallel_size(weight_bytes: int, facts: MachineFacts, utilization: float) -> int:
    """The smallest power of two ≤ the GPU count whose share of the weights fits one GPU
    (module docstring); all GPUs (rounded down to a power of two) if none does."""
    budget = WEIGHT_SHARE * utilization * facts.gpu_memory
    tp = 1
    while weight_bytes / tp > budget and tp * 2 <= facts.gpus:
        tp *= 2
    return tp


def resolve_engine(facts: MachineFacts, parameters: Callable[[], int], model: str,
                   options: AutoOptions) -> EngineChoice:
    """The engine for ``facts``; ``parameters()`` (the backbone's parameter count) is called only
    when vLLM is chosen, to size tensor parallelism."""
    if not facts.cuda:
        return EngineChoice(HFOptions(device="cpu", progress=options.progress),
                            "engine=auto → hf on cpu: no CUDA device is visible.")
    if facts.vllm_version not in SUPPORTED_VLLM:
        found = f"vllm {facts.vllm_version} is installed" if facts.vllm_version else "vllm is not installed"
        return EngineChoice(HFOptions(device="cuda", progress=options.progress),
                            f"engine=auto → hf on cuda (one GPU): {found}, the vLLM engine needs "
                            f"{supported_vllm_text()}.")
    vllm = VLLMOptions(progress=options.progress)
    weights = parameters() * DTYPE_BYTES[vllm.dtype]
    tp = tensor_parallel_size(weights, facts, vllm.gpu_memory_utilization)
    dp = max(1, facts.gpus // tp)
    vllm.tensor_parallel_size, vllm.data_parallel_size = tp, dp
    size = (f"{model} weighs {weights / GIB:.1f} GiB in {vllm.dtype}, {facts.gpus} GPU(s) of "
            f"{facts.gpu_memory / GIB:.0f} GiB")
    if tp == 1:
        layout = f"it fits one GPU: {dp} data-parallel replica(s)"
    elif weights / tp <= WEIGHT_SHARE * vllm.gpu_memory_utilization * facts.gpu_memory:
        layout = f"it needs tensor_parallel_size={tp} to fit: {dp} replica(s) of {tp} GPUs"
    else:
        layout = f"it may not fit even on tensor_parallel_size={tp} (all GPUs); trying that"
    return EngineChoice(vllm, f"engine=auto → vllm (CUDA, vllm {facts.vllm_version}): {size}; {layout}.")
