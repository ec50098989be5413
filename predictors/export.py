"""Bundle entries from calibration results (DESIGN §3.6): heads + selection → AdapterEntry.

The export stage picks, per adapter, the candidate that one selection rule chose for one
policy kind, and records the calibration numbers beside it. A rule that fell back to
never-release, or a learned choice for an adapter without an ok head, exports ``none``.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pandas as pd

from predictors.frontier import POLICIES, frontier_summary
from predictors.heads import Head
from serve_bridge.bundle import AdapterEntry, adapter_fingerprint


def bundle_entries(heads: Mapping[str, Head], selection: pd.DataFrame, frontier: pd.DataFrame, rule: str,
                   policy: str, adapter_weights: Mapping[str, str | Path]) -> list[AdapterEntry]:
    """One :class:`AdapterEntry` per adapter of ``adapter_weights`` (name → safetensors file or peft dir).

    selection: :func:`predictors.frontier.select` output holding ``rule``; frontier:
    :func:`predictors.frontier.pareto` output; policy: ``learned`` or ``profiled``.
    """
    if policy not in POLICIES:
        raise ValueError(f"export policy {policy!r}: use one of {POLICIES} (conf export.policy).")
    entries = []
    for adapter, weights in sorted(adapter_weights.items()):
        rows = selection[(selection["adapter"] == adapter) & (selection["policy"] == policy)
                         & (selection["rule"] == rule)]
        if rows.empty:
            raise ValueError(f"no selection for adapter '{adapter}', policy '{policy}', rule '{rule}': add the "
                             f"rule to the sweep's rules and make sure the adapter's requests were priced.")
        row = rows.iloc[0]
        head = heads.get(adapter)
        stats = {"rule": rule, "policy_considered": policy, "val_skip": float(row["skip"]),
                 "val_loss_points": float(row["loss_points"]), "val_accuracy": float(row["accuracy"]),
                 "full_accuracy": float(row["full_accuracy"]), "note": row["note"],
                 "head_status": head.status if head else "missing", "head_message": head.message if head else "",
                 "frontier": frontier_summary(frontier, adapter, policy)}
        fp = adapter_fingerprint(weights)
        if row["fallback"] or (policy == "learned" and not (head and head.ok)):
            entries.append(AdapterEntry(adapter, fp, "none", stats=stats))
        elif policy == "learned":
            entries.append(AdapterEntry(adapter, fp, "learned", tau=float(row["param"]), weight=head.weight,
                                        bias=head.bias, stats=stats))
        else:
            entries.append(AdapterEntry(adapter, fp, "profiled", k=int(row["param"]), stats=stats))
    return entries
