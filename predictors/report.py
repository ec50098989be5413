"""One line per adapter saying why calibration chose its operating point.

Built from the priced candidates, the chosen rule and the chosen candidate's validation
release points, so the demo's summary, plots and notebook explain the choice in the same
words: what the chosen point skips and loses (with its upper bound), what the best profiled
k does under the same budget, and how far per-request release points spread.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from predictors.frontier import parse_rule, select, with_bounds


def _spread(releases: Sequence[int | None]) -> str:
    fired = np.array([r for r in releases if r is not None])
    if fired.size == 0:
        return "no request released"
    lo, q1, q3, hi = np.percentile(fired, [0, 25, 75, 100])
    return (f"release points r = {lo:.0f}–{hi:.0f} (middle half {q1:.0f}–{q3:.0f}) over "
            f"{fired.size}/{len(releases)} requests")


def explain(priced: pd.DataFrame, adapter: str, rule: str, policy: str,
            releases: Sequence[int | None] = ()) -> str:
    """Why ``adapter`` got its ``rule``/``policy`` operating point, in one line."""
    p = with_bounds(priced[priced["adapter"] == adapter])
    sel = select(p, [rule]).set_index("policy")
    chosen, other = sel.loc[policy], sel.loc["profiled" if policy == "learned" else "learned"]
    parsed = parse_rule(rule)
    n = int(p["n_requests"].iloc[0]) if len(p) else 0
    if chosen["fallback"]:
        releasing = p[(p["policy"] == policy) & (p["skip"] >= 0.05)]
        if parsed.max_loss is None or releasing.empty:
            return f"{adapter}: never released — {chosen['note']}."
        best = releasing.sort_values(["loss_high", "skip"], ascending=[True, False]).iloc[0]
        broken = int(best["broken"]) if "broken" in best else None
        lead = (f"every {policy} candidate that skips ≥ 5% has a loss bound above {parsed.max_loss:g} points "
                f"(the lowest: {best['loss_high']:.1f} at {100 * best['skip']:.0f}% skip")
        if broken == 0:
            return (f"{adapter}: never released — {lead}, with no request broken): {n} validation requests "
                    f"are too few to bound the loss within the budget.")
        tail = f", {broken} of {n} requests broken)" if broken is not None else ")"
        return (f"{adapter}: never released — {lead}{tail}: no {policy} release point is safe enough on these "
                f"requests to fit the budget.")
    head = (f"{adapter}: {policy} skips {100 * chosen['skip']:.1f}% at a loss of {chosen['loss_points']:.1f} "
            f"points (≤ {chosen['loss_high']:.1f} at the bound)")
    if other["fallback"]:
        cmp = f"no {other.name} point qualifies under {rule}"
    else:
        what = f"k={int(other['param'])}" if other.name == "profiled" else f"τ={other['param']:.3g}"
        ratio = f"{chosen['skip'] / other['skip']:.1f}×" if other["skip"] > 0 else "∞"
        cmp = f"the best {other.name} {what} skips {100 * other['skip']:.1f}% ({policy}/{other.name} = {ratio})"
    return f"{head}; {cmp}; {_spread(releases)}."
