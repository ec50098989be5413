"""Calibration plots (PNG, matplotlib's Agg canvas; no pyplot global state).

- :func:`plot_frontier`: loss vs skip of one adapter — learned candidates and their Pareto
  curve, profiled k points, chosen points annotated with their rule names.
- :func:`plot_k_curves`: accuracy and skip vs profiled k.
- :func:`plot_positive_rate`: share of risky labels (y = 1) per release point t, per adapter.
- :func:`plot_release_histogram`: release points of one policy over requests.
- :func:`plot_agreement`: predicted vs realized skip and accuracy, one point per adapter and
  split, with the diagonal and a ±band.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator


def _figure() -> Figure:
    fig = Figure(figsize=(6, 4), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120, format="png")
    return out


def _rows(df: pd.DataFrame, adapter: str, policy: str) -> pd.DataFrame:
    return df[(df["adapter"] == adapter) & (df["policy"] == policy)]


def plot_frontier(priced: pd.DataFrame, frontier: pd.DataFrame, selection: pd.DataFrame, adapter: str,
                  path: str | Path) -> Path:
    """Loss (points) vs skip (%) for ``adapter``: learned candidates + frontier, profiled k, chosen rules."""
    fig = _figure()
    ax = fig.add_subplot()
    learned = _rows(priced, adapter, "learned")
    ax.scatter(100 * learned["skip"], learned["loss_points"], s=10, color="tab:blue", alpha=0.3,
               label="learned τ candidates")
    front = _rows(frontier, adapter, "learned").sort_values("skip")
    ax.plot(100 * front["skip"], front["loss_points"], "-o", ms=3, color="tab:blue", label="learned frontier")
    prof = _rows(priced, adapter, "profiled")
    ax.plot(100 * prof["skip"], prof["loss_points"], "s", color="tab:orange", label="profiled k")
    for r in prof.itertuples():
        ax.annotate(f"k={int(r.param)}", (100 * r.skip, r.loss_points), textcoords="offset points",
                    xytext=(4, -10), fontsize=7, color="tab:orange")
    chosen = selection[(selection["adapter"] == adapter) & ~selection["fallback"]]
    for (policy, skip, loss), g in chosen.groupby(["policy", "skip", "loss_points"]):
        ax.annotate("/".join(g["rule"]), (100 * skip, loss), textcoords="offset points", xytext=(4, 6),
                    fontsize=8, weight="bold", color="tab:blue" if policy == "learned" else "tab:orange")
    ax.axhline(0, color="grey", lw=0.5)
    ax.set(xlabel="skip (% of decode forwards without adapter)", ylabel="accuracy loss (points)",
           title=f"{adapter}: release frontier")
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_k_curves(ktab: pd.DataFrame, adapter: str, path: str | Path) -> Path:
    """Accuracy (%, left) and skip (%, right) vs profiled k for ``adapter`` (a :func:`k_table`)."""
    g = ktab[ktab["adapter"] == adapter].sort_values("k")
    fig = _figure()
    ax = fig.add_subplot()
    ax.plot(g["k"], g["accuracy"], "-o", color="tab:blue", label="accuracy")
    ax.axhline(g["full_accuracy"].iloc[0] if len(g) else np.nan, color="tab:blue", ls=":", label="full LoRA")
    ax.set_xscale("symlog", base=2, linthresh=1)
    ax.set(xlabel="profiled k (adapter applied at forwards t ≤ k)", ylabel="accuracy (%)",
           title=f"{adapter}: profiled k")
    ax2 = ax.twinx()
    ax2.plot(g["k"], 100 * g["skip"], "-s", color="tab:orange", label="skip")
    ax2.set_ylabel("skip (%)")
    fig.legend(loc="outside lower center", ncols=3, fontsize=8)
    return _save(fig, path)


def plot_positive_rate(points: pd.DataFrame, path: str | Path) -> Path:
    """Share of y = 1 (risky release) per t, one line per adapter (points: uid, adapter, t, y)."""
    rate = points.groupby(["adapter", "t"])["y"].mean().reset_index()
    fig = _figure()
    ax = fig.add_subplot()
    for adapter, g in rate.groupby("adapter"):
        ax.plot(g["t"], 100 * g["y"], "-o", ms=3, label=adapter)
    ax.set_xscale("symlog", base=2, linthresh=1)
    ax.set(xlabel="release point t", ylabel="risky labels (%)", title="positive rate per release point")
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_release_histogram(releases: Sequence[int | None], path: str | Path, title: str = "release points") -> Path:
    """Histogram of release points r over requests; requests never released are counted in the title."""
    fired = np.array([r for r in releases if r is not None], dtype=float)
    fig = _figure()
    ax = fig.add_subplot()
    if fired.size:
        ax.hist(fired, bins=np.arange(fired.max() + 2) - 0.5 if fired.max() < 64 else 64, color="tab:blue")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="release point r (last forward with adapter)", ylabel="requests",
           title=f"{title} (never released: {len(releases) - fired.size}/{len(releases)})")
    return _save(fig, path)


def plot_agreement(df: pd.DataFrame, path: str | Path, band: float = 3.0) -> Path:
    """Predicted (x) vs realized (y) skip and accuracy (%), one point per adapter and split
    (columns of the agreement table: adapter, split, predicted/realized_skip_pct,
    predicted/realized_accuracy), with the diagonal and a ±``band``-point band."""
    fig = Figure(figsize=(10, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    markers = {"validation": "o", "test": "s"}
    for ax, (what, label) in zip(fig.subplots(1, 2), (("skip_pct", "skip (%)"), ("accuracy", "accuracy (%)"))):
        x, y = df[f"predicted_{what}"].astype(float), df[f"realized_{what}"].astype(float)
        finite = np.concatenate([x[np.isfinite(x)], y[np.isfinite(y)]])
        lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 100.0)
        lo, hi = max(0.0, lo - band - 2), min(100.0, hi + band + 2)
        line = np.array([lo, hi])
        ax.fill_between(line, line - band, line + band, color="tab:green", alpha=0.15, lw=0,
                        label=f"±{band:g} points")
        ax.plot(line, line, color="grey", lw=0.8)
        for split, g in df.groupby("split", sort=False):
            ax.scatter(g[f"predicted_{what}"], g[f"realized_{what}"], marker=markers.get(split, "^"), s=30,
                       label=split)
            for r in g.itertuples():
                ax.annotate(r.adapter, (getattr(r, f"predicted_{what}"), getattr(r, f"realized_{what}")),
                            textcoords="offset points", xytext=(4, 3), fontsize=7)
        ax.set(xlim=(lo, hi), ylim=(lo, hi), xlabel=f"predicted {label}", ylabel=f"realized {label}",
               title=label.split(" ")[0])
        ax.set_aspect("equal", adjustable="box")
        ax.legend(fontsize=8)
    by = df["realized_by"].iloc[0] if len(df) and "realized_by" in df else "engine"
    fig.suptitle(f"bundle realized on {by} vs predicted")
    return _save(fig, path)
