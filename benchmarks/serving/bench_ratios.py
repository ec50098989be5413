"""The ratio lines of an offline table (:mod:`benchmarks.serving.bench`'s ``OUT/TABLE/bench.json``):

    python -m benchmarks.serving.bench_ratios TABLE OUT/TABLE/bench.json

prints, for the modes measured (both's req/s over every other mode's, gridtrim's over stock's),
one line per vLLM install the table compares::

    slot-bound uniform512: both/gridtrim = X.XX, both/stock = Y.YY, both/nolora = Z.ZZ, gridtrim/stock = W.WW
    vLLM 0.34.0 slot-bound uniform512: gridtrim/stock = W.WW           (a table of several vLLM installs)

and, in a table of several vLLM installs, each mode's req/s on every later install over the first's
(``vLLM 0.34.0 over 0.33.0 slot-bound uniform512, each mode in the same rounds: stock = S.SS``): a
ratio of two modes' such figures compares the lines free of the machine's drift between calls, even
where the two modes ran in calls of their own. The vLLM settings that differ from vLLM's defaults
follow the table's name; a table with no finished row, or no pair, says which rows finished.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.serving.bench_table import RATIOS, settings_tag
from serve_bridge.command_line import Parser, fail


def ratio_lines(table: str, rows: Sequence[dict[str, Any]]) -> list[str]:
    """The table's lines: one per vLLM install among ``rows`` (a row's ``vllm``; rows without it are
    the one installed), in the order they first appear; error rows are left out."""
    done = [r for r in rows if "error" not in r]
    if not done:
        return [f"slot-bound {table}: no row finished"]
    by_line: dict[str | None, dict[str, dict[str, Any]]] = {}  # vLLM install → mode → row, in order of appearance
    for r in done:
        by_line.setdefault(r.get("vllm"), {})[r["mode"]] = r
    lines = []
    for vllm, by_mode in by_line.items():
        ratios = [f"{a}/{b} = {by_mode[a]['req_per_s'] / by_mode[b]['req_per_s']:.2f}"
                  for a, b in RATIOS if a in by_mode and b in by_mode]
        tag = settings_tag(next(iter(by_mode.values())))
        lines.append((f"vLLM {vllm} " if vllm else "") + f"slot-bound {table}{' ' + tag if tag else ''}: "
                     + (", ".join(ratios) if ratios else f"rows missing ({sorted(by_mode)} finished)"))
    (first, theirs), *later = by_line.items()
    for vllm, mine in later:  # each mode's speed on a later vLLM over the first's, both measured in the same rounds
        lines.append(f"vLLM {vllm} over {first} slot-bound {table}, each mode in the same rounds: " + ", ".join(
            f"{m} = {mine[m]['req_per_s'] / theirs[m]['req_per_s']:.2f}" for m in mine if m in theirs))
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    ap = Parser(description=__doc__.split("\n")[0])
    ap.add_argument("table", help="the table's name, e.g. uniform512")
    ap.add_argument("path", type=Path, help="its bench.json")
    args = ap.parse_args(argv)
    try:
        rows = json.loads(args.path.read_text())["rows"]
    except OSError:
        fail(f"slot-bound {args.table}: no table ({args.path} was not written; the bench's own message is above)")
    except (ValueError, KeyError, TypeError):
        fail(f"slot-bound {args.table}: {args.path} is not a bench table")
    print("\n".join(ratio_lines(args.table, rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
