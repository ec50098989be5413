"""Calibration plots (PNG, matplotlib's Agg canvas; no pyplot global state).

- :func:`plot_frontier`: loss vs skip of one adapter, both policies on one plot — learned
  candidates, their Pareto curve and loss bounds, profiled k, the chosen points starred.
- :func:`plot_k_curves`: accuracy and skip vs profiled k.
- :func:`plot_positive_rate`: share of risky labels (y = 1) per release point t, per adapter.
- :func:`plot_release_histogram`: release points of one policy over requests.
- :func:`plot_agreement`: predicted vs realized skip and accuracy, one point per adapter and
  split, with the diagonal and a ±band.
"""
from __future__ import annotations

import textwrap
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


def _clusters(x: np.ndarray, y: np.ndarray, xspan: float, yspan: float) -> list[list[int]]:
    """Consecutive points (in the given order) closer than ~4% of each axis span, grouped."""
    groups: list[list[int]] = []
    for i in range(len(x)):
        if groups and abs(x[i] - x[groups[-1][0]]) < 0.04 * xspan and abs(y[i] - y[groups[-1][0]]) < 0.06 * yspan:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def plot_frontier(priced: pd.DataFrame, frontier: pd.DataFrame, selection: pd.DataFrame, adapter: str,
                  path: str | Path, rule: str | None = None, budget: float | None = None, note: str = "") -> Path:
    """Loss (points) vs skip (%) for ``adapter``, both policies on one plot.

    Learned: all τ candidates (faint), the Pareto frontier (line) and its loss upper bound (band,
    when ``priced`` has ``loss_high``). Profiled: every k (line + squares, with error bars up
    to the bound); nearby k share one label, so labels never pile up. The points
    chosen by ``rule`` (all rules of ``selection`` when None) are starred, each named in the
    legend rather than on the plot. ``budget`` draws the loss budget; ``note`` goes below.
    """
    fig = Figure(figsize=(7, 4.8 if note else 4.4), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    learned = _rows(priced, adapter, "learned")
    ax.scatter(100 * learned["skip"], learned["loss_points"], s=8, color="tab:blue", alpha=0.25,
               label="learned τ candidates")
    front = _rows(frontier, adapter, "learned").sort_values("skip")
    if "loss_high" in front.columns and len(front):
        ax.fill_between(100 * front["skip"], front["loss_points"], front["loss_high"], color="tab:blue",
                        alpha=0.12, lw=0, label="learned frontier: loss upper bound")
    ax.plot(100 * front["skip"], front["loss_points"], "-o", ms=3, color="tab:blue", label="learned frontier")
    prof = _rows(priced, adapter, "profiled").sort_values("param")
    if "loss_high" in prof.columns:
        err = np.vstack([np.zeros(len(prof)), np.clip(prof["loss_high"] - prof["loss_points"], 0, None)])
        ax.errorbar(100 * prof["skip"], prof["loss_points"], yerr=err, fmt="none", ecolor="tab:orange",
                    alpha=0.5, lw=0.8, capsize=2)
    ax.plot(100 * prof["skip"], prof["loss_points"], "-s", ms=4, lw=0.8, color="tab:orange", label="profiled k")
    xs, ys = 100 * prof["skip"].to_numpy(), prof["loss_points"].to_numpy()
    yspan = max(1.0, float(np.nanmax(priced.loc[priced["adapter"] == adapter, "loss_points"], initial=1.0))
                - float(np.nanmin(priced.loc[priced["adapter"] == adapter, "loss_points"], initial=0.0)))
    for group in _clusters(xs, ys, 100.0, yspan):
        ks = ",".join(str(int(prof["param"].iloc[i])) for i in group)
        ax.annotate(f"k={ks}", (xs[group[0]], ys[group[0]]), textcoords="offset points", xytext=(5, -11),
                    fontsize=7, color="tab:orange")
    chosen = selection[(selection["adapter"] == adapter) & ~selection["fallback"]]
    if rule is not None:
        chosen = chosen[chosen["rule"] == rule]
    styles = {"learned": ("*", "tab:blue"), "profiled": ("D", "tab:orange")}
    for (policy, skip, loss), g in chosen.groupby(["policy", "skip", "loss_points"], sort=False):
        marker, color = styles[policy]
        param = g["param"].iloc[0]
        what = f"τ={param:.3g}" if policy == "learned" else f"k={int(param)}"
        ax.scatter([100 * skip], [loss], marker=marker, s=160, color=color, edgecolor="black", zorder=5,
                   label=f"chosen {policy} {what} ({'/'.join(g['rule'])}): {100 * skip:.0f}% skip, "
                         f"{loss:.1f} pts")
    if budget is not None:
        ax.axhline(budget, color="tab:red", ls="--", lw=0.8, label=f"budget {budget:g} points (on the bound)")
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_yscale("symlog", linthresh=10, linscale=2)  # linear up to 10 points, where budgets live
    top = float(np.nanmax(priced.loc[priced["adapter"] == adapter, ["loss_points"]].to_numpy(), initial=1.0))
    ticks = [t for t in (0, 2, 5, 10, 20, 50, 100) if t <= max(top, budget or 0) * 1.5 or t <= 10]
    ax.set_yticks(ticks, [str(t) for t in ticks])
    ax.set_ylim(-1, max(ticks) * 1.1)
    ax.set_xlim(-2, 102)
    ax.set(xlabel="skip (% of decode forwards without adapter)", ylabel="accuracy loss (points, symlog)",
           title=f"{adapter}: release frontier (validation)")
    ax.legend(fontsize=7, loc="best")
    if note:
        fig.text(0.01, 0.005, textwrap.fill(note, 130), fontsize=7, va="bottom")
        fig.get_layout_engine().set(rect=(0, 0.07, 1, 0.93))
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
