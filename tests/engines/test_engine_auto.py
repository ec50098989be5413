"""engine=auto: the resolution for every kind of machine (facts injected, not probed), the
explicit override, and the run directory's engine identity."""
from __future__ import annotations

from pathlib import Path

import pytest

from calibrate.context import Context
from calibrate.pipeline import stage_fingerprints
from calibrate.rundir import RunDir
from labeling.engines.auto import GIB, AutoOptions, MachineFacts, probe_facts, resolve_engine
from labeling.engines.hf import HFOptions
from labeling.engines.vllm.options import VLLMOptions
from tests.calibrate.test_pipeline import TINY, compose_cfg

H200 = 140 * GIB
CPU = MachineFacts(cuda=False, gpus=0, gpu_memory=0, vllm_version=None)


def gpus(n: int, vllm: str | None = "0.26.0", memory: int = H200) -> MachineFacts:
    return MachineFacts(cuda=True, gpus=n, gpu_memory=memory, vllm_version=vllm)


def choose(facts: MachineFacts, parameters: int = 3_200_000_000):
    asked = []

    def count() -> int:
        asked.append(True)
        return parameters

    choice = resolve_engine(facts, count, "llama3b", AutoOptions(progress=False))
    assert "\n" not in choice.reason and choice.reason.startswith("engine=auto → ")
    return choice, bool(asked)


@pytest.mark.parametrize("vllm", [None, "0.26.0"])
def test_no_cuda_is_hf_on_cpu(vllm) -> None:
    choice, sized = choose(MachineFacts(cuda=False, gpus=0, gpu_memory=0, vllm_version=vllm))
    assert choice.options == HFOptions(device="cpu", progress=False) and not sized
    assert "hf on cpu" in choice.reason and "no CUDA" in choice.reason


@pytest.mark.parametrize("vllm,found", [(None, "not installed"), ("0.27.1", "vllm 0.27.1 is installed")])
@pytest.mark.parametrize("n", [1, 4])
def test_cuda_without_the_supported_vllm_is_hf_on_cuda(vllm, found, n) -> None:
    choice, sized = choose(gpus(n, vllm))
    assert choice.options == HFOptions(device="cuda", progress=False) and not sized
    assert "hf on cuda" in choice.reason and found in choice.reason and "vllm==0.26.0" in choice.reason


@pytest.mark.parametrize("n", [1, 2, 8])
def test_cuda_and_vllm_is_one_replica_per_gpu(n) -> None:
    choice, sized = choose(gpus(n))
    assert isinstance(choice.options, VLLMOptions) and sized
    assert (choice.options.tensor_parallel_size, choice.options.data_parallel_size) == (1, n)
    assert choice.options.progress is False and choice.options == VLLMOptions(data_parallel_size=n, progress=False)
    assert f"{n} data-parallel replica(s)" in choice.reason and "6.0 GiB in bfloat16" in choice.reason


@pytest.mark.parametrize("parameters,n,tp", [
    (70_000_000_000, 8, 4),   # 130 GiB of bf16: a quarter fits half of 0.85 × 140 GiB
    (70_000_000_000, 2, 2),   # only two GPUs: all of them (and it says it may not fit)
    (30_000_000_000, 8, 1),   # 56 GiB fits one H200
    (30_000_000_000, 4, 2),   # ... but not one 80 GiB GPU
])
def test_tensor_parallel_only_when_the_model_needs_it(parameters, n, tp) -> None:
    memory = 80 * GIB if (parameters, n) == (30_000_000_000, 4) else H200
    choice, _ = choose(gpus(n, memory=memory), parameters)
    assert (choice.options.tensor_parallel_size, choice.options.data_parallel_size) == (tp, n // tp)
    if tp > 1:
        assert f"tensor_parallel_size={tp}" in choice.reason
    assert ("may not fit" in choice.reason) == (n == 2)


def test_probe_on_this_machine() -> None:
    facts = probe_facts()
    assert facts.cuda == (facts.gpus > 0) and (facts.gpu_memory > 0) == facts.cuda


def _ctx(tmp_path: Path, facts: MachineFacts, *overrides: str) -> Context:
    return Context(compose_cfg([*TINY, "labeling.shard_requests=auto", *overrides]), RunDir(tmp_path), facts=facts)


def test_default_is_auto_and_on_cpu_it_is_the_hf_engine(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path, CPU)
    assert ctx.cfg.engine.name == "auto"
    assert ctx.engine_options == HFOptions(device="cpu", progress=False)
    assert stage_fingerprints(ctx) == stage_fingerprints(_ctx(tmp_path, CPU, "engine=hf", "engine.progress=false"))
    assert ctx.shard_requests == 64


def test_the_fingerprint_is_the_resolved_engine_and_explicit_engines_win(tmp_path: Path) -> None:
    auto_gpu = _ctx(tmp_path, gpus(4))
    assert isinstance(auto_gpu.engine_options, VLLMOptions) and auto_gpu.engine_options.data_parallel_size == 4
    assert auto_gpu.shard_requests == 4 * 1024
    vllm = stage_fingerprints(_ctx(tmp_path, CPU, "engine=vllm"))
    assert stage_fingerprints(auto_gpu) == vllm  # parallelism is a throughput knob
    assert stage_fingerprints(_ctx(tmp_path, gpus(1, vllm=None))) == stage_fingerprints(
        _ctx(tmp_path, CPU, "engine=hf", "engine.device=cuda"))
    # an explicit engine is never replaced, whatever the machine offers
    explicit = _ctx(tmp_path, gpus(8), "engine=hf")
    assert explicit.engine_options == HFOptions(progress=False) and explicit.engine_choice is None
    assert stage_fingerprints(explicit)["labels"] != vllm["labels"]
    assert _ctx(tmp_path, CPU, "engine=vllm").engine_options.data_parallel_size == 1
