"""Host time per engine step of the punica wrapper's ``update_metadata``: vLLM 0.26.0's, restated,
against GridTrim's host-built version (serve_bridge.punica_meta). CPU only, no vLLM.

    python -m benchmarks.serve_bridge.bench_punica_meta_host [--steps 200] [--tokens 2048] [--rows 256]

Each step maps ``--tokens`` tokens and ``--rows`` sampled rows over 128 adapters (a tenth of the
rows without one). ``vllm (restated)`` is tests/serve_bridge/test_punica_meta.py's
``convert_mapping`` plus test_gridtrim.py's ``VllmKernelMeta.prepare`` for the token and the sampler
mappings, what ``PunicaWrapperGPU.update_metadata`` runs (``lora/punica_wrapper/punica_gpu.py:75-88``),
plus the work-list refresh GridTrim ran after it (``serve_bridge.gridtrim.refresh_worklist``). On
the CPU its device ops are CPU ops, and the GPU version's host syncs (the no-LoRA flag,
``torch.unique``) and launch costs are not in it, so the GPU host pays more than this for vLLM's
version. ``host`` is :class:`serve_bridge.punica_meta.HostPunicaMetadata.update`. Median ms per step.
"""
from __future__ import annotations

import statistics
import time
from types import SimpleNamespace

import numpy as np
import torch


from benchmarks.serve_bridge.bench_mapping_host import step_args

from lora_kernels.metadata import LoRABatchMeta
from lora_kernels.worklist import RowTileWorklist
from serve_bridge.punica_meta import HostPunicaMetadata
from tests.serve_bridge.test_gridtrim import VllmKernelMeta
from tests.serve_bridge.test_punica_meta import convert_mapping

ADAPTERS = 128


def main() -> None:
    args = step_args(__doc__.split("\n")[0])
    gen = np.random.default_rng(0)
    lora_index_to_id = list(range(1, ADAPTERS + 1))
    t = args.tokens

    def buf(*shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=torch.long)
    wrapper = SimpleNamespace(_token_lora_indices=buf(t), _sampler_indices=buf(t), _sampler_indices_padded=buf(t),
                              _embeddings_indices=buf(2, t), indices_len=[None] * 4,
                              token_mapping_meta=VllmKernelMeta(ADAPTERS, t),
                              prompt_mapping_meta=VllmKernelMeta(ADAPTERS, t))
    host = HostPunicaMetadata(wrapper)
    ref_token, ref_prompt = VllmKernelMeta(ADAPTERS, t), VllmKernelMeta(ADAPTERS, t)
    lists = [RowTileWorklist.allocate(t, ADAPTERS + 1, "cpu") for _ in range(2)]
    times: dict[str, list[float]] = {"vllm (restated)": [], "host": []}
    for step in range(args.steps + 10):
        per_row = np.where(gen.random(args.rows) < 0.1, 0, gen.integers(1, ADAPTERS + 1, args.rows))
        counts = np.ones(args.rows, np.int64)
        counts[-1] += t - args.rows
        index_mapping = tuple(np.repeat(per_row, counts).tolist())
        prompt_mapping = tuple(per_row.tolist())
        start = time.perf_counter()
        lora, sampler, padded, emb = convert_mapping(index_mapping, prompt_mapping, lora_index_to_id, ADAPTERS + 1,
                                                     128256)
        ref_token.prepare(lora.to(torch.int32))
        ref_prompt.prepare(sampler.to(torch.int32))
        for wl, meta in zip(lists, (ref_token, ref_prompt)):
            wl.update(LoRABatchMeta.from_vllm_meta_args(meta.meta_args(t)))
        mid = time.perf_counter()
        host.update(index_mapping, prompt_mapping, lora_index_to_id, ADAPTERS + 1, 128256)
        end = time.perf_counter()
        if step >= 10:
            times["vllm (restated)"].append((mid - start) * 1e3)
            times["host"].append((end - mid) * 1e3)
    print(f"{args.tokens} tokens, {args.rows} sampled rows, {ADAPTERS} adapters, {args.steps} steps "
          f"(torch {torch.__version__}, {torch.get_num_threads()} threads)")
    for name, xs in times.items():
        print(f"{name:>16}: {statistics.median(xs):.3f} ms per step (median)")


if __name__ == "__main__":
    main()
