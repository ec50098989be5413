"""Host time of the StepTrim runner's LoRA-mapping hand-over per engine step. No vLLM, no GPU.

    python -m benchmarks.serve_bridge.bench_mapping_host [--steps 200] [--tokens 2048] [--rows 256]

Each step is one mixed batch of ``--rows`` requests and ``--tokens`` scheduled tokens (decode
rows of one token, then prefill chunks that fill the budget) over 128 adapters, half of the
requests force-released, through the real :meth:`~serve_bridge.runtime.ReleaseRuntime.begin_step`.
Two versions of what ``serve_bridge.vllm.model_runner.LoRazorGPUModelRunner.set_active_loras`` does
around it:

- ``tuples``: the mapping as vLLM 0.26's ``InputBatch.make_lora_inputs`` returns it, tuples of
  numpy scalars (``tuple(ndarray.repeat(...))``, ``v1/worker/gpu_input_batch.py:994-996``), read
  into numpy by ``begin_step`` and turned back into tuples of numpy scalars (the runner before
  2026-11-29);
- ``numpy + ints``: the same ids repeated in numpy, and handed over as tuples of Python ints
  (:func:`serve_bridge.runtime.lora_ids`, the runner now).

Then, for each version, what vLLM does with the tuples next is approximated by two reads of the
token tuple: a Python loop comparing every id with 0 and looking it up in a dict (as its
``convert_mapping`` does per token, ``lora/punica_wrapper/utils.py:108-115``), and one
``torch.tensor`` over it (``async_tensor_h2d``, :121). Reports the median ms per step of each part.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch


from benchmarks.serve_bridge.bench_decision import make_runtime

from serve_bridge.command_line import Parser, number
from serve_bridge.runtime import lora_ids

HIDDEN, ADAPTERS, PROMPT = 576, 128, 200


def batch(rows: int, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-request LoRA ids (1..ADAPTERS) and scheduled token counts: decode rows, then prefill
    chunks of the rest of the budget."""
    per_request = (np.arange(rows) % ADAPTERS + 1).astype(np.int32)
    scheduled = np.ones(rows, np.int64)
    chunks = max(1, rows // 16)
    scheduled[-chunks:] += (tokens - rows) // chunks
    scheduled[-1] += tokens - int(scheduled.sum())
    return per_request, scheduled


def downstream(token_mapping: tuple) -> tuple[float, float]:
    """(ms of a per-id compare-and-lookup loop, ms of torch.tensor) over the handed-over tuple."""
    index = {i: i - 1 for i in range(1, ADAPTERS + 1)}
    start = time.perf_counter()
    [index[v] if v > 0 else -1 for v in token_mapping]
    loop = time.perf_counter() - start
    start = time.perf_counter()
    torch.tensor(list(token_mapping), dtype=torch.long)
    return loop * 1e3, (time.perf_counter() - start) * 1e3


def run(version: str, rows: int, tokens: int, steps: int) -> dict[str, float]:
    rt = make_runtime(ADAPTERS, HIDDEN, "cpu", "eager", rows, policy="profiled")
    names = sorted(rt.slot_of)
    ids = [f"r{i}" for i in range(rows)]
    for i, r in enumerate(ids):
        forced = {"lorazor": {"release_position": PROMPT + 5}} if i % 2 else None
        rt.add(r, names[i % len(names)], f"/bench/{names[i % len(names)]}", PROMPT, forced)
    per_request, scheduled = batch(rows, tokens)
    ones = np.ones(rows, np.int64)
    times: dict[str, list[float]] = {"hand-over": [], "id loop": [], "torch.tensor": []}
    for step in range(steps + 10):
        computed = np.full(rows, PROMPT + step, np.int64)
        start = time.perf_counter()
        if version == "tuples":
            sampled, token = tuple(per_request.repeat(ones)), tuple(per_request.repeat(scheduled))
            m = rt.begin_step(ids, computed, scheduled, computed + scheduled, token, sampled)
            handed = tuple(m.token_mapping)
            tuple(m.sampled_mapping)
        else:
            sampled, token = per_request.repeat(ones), per_request.repeat(scheduled)
            m = rt.begin_step(ids, computed, scheduled, computed + scheduled, token, sampled)
            handed = lora_ids(m.token_mapping)
            lora_ids(m.sampled_mapping)
        hand_over = (time.perf_counter() - start) * 1e3
        loop, tensor = downstream(handed)
        if step >= 10:
            for key, value in zip(times, (hand_over, loop, tensor)):
                times[key].append(value)
    return {key: float(np.median(v)) for key, v in times.items()}


def step_args(description: str) -> argparse.Namespace:
    """--steps, --tokens and --rows, the step shape of the host benchmarks of this directory."""
    ap = Parser(description=description)
    ap.add_argument("--steps", type=number("positive_int"), default=200)
    ap.add_argument("--tokens", type=number("positive_int"), default=2048)
    ap.add_argument("--rows", type=number("positive_int"), default=256)
    return ap.parse_args()


def main() -> None:
    args = step_args(__doc__.split("\n")[0])
    print(f"{args.rows} requests, {args.tokens} tokens per step, median ms per step (torch {torch.__version__})")
    print("| version | hand-over (incl. begin_step) | id loop | torch.tensor | sum |")
    print("|---|---|---|---|---|")
    for version in ("tuples", "numpy + ints"):
        r = run(version, args.rows, args.tokens, args.steps)
        print(f"| {version} | {r['hand-over']:.3f} | {r['id loop']:.3f} | {r['torch.tensor']:.3f} | "
              f"{sum(r.values()):.3f} |")


if __name__ == "__main__":
    main()
