"""Bundle entries from calibration results (docs/design.md §3.6): heads + selection → AdapterEntry.

The export stage picks, per adapter, the candidate that one selection rule chose for one
policy kind, and records the calibration numbers beside it. A rule that fell back to
never-release, or a learned choice for an adapter without an ok head, exports ``none``.
"""
from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from predictors.frontier import DEFAULT_RULES, POLICIES, frontier_summary, pareto, resolve_rule, select
from predictors.heads import Head
from predictors.sweep import RequestTree, release_points
from serve_bridge.bundle import MANIFEST, AdapterEntry, adapter_fingerprint, config_fingerprint, write_bundle


def release_distribution(releases: Sequence[int | None]) -> dict[str, Any]:
    """Validation release points as plain JSON: distinct r, their counts, and the requests
    never released within their response (``stats['release_points']``, read by
    :mod:`serve_bridge.capacity`)."""
    values, counts = np.unique([r for r in releases if r is not None], return_counts=True)
    return {"r": values.astype(int).tolist(), "count": counts.astype(int).tolist(),
            "never": sum(r is None for r in releases)}


def bundle_entries(heads: Mapping[str, Head], selection: pd.DataFrame, frontier: pd.DataFrame, rule: str,
                   policy: str, adapter_weights: Mapping[str, str | Path],
                   trees: Sequence[RequestTree] | None = None, lag: int = 0) -> list[AdapterEntry]:
    """One :class:`AdapterEntry` per adapter of ``adapter_weights`` (name → safetensors file or peft dir).

    selection: :func:`predictors.frontier.select` output holding ``rule``; frontier:
    :func:`predictors.frontier.pareto` output; policy: ``learned`` or ``profiled``; trees: the
    validation request trees, whose release points under the chosen candidate go into
    ``stats['release_points']`` (:func:`release_distribution`); lag: the learned policies'
    decision lag the candidates were priced with (recorded in each learned entry).
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
                 "val_loss_points": float(row["loss_points"]), "val_loss_low": float(row["loss_low"]),
                 "val_loss_high": float(row["loss_high"]), "val_accuracy": float(row["accuracy"]),
                 "full_accuracy": float(row["full_accuracy"]), "note": row["note"],
                 "head_status": head.status if head else "missing", "head_message": head.message if head else "",
                 "frontier": frontier_summary(frontier, adapter, policy)}
        fp = adapter_fingerprint(weights)
        if row["fallback"] or (policy == "learned" and not (head and head.ok)):
            entries.append(AdapterEntry(adapter, fp, "none", stats=stats))
        else:
            if trees is not None:
                stats["release_points"] = release_distribution(
                    release_points(trees, adapter, policy, float(row["param"]), lag))
            if policy == "learned":
                entries.append(AdapterEntry(adapter, fp, "learned", tau=float(row["param"]), weight=head.weight,
                                            bias=head.bias, lag=lag, stats=stats))
            else:
                entries.append(AdapterEntry(adapter, fp, "profiled", k=int(row["param"]), stats=stats))
    return entries


CONFIG_SECTIONS = ("task", "backbone", "adapter", "labeling", "predictor", "sweep", "export")


def export_bundle(out_dir: str | Path, *, priced: pd.DataFrame, heads: Mapping[str, Head],
                  config: Mapping[str, Mapping], adapter_weights: Mapping[str, str | Path],
                  trees: Sequence[RequestTree] | None = None, lag: int = 0) -> list:
    """Select the operating point of ``config['export']`` (rule, budget, policy) from the priced
    candidates and write the bundle to ``out_dir`` (an existing bundle there is replaced).

    ``config`` holds the run's config sections (:data:`CONFIG_SECTIONS`); their fingerprint
    goes into the manifest; ``trees`` adds each adapter's validation release points to its stats;
    ``lag``: the decision lag the candidates were priced with.
    Returns the written :class:`AdapterEntry` list.
    """
    ex = config["export"]
    rule = resolve_rule(ex["rule"], ex["budget"])
    selection = select(priced, [*DEFAULT_RULES, rule])
    entries = bundle_entries(heads, selection, pareto(priced), rule, ex["policy"], adapter_weights, trees, lag)
    out = Path(out_dir)
    if (out / MANIFEST).is_file():
        shutil.rmtree(out)
    write_bundle(out, backbone=config["backbone"]["name"], hidden_size=len(next(iter(heads.values())).weight),
                 config_fingerprint=config_fingerprint({s: config[s] for s in CONFIG_SECTIONS}), adapters=entries)
    return entries
