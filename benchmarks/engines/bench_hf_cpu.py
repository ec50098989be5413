"""The hf engine on CPU: generated tokens per second by multiplication dtype, torch threads and batch size.

    python -m benchmarks.engines.bench_hf_cpu [--requests 48] [--max-new-tokens 48]
        [--matmul float32 bfloat16] [--threads 1 2] [--batch-sizes 16 48]

One full-LoRA generation (``HFEngine.generate``, no forks) of the embedded demo's first arith
validation requests with arith-a on the embedded backbone (float32), once per (matmul, threads,
batch size), in that order, each matmul dtype on a freshly loaded model
(:mod:`labeling.engines.cpu_matmul`) after one warm-up batch. Prints generated tokens, seconds,
tokens/s, the speed against the first configuration, and how many requests' tokens equal the first
configuration of the same matmul dtype (batch size and thread count may change float32 reduction
order). Wall times depend on what else the machine runs: compare rows of one run.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from serve_bridge.command_line import Parser, number


def main(argv: Sequence[str] | None = None) -> int:
    ap = Parser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=number("positive_int"), default=48)
    ap.add_argument("--max-new-tokens", type=number("positive_int"), default=48)
    ap.add_argument("--matmul", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"])
    ap.add_argument("--threads", type=number("positive_int"), nargs="+", default=[1, 2])
    ap.add_argument("--batch-sizes", type=number("positive_int"), nargs="+", default=[16, 48])
    args = ap.parse_args(argv)

    import torch

    import labeling
    from labeling.adapters import AdapterSpec
    from labeling.backbone import SMOLLM2, load_backbone, stop_token_ids
    from labeling.engines.hf import GenRequest, HFEngine
    from labeling.tasks import build_task

    task = build_task("arith", sizes={"validation": args.requests})
    adapter = AdapterSpec("arith-a", str(Path(labeling.__file__).parent / "data" / "adapters" / "arith-a"))
    print(f"{args.requests} arith validation requests, arith-a, up to {args.max_new_tokens} new tokens, "
          f"float32 model; tokens/s over the first configuration's")
    print("| matmul | threads | batch | tokens | seconds | tokens/s | vs first | tokens as this matmul's first |")
    print("|---|---|---|---|---|---|---|---|")
    first_rate: float | None = None
    for matmul in args.matmul:
        model, tok = load_backbone(SMOLLM2)
        engine = HFEngine(model, tok, [adapter], stop_token_ids(model.generation_config, tok, SMOLLM2), progress=False,
                          matmul=matmul)
        requests = [GenRequest(e.uid, engine.encode(task.messages(e)), 0) for e in task.load_split("validation")]
        engine.generate(requests[:4], 4)  # warm-up
        first: list[list[int]] | None = None
        for threads in args.threads:
            torch.set_num_threads(threads)
            for batch in args.batch_sizes:
                engine.batch_size = batch
                start = time.perf_counter()
                out = engine.generate(requests, args.max_new_tokens)
                seconds = time.perf_counter() - start
                tokens = [list(r.tokens) for r in out]
                rate = sum(map(len, tokens)) / seconds
                first_rate, first = first_rate or rate, first or tokens
                same = sum(a == b for a, b in zip(tokens, first))
                print(f"| {matmul} | {threads} | {batch} | {sum(map(len, tokens))} | {seconds:.1f} | {rate:.1f} | "
                      f"{rate / first_rate:.2f} | {same}/{len(tokens)} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
