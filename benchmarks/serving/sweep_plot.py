"""A goodput or chat table's rate sweep as a picture (PNG): per mode, P90 TTFT and P90 TPOT against
the offered rate, the SLO drawn across, each rate's verdict (filled: met, hollow: missed) and the
mode's goodput rate marked; for a chat table also the mean engine step per rate.

    python -m benchmarks.serving.sweep_plot OUT/chat512/chat.json [--out FILE.png] [--replace]

The table is ``goodput.json`` (:mod:`benchmarks.serving.goodput`) or ``chat.json``
(:mod:`benchmarks.serving.chat`); the picture goes beside it (``chat.png``) unless ``--out`` says
otherwise, and an existing picture is kept unless ``--replace``. The probe (all requests at once)
has no offered rate and is left out. Verdicts and goodput rates are the harnesses' own
(:func:`goodput.meets_slo`, :func:`goodput.goodput_rate`) at ``--ttft-slo-ms``/``--tpot-slo-ms``,
the harnesses' defaults unless given. The mean engine step is the chat table's ``step ms``
(:func:`chat.step_ms`); rows measured before it was recorded give ``1000 × decode batch / output
tokens per s``, the same quantity when the server's generated tokens are the run's.
"""
from __future__ import annotations

import io
import json
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.printed import check_out
from benchmarks.serving import chat, goodput
from benchmarks.serving.goodput import Slo
from serve_bridge.command_line import Parser, fail, number
from serve_bridge.safe_write import write_atomic


ROW_KEYS = {"rate", "prompts", "completed", "ttft_p90_ms", "tpot_p90_ms"}  # what a row needs here


@dataclass(frozen=True)
class Point:
    """One swept rate of a mode."""

    rate: float
    ttft_p90_ms: float
    tpot_p90_ms: float
    step_ms: float | None
    met: bool


def step_of(row: dict[str, Any]) -> float | None:
    """A row's mean engine step in ms (module doc); None for a goodput table's rows."""
    metrics = row.get("server_metrics")
    if metrics is None or (step := chat.step_ms(row)) is not None:
        return None if metrics is None else step
    batch, tokens = metrics.get("decode_batch"), row.get("output_throughput")
    return 1e3 * batch / tokens if batch and tokens else None


def sweep(doc: dict[str, Any], slo: Slo) -> dict[str, tuple[list[Point], float | None]]:
    """Each mode's swept rates in rate order, and its goodput rate."""
    out = {}
    for mode, entry in doc["modes"].items():
        rows = sorted((r for r in entry.get("rows", []) if r["rate"] is not None), key=lambda r: r["rate"])
        points = [Point(r["rate"], r["ttft_p90_ms"], r["tpot_p90_ms"], step_of(r), goodput.meets_slo(r, slo))
                  for r in rows]
        out[mode] = points, goodput.goodput_rate(goodput.points_of(entry, slo))[0]
    return out


def draw(series: dict[str, tuple[list[Point], float | None]], slo: Slo, title: str) -> bytes:
    """The PNG of :func:`sweep`'s series (module doc)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = [("P90 TTFT (ms)", lambda p: p.ttft_p90_ms, slo.ttft_ms),
              ("P90 TPOT (ms)", lambda p: p.tpot_p90_ms, slo.tpot_ms)]
    if any(p.step_ms is not None for points, _ in series.values() for p in points):
        panels.append(("mean engine step (ms)", lambda p: p.step_ms, None))
    fig = Figure(figsize=(4.2 * len(panels), 3.8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels))
    for i, (mode, (points, best)) in enumerate(series.items()):
        color = f"C{i}"
        for ax, (what, value, limit) in zip(axes, panels):
            shown = [p for p in points if value(p) is not None]
            ax.plot([p.rate for p in shown], [value(p) for p in shown], "-", color=color, alpha=0.6,
                    label=f"{mode}: goodput {'none' if best is None else f'{best:g}'} req/s")
            for p in shown:
                ax.plot(p.rate, value(p), "o", color=color, markerfacecolor=color if p.met else "none")
            if best is not None:
                ax.axvline(best, color=color, linestyle=":", alpha=0.8)
    for ax, (what, _, limit) in zip(axes, panels):
        if limit is not None:
            ax.axhline(limit, color="black", linestyle="--", linewidth=1, label=f"SLO {limit:g} ms")
        ax.set_xlabel("offered rate (req/s)")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.suptitle(textwrap.shorten(title, 55 * len(panels)), fontsize=8)
    png = io.BytesIO()
    fig.savefig(png, dpi=120, format="png")
    return png.getvalue()


def load(path: Path) -> dict[str, Any]:
    """The table at ``path``; one line and exit code 2 when it is not a goodput or chat table."""
    try:
        doc = json.loads(path.read_text())
        if not isinstance(doc.get("modes"), dict) or not all(isinstance(e.get("rows"), list)
                                                              for e in doc["modes"].values()):
            raise ValueError("no modes with rows")
        for mode, entry in doc["modes"].items():
            for row in entry["rows"]:
                if lacking := sorted(ROW_KEYS - set(row)):
                    raise ValueError(f"a row of mode {mode} lacks {', '.join(lacking)}")
        return doc
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as e:
        fail(f"{path}: not a goodput or chat table (goodput.json, chat.json): {e}")


def main(argv: list[str] | None = None) -> int:
    ap = Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("table", type=Path, help="goodput.json or chat.json")
    ap.add_argument("--out", type=Path, default=None, help="the PNG (default: beside the table, .png)")
    ap.add_argument("--replace", action="store_true", help="replace an existing --out file")
    ap.add_argument("--ttft-slo-ms", type=number("positive_number"), default=Slo.ttft_ms)
    ap.add_argument("--tpot-slo-ms", type=number("positive_number"), default=Slo.tpot_ms)
    args = ap.parse_args(argv)
    doc = load(args.table)
    args.out = args.out or args.table.with_suffix(".png")
    check_out(args)
    slo = Slo(args.ttft_slo_ms, args.tpot_slo_ms)
    title = f"{args.table.parent.name}: " + (doc.get("preamble") or [args.table.name])[0]
    write_atomic(args.out, draw(sweep(doc, slo), slo, title))
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
