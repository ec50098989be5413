"""Where a finished sweep's tokens went: per adapter, the full-LoRA responses, the OFF branches at the
profiled release points, and the OFF branches that only learned candidates asked for.

Reads a run's ``sweep/trees.parquet`` and ``heads/candidates.json`` (no engine): each branch at
release point r counts its response's tokens past the r+1 it shares with the full-LoRA response, as
the tree recorded them (cut where the answer is decided), in full validation generations (tokens
over the adapter's full-LoRA tokens), then per release point.

  python -m benchmarks.sweep.tree_breakdown --run runs/mix-smollm2-demo
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from predictors.candidates import Candidates
from predictors.sweep import RequestTree, load_trees


@dataclass
class Breakdown:
    """One adapter's tree tokens: ``on`` (full-LoRA responses), ``profiled`` (branches at a profiled
    k), ``learned_only`` (branches at any other r); ``by_r``: r → (tokens, branches)."""

    adapter: str
    requests: int = 0
    on: int = 0
    profiled: int = 0
    learned_only: int = 0
    by_r: dict[int, tuple[int, int]] = field(default_factory=dict)

    def generations(self, tokens: int) -> float:
        return tokens / self.on if self.on else 0.0


def breakdown(trees: Sequence[RequestTree], ks: Sequence[int]) -> list[Breakdown]:
    """Per adapter, in order of first appearance."""
    out: dict[str, Breakdown] = {}
    tokens: dict[str, Counter] = {}
    count: dict[str, Counter] = {}
    profiled = set(ks)
    for t in trees:
        b = out.setdefault(t.adapter, Breakdown(t.adapter))
        tok, cnt = tokens.setdefault(t.adapter, Counter()), count.setdefault(t.adapter, Counter())
        b.requests += 1
        b.on += t.on_length
        for r, (_, length) in t.branches.items():
            past = length - (r + 1)
            tok[r] += past
            cnt[r] += 1
            if r in profiled:
                b.profiled += past
            else:
                b.learned_only += past
    for a, b in out.items():
        b.by_r = {r: (tokens[a][r], count[a][r]) for r in sorted(tokens[a])}
    return list(out.values())


def render(rows: Sequence[Breakdown], ks: Sequence[int]) -> str:
    lines = [f"profiled ks: {', '.join(map(str, ks))}", "",
             "| adapter | requests | full-LoRA tokens | OFF at profiled k | OFF at other r | tree, in full generations |",
             "|---|---|---|---|---|---|"]
    for b in rows:
        total = b.on + b.profiled + b.learned_only
        lines.append(f"| {b.adapter} | {b.requests} | {b.on} | {b.profiled} ({b.generations(b.profiled):.2f}) | "
                     f"{b.learned_only} ({b.generations(b.learned_only):.2f}) | {b.generations(total):.2f} |")
    for b in rows:
        lines += ["", f"{b.adapter}, per release point r: tokens (full generations), branches",
                  ", ".join(f"r={r}{'*' if r in ks else ''}: {tok} ({b.generations(tok):.2f}), {n}"
                            for r, (tok, n) in b.by_r.items()) + "   (* profiled)"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", type=Path, required=True, help="a run directory whose sweep stage finished")
    args = ap.parse_args(argv)
    trees_path, cands_path = args.run / "sweep" / "trees.parquet", args.run / "heads" / "candidates.json"
    for p in (trees_path, cands_path):
        if not p.exists():
            print(f"tree_breakdown: {p} does not exist: give a run directory whose sweep stage finished", file=sys.stderr)
            return 2
    ks = Candidates.load(cands_path).ks
    print(render(breakdown(load_trees(trees_path), ks), ks))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
