"""vLLM 0.33.0's AsyncScheduler.schedule() host time per step with 100 running requests on 32 LoRA
slots, against the number of waiting requests whose adapters max_loras keeps out (each step walks
them all), and the same with LoRazor's ReleaseAsyncScheduler serving a profiled bundle (k = 27 for
each of 512 adapters, slot hand-back on). The scheduler's own host work only: no model runs.

    PYTHONPATH=. VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 /path/to/python-with-vllm \
        benchmarks/results/2026-12-05-host-costs/scheduler_host.py WORK
"""
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from vllm.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from benchmarks.serving.synthetic import LLAMA32_3B, write_model_config, write_word_tokenizer
from serve_bridge.bundle import AdapterEntry, adapter_fingerprint, write_bundle

SLOTS, RUNNING, BLOCKS = 32, 100, 200_000
work = Path(sys.argv[1])
model = write_model_config(work, LLAMA32_3B)
write_word_tokenizer(model, LLAMA32_3B)
adapter = work / "adapter"  # every request's adapter path: one weights file, whose hash the bundle records
adapter.mkdir(parents=True, exist_ok=True)
(adapter / "adapter_model.safetensors").write_bytes(b"weights")
bundle = work / "k27"
if not bundle.exists():
    write_bundle(bundle, backbone="llama-3.2-3b-shape", hidden_size=LLAMA32_3B["hidden_size"], config_fingerprint="c",
                 adapters=[AdapterEntry(f"a{i}", adapter_fingerprint(adapter), "profiled", k=27) for i in range(512)])


def step_ms(scheduler_cls: type, waiting: int, steps: int = 30) -> float:
    mc = ModelConfig(model=str(model), tokenizer=str(model), max_model_len=4096, dtype="bfloat16")
    vc = VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=16, enable_prefix_caching=True),
                    scheduler_config=SchedulerConfig(max_num_seqs=1024, max_num_batched_tokens=8192,
                                                     max_model_len=4096, is_encoder_decoder=False),
                    lora_config=LoRAConfig(max_loras=SLOTS, max_lora_rank=8))
    vc.cache_config.num_gpu_blocks = BLOCKS
    kv = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        ["l0"], FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16))])
    s = scheduler_cls(vc, kv, StructuredOutputManager(vc), block_size=16)
    params = SamplingParams(max_tokens=1000, ignore_eos=True)

    def lora(i: int) -> LoRARequest:
        return LoRARequest(f"a{i}", i + 1, str(adapter))

    for i in range(RUNNING):
        s.add_request(Request(f"r{i}", list(range(i, i + 100)), params, None, lora_request=lora(i % SLOTS)))
    s.schedule()  # the running set's prefill
    for i in range(waiting):
        s.add_request(Request(f"w{i}", list(range(i, i + 300)), params, None, lora_request=lora(SLOTS + i % 480)))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        s.schedule()
        times.append(time.perf_counter() - t0)
    tracked = len(s.lorazor_slots.states) if getattr(s, "lorazor_slots", None) else 0
    assert tracked == (RUNNING + waiting if scheduler_cls is not AsyncScheduler else 0), tracked
    return statistics.median(times[3:]) * 1e3


for label, env in (("vLLM's AsyncScheduler", None), ("LoRazor's ReleaseAsyncScheduler", str(bundle))):
    if env:
        os.environ["LORAZOR_BUNDLE"] = env
        from serve_bridge.vllm.scheduler import ReleaseAsyncScheduler as cls
    else:
        cls = AsyncScheduler
    print(label + ": " + ", ".join(f"{n} waiting {step_ms(cls, n):.2f} ms" for n in (0, 100, 300, 500, 2000)))
