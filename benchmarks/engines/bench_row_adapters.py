"""Per-row adapters on CPU: peft's ``adapter_names`` against :class:`labeling.engines.row_adapters.RowAdapters`.

    python -m benchmarks.engines.bench_row_adapters [--rows 1 16] [--steps 20] [--repeats 5]

One decode step at a time (one new token per row over a 60-token KV cache) of the embedded
backbone (float32, one torch thread) with arith-a, every row on the adapter, through
``model(..., adapter_names=...)`` and through ``RowAdapters``, alternating ``--repeats`` times per
batch size, each after one warm-up step. Prints the median ms per step of each, the median of the
paired differences, and whether the logits are bit-identical. Wall times depend on what else the machine runs: compare rows of one run.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from serve_bridge.command_line import Parser, number


def main(argv: Sequence[str] | None = None) -> int:
    ap = Parser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=number("positive_int"), nargs="+", default=[1, 16])
    ap.add_argument("--steps", type=number("positive_int"), default=20)
    ap.add_argument("--repeats", type=number("positive_int"), default=5)
    args = ap.parse_args(argv)

    import statistics

    import torch
    from peft import PeftModel
    from transformers import DynamicCache

    import labeling
    from labeling.backbone import SMOLLM2, load_backbone
    from labeling.engines.row_adapters import RowAdapters

    torch.set_num_threads(1)
    model, _ = load_backbone(SMOLLM2)
    path = Path(labeling.__file__).parent / "data" / "adapters" / "arith-a"
    peft_model = PeftModel.from_pretrained(model, str(path), adapter_name="arith-a").eval()
    rows_call = RowAdapters(peft_model)
    g = torch.Generator().manual_seed(0)
    print("| rows | adapter_names ms/step | RowAdapters ms/step | saved ms/step (median pair) | logits identical |")
    print("|---|---|---|---|---|")
    for rows in args.rows:
        ids = torch.randint(0, 1000, (rows, 60), generator=g)
        names = ["arith-a"] * rows

        def steps(call) -> tuple[float, torch.Tensor]:
            cache = DynamicCache()
            with torch.no_grad():
                call(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
                call(input_ids=ids[:, :1], past_key_values=cache, use_cache=True, logits_to_keep=1)  # warm-up
                start, out = time.perf_counter(), []
                for _ in range(args.steps):
                    out.append(call(input_ids=ids[:, :1], past_key_values=cache, use_cache=True, logits_to_keep=1).logits)
            return 1e3 * (time.perf_counter() - start) / args.steps, torch.cat(out)

        peft_ms, ours_ms, identical = [], [], True
        for _ in range(args.repeats):
            ms, peft_logits = steps(lambda **kw: peft_model(**kw, adapter_names=names))
            peft_ms.append(ms)
            ms, ours_logits = steps(lambda **kw: rows_call(names, **kw))
            ours_ms.append(ms)
            identical &= torch.equal(peft_logits, ours_logits)
        saved = statistics.median(a - b for a, b in zip(peft_ms, ours_ms))
        print(f"| {rows} | {statistics.median(peft_ms):.1f} | {statistics.median(ours_ms):.1f} | {saved:.1f} | "
              f"{identical} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
