"""Host time of vLLM's scheduler per step past a ``max_loras`` knee, with and without LoRazor's.

    VLLM_TARGET_DEVICE=cpu python -m benchmarks.serving.bench_scheduler_host --work DIR [--waiting 0 100 300 500 2000]

Once every slot is held, vLLM's ``schedule()`` walks each waiting request whose adapter has no
slot and skips it, on every step (``v1/core/sched/scheduler.py:1091-1101`` in 0.33.0). This builds
vLLM's ``AsyncScheduler`` (the default) for the Llama-3.2-3B shape with ``--running`` requests
decoding on ``--slots`` adapters and N waiting requests on 480 others, then times ``--steps``
calls of ``schedule()`` (median, the first three dropped); then the same with LoRazor's
``ReleaseAsyncScheduler`` serving a profiled bundle (k = 27 for each adapter, every request
tracked, slot hand-back on). The scheduler alone: no model runs, no GPU (``VLLM_TARGET_DEVICE=cpu``
lets vLLM build its configuration without one), vLLM installed.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.printed import Printed, add_out_options, check_out
from benchmarks.serving.synthetic import LLAMA32_3B, write_model_config, write_word_tokenizer
from serve_bridge.bundle import AdapterEntry, adapter_fingerprint, write_bundle
from serve_bridge.command_line import Parser, fail, number

BLOCKS = 200_000
COLD_ADAPTERS = 480  # adapters of the waiting requests, none of them in a slot


def scheduler_ms(cls: type, model: Path, adapter: Path, args: Any, waiting: int) -> float:
    """Median ``schedule()`` ms of ``cls`` with ``waiting`` requests kept out by ``max_loras``."""
    import torch
    from vllm.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    mc = ModelConfig(model=str(model), tokenizer=str(model), max_model_len=4096, dtype="bfloat16")
    vc = VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=16, enable_prefix_caching=True),
                    scheduler_config=SchedulerConfig(max_num_seqs=1024, max_num_batched_tokens=8192,
                                                     max_model_len=4096, is_encoder_decoder=False),
                    lora_config=LoRAConfig(max_loras=args.slots, max_lora_rank=8))
    vc.cache_config.num_gpu_blocks = BLOCKS
    kv = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        ["l0"], FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16))])
    s = cls(vc, kv, StructuredOutputManager(vc), block_size=16)
    params = SamplingParams(max_tokens=1000, ignore_eos=True)

    def lora(i: int) -> Any:
        return LoRARequest(f"a{i}", i + 1, str(adapter))

    for i in range(args.running):
        s.add_request(Request(f"r{i}", list(range(i, i + 100)), params, None, lora_request=lora(i % args.slots)))
    s.schedule()  # the running requests' prefill
    for i in range(waiting):
        s.add_request(Request(f"w{i}", list(range(i, i + 300)), params, None,
                              lora_request=lora(args.slots + i % COLD_ADAPTERS)))
    tracker = getattr(s, "lorazor_slots", None)
    if tracker is not None and len(tracker.states) != args.running + waiting:
        raise SystemExit(f"LoRazor tracks {len(tracker.states)} requests, not {args.running + waiting}")
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        s.schedule()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:]) * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, required=True, help="the model directory, an adapter and the bundle go here")
    ap.add_argument("--waiting", type=number("non_negative_int"), nargs="+", default=[0, 100, 300, 500, 2000])
    ap.add_argument("--running", type=number("positive_int"), default=100)
    ap.add_argument("--slots", type=number("positive_int"), default=32)
    ap.add_argument("--steps", type=number("positive_int"), default=30)
    add_out_options(ap, "the table")
    args = ap.parse_args(argv)
    check_out(args)
    if args.steps < 4:
        fail(f"--steps: {args.steps}: use at least 4 (the first three are dropped)")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    except ImportError as e:
        fail(f"vLLM is not importable here ({e}): pip install -e \".[vllm]\"")
    model = write_model_config(args.work, LLAMA32_3B)
    write_word_tokenizer(model, LLAMA32_3B)
    adapter = args.work / "adapter"  # every request's adapter path: one weights file, recorded in the bundle
    adapter.mkdir(parents=True, exist_ok=True)
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    bundle = args.work / "k27"
    if not bundle.exists():
        write_bundle(bundle, backbone="llama-3.2-3b-shape", hidden_size=LLAMA32_3B["hidden_size"],
                     config_fingerprint="c", adapters=[AdapterEntry(f"a{i}", adapter_fingerprint(adapter), "profiled",
                                                                    k=27) for i in range(args.slots + COLD_ADAPTERS)])
    emit = Printed()
    emit(f"schedule() host ms per step, median of {args.steps - 3}: {args.running} running requests on "
         f"{args.slots} slots; `{' '.join(sys.argv)}`")
    emit()
    emit("| scheduler | " + " | ".join(f"{n} waiting" for n in args.waiting) + " |")
    emit("|---|" + "---|" * len(args.waiting))
    emit("| vLLM's AsyncScheduler | " + " | ".join(
        f"{scheduler_ms(AsyncScheduler, model, adapter, args, n):.2f}" for n in args.waiting) + " |")
    os.environ["LORAZOR_BUNDLE"] = str(bundle)
    from serve_bridge.vllm.scheduler import ReleaseAsyncScheduler
    emit("| LoRazor's ReleaseAsyncScheduler | " + " | ".join(
        f"{scheduler_ms(ReleaseAsyncScheduler, model, adapter, args, n):.2f}" for n in args.waiting) + " |")
    emit.write(args.out)


if __name__ == "__main__":
    main()
