"""Where a finished sweep's tokens went: per adapter, the full-LoRA responses, the OFF branches at the
profiled release points, and the OFF branches that only learned candidates asked for.

Reads a run's ``sweep/trees.parquet`` and ``heads/candidates.json`` (no engine): each branch at
release point r counts its response's tokens past the r+1 it shares with the full-LoRA response, as
the tree recorded them (cut where the answer is decided), in full validation generations (tokens
over the adapter's full-LoRA tokens), then per release point.

  python -m benchmarks.sweep.tree_breakdown --run runs/mix-smollm2-demo
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from predictors.candidates import Candidates
from predictors.sweep import RequestTree, load_trees
from serve_bridge.command_line import Parser, existing_dir, need_files


@dataclass
class Breakdown:
    """One adapter's tree tokens: ``on`` (full-LoRA responses) and ``by_r``: r → (tokens, branches)
    of the OFF branches; ``profiled`` sums the branches at a profiled k (``ks``), ``learned_only``
    the rest."""

    adapter: str
    ks: frozenset[int]
    requests: int = 0
    on: int = 0
    by_r: dict[int, tuple[int, int]] = field(default_factory=dict)

    @property
    def profiled(self) -> int:
        return sum(tok for r, (tok, _) in self.by_r.items() if r in self.ks)

    @property
    def learned_only(self) -> int:
        return sum(tok for r, (tok, _) in self.by_r.items() if r not in self.ks)

    def generations(self, tokens: int) -> float:
        return tokens / self.on if self.on else 0.0


def breakdown(trees: Sequence[RequestTree], ks: Sequence[int]) -> list[Breakdown]:
    """Per adapter, in order of first appearance; ``by_r`` in increasing r."""
    out: dict[str, Breakdown] = {}
    for t in trees:
        b = out.setdefault(t.adapter, Breakdown(t.adapter, frozenset(ks)))
        b.requests += 1
        b.on += t.on_length
        for r, (_, length) in t.branches.items():
            tok, n = b.by_r.get(r, (0, 0))
            b.by_r[r] = (tok + length - (r + 1), n + 1)
    for b in out.values():
        b.by_r = dict(sorted(b.by_r.items()))
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
    ap = Parser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", type=existing_dir, required=True, help="a run directory whose sweep stage finished")
    args = ap.parse_args(argv)
    need_files("--run", args.run, ["sweep/trees.parquet", "heads/candidates.json"], "a run whose sweep stage finished")
    trees_path, cands_path = args.run / "sweep" / "trees.parquet", args.run / "heads" / "candidates.json"
    ks = Candidates.load(cands_path).ks
    print(render(breakdown(load_trees(trees_path), ks), ks))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
