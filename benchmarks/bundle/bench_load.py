"""Bundle load time on CPU: write a bundle with N learned adapters at hidden size H, then time
`load_bundle` (full validation: hashes, schema, shapes) over repeated loads; prints the median.

  python -m benchmarks.bundle.bench_load --adapters 1 32 128 --hidden 576 3072 4096
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from serve_bridge.bundle import AdapterEntry, load_bundle, write_bundle
from serve_bridge.command_line import Parser, number


def main() -> None:
    ap = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapters", type=number("positive_int"), nargs="+", default=[1, 32, 128])
    ap.add_argument("--hidden", type=number("positive_int"), nargs="+", default=[576, 3072, 4096])
    ap.add_argument("--repeat", type=number("positive_int"), default=30)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"{'adapters':>9}{'hidden':>8}{'median ms':>11}{'max ms':>9}")
    for n in args.adapters:
        for h in args.hidden:
            entries = [AdapterEntry(f"a{i}", "0" * 64, "learned", tau=0.1, weight=rng.standard_normal(h).astype(np.float32),
                                    bias=0.0, stats={"val_skip": 0.5}) for i in range(n)]
            with tempfile.TemporaryDirectory() as d:
                out = write_bundle(Path(d) / "bundle", backbone="bench", hidden_size=h, config_fingerprint="x",
                                   adapters=entries)
                times = []
                for _ in range(args.repeat):
                    t = time.perf_counter()
                    load_bundle(out, expected_hidden_size=h, expected_backbone="bench")
                    times.append(1000 * (time.perf_counter() - t))
            print(f"{n:>9}{h:>8}{statistics.median(times):>11.2f}{max(times):>9.2f}")


if __name__ == "__main__":
    main()
