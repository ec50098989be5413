"""The engines a run will use exist on this machine: checked before the first stage.

The hf engine's ``device`` must be a torch device this machine has (``cpu``; ``cuda`` or
``cuda:<i>`` with that GPU visible; ``mps`` where torch has it). The vLLM engine, the run's
(``engine=vllm``) or the agreement stage's, needs a supported vLLM (docs/serving.md), CUDA and
``tensor_parallel_size × data_parallel_size`` visible GPUs. A missing one is a ConfigError
naming the setting, instead of a failure when the stage that loads the engine starts.
"""
from __future__ import annotations

import torch

from calibrate.errors import ConfigError
from labeling.engines.auto import MachineFacts
from labeling.engines.hf import HFOptions
from labeling.engines.vllm.options import SUPPORTED_VLLM, VLLMOptions, supported_vllm_text


def check_device(key: str, device: str, facts: MachineFacts) -> None:
    """ConfigError unless ``device`` (the value of ``key``) names a device of this machine."""
    try:
        d = torch.device(device)
    except (RuntimeError, ValueError):
        raise ConfigError(f"{key}={device!r}: not a device; use cpu, cuda or cuda:<index>.") from None
    if d.type == "cuda":
        if not facts.cuda:
            raise ConfigError(f"{key}={device!r}: this machine has no CUDA GPU (torch sees none); use "
                              f"{key}=cpu, or engine=auto to run on what the machine has.")
        if d.index is not None and d.index >= facts.gpus:
            raise ConfigError(f"{key}={device!r}: this machine has {facts.gpus} visible GPU(s), "
                              f"cuda:0…cuda:{facts.gpus - 1}.")
    elif d.type == "mps":
        if not torch.backends.mps.is_available():
            raise ConfigError(f"{key}={device!r}: torch has no MPS device here; use {key}=cpu.")
    elif d.type != "cpu":
        raise ConfigError(f"{key}={device!r}: the hf engine runs on cpu, cuda[:<index>] or mps.")


def check_vllm(key: str, options: VLLMOptions, facts: MachineFacts) -> None:
    """ConfigError unless this machine can start the vLLM engine ``key`` asks for with ``options``."""
    if facts.vllm_version not in SUPPORTED_VLLM or not facts.cuda:
        found = (f"vllm {facts.vllm_version}" if facts.vllm_version else "no vllm") + \
                (f" and {facts.gpus} GPU(s)" if facts.cuda else " and no CUDA GPU")
        raise ConfigError(f"{key} needs vLLM ({' or '.join(SUPPORTED_VLLM)}) and a GPU, this machine has {found}: "
                          f"{supported_vllm_text()} on a GPU machine, or run without {key}.")
    gpus = options.tensor_parallel_size * options.data_parallel_size
    if gpus > facts.gpus:
        raise ConfigError(f"{key}: tensor_parallel_size {options.tensor_parallel_size} × data_parallel_size "
                          f"{options.data_parallel_size} needs {gpus} GPUs, this machine has {facts.gpus}.")


def check_engine(key: str, options: HFOptions | VLLMOptions, facts: MachineFacts) -> None:
    """The engine of ``options`` can run on this machine; ``key`` names the setting that asks
    for vLLM (``engine=vllm``, ``agreement=true``); the hf engine's device is ``engine.device``."""
    if isinstance(options, VLLMOptions):
        check_vllm(key, options, facts)
    else:
        check_device("engine.device", options.device, facts)
