"""The calibration stages, in order: data → labels → heads → sweep → export → test
(→ agreement, with ``agreement=true``).

``run_pipeline`` first validates the config and every input (:mod:`calibrate.validate`), then
checks the run directory and takes its lock (:mod:`calibrate.rundir_access`). Each stage reads
its inputs from the run directory (``ctx.run.path``) and writes its outputs into its scratch
directory (``ctx.run.out``); when it returns, they are published with its marker (see
:mod:`calibrate.rundir`). ``run_pipeline`` skips finished stages whose marker lists their
:data:`OUTPUTS` intact, so an interrupted run resumes and a finished one is a no-op.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict
from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd

from calibrate.context import Context
from calibrate.errors import ConfigError
from calibrate.preview import PreviewDone, Workload, estimate, format_preview
from calibrate.rundir import CONFIG_CHANGED, NOT_RUN, fingerprint
from calibrate.rundir_access import STORAGE_ERRNOS, storage_error
from calibrate.validate import validate
from labeling.engines.vllm.options import VLLMOptions
from labeling.labels import LabelingPlan, build_requests, format_summary, run_labeling, summarize
from labeling.tasks import SPLITS
from labeling.trees import run_trees
from predictors.candidates import Candidates, build_candidates
from predictors.export import CONFIG_SECTIONS, export_bundle, resolve_rule
from predictors.frontier import DEFAULT_RULES, compare_at_budget, k_table, parse_rule, pareto, select, write_tables
from predictors.heads import fit_heads, load_heads, save_heads
from predictors.plots import (plot_agreement, plot_frontier, plot_k_curves, plot_positive_rate,
                              plot_release_histogram)
from predictors.report import explain
from predictors.sweep import ForkPlanner, load_trees, price, release_points, save_trees, sweep_cost
from serve_bridge.bundle import Bundle, bundle_digest, load_bundle
from serve_bridge.safe_write import write_atomic
from serve_bridge.steptrim import StepTrim, skip_fraction


def _say(msg: str) -> None:
    print(msg, flush=True)


def stage_data(ctx: Context) -> dict:
    """Resolve every split once (fails early on a missing path or an empty split)."""
    counts = {}
    for split in SPLITS:
        rows = ctx.task.load_split(split)
        with ctx.run.out("data", f"{split}.jsonl").open("w") as f:
            for ex in rows:
                f.write(json.dumps({"uid": ex.uid, "question": ex.question, "reference": ex.reference}) + "\n")
        counts[split] = len(rows)
    _say(f"data: {counts}")
    return counts


def engine_label(ctx: Context) -> str:
    """The run's engine in a few words (``hf (cpu)``, ``vllm (2 replicas × tensor_parallel_size 4)``)."""
    e = ctx.engine_options
    if isinstance(e, VLLMOptions):
        return f"vllm ({e.data_parallel_size} replica(s) × tensor_parallel_size {e.tensor_parallel_size})"
    return f"hf ({e.device})"


def preview(ctx: Context, plan: LabelingPlan) -> float:
    """Print the cost preview (calibrate/preview.py) and return its labeling estimate (seconds);
    stop the run after it with ``preview=true``."""
    work = Workload({split: len(ctx.task.load_split(split)) for split in SPLITS}, len(ctx.adapter_names),
                    max(len(set(p)) for p in ctx.label_points.values()))
    _say(format_preview(plan, work, engine_label(ctx)))
    if ctx.cfg.preview:
        raise PreviewDone
    return estimate(plan, work)["labels"]["seconds"]


def stage_labels(ctx: Context) -> dict:
    """ON/OFF labels on the train split (resumable shards); the cost preview after the warm-up shard."""
    seen: dict[str, Any] = {}

    def after_warmup(plan: LabelingPlan) -> None:
        seen["plan"] = plan
        seen["estimate_s"] = preview(ctx, plan)

    points, feats = run_labeling(ctx.engine, ctx.task, ctx.task.load_split("train"), ctx.adapter_names,
                                 ctx.label_points, ctx.run.root / "labels", ctx.shard_requests,
                                 shard_key=stage_fingerprints(ctx)["labels"], parts=ctx.adapter_parts,
                                 after_warmup=after_warmup, progress=ctx.engine_options.progress)
    if "plan" in seen:  # the whole labeling's generation time (all shards, resumed ones included)
        m = seen["plan"].measured()
        _say(f"labels: {m.requests} requests, {m.tokens} generated tokens in {m.seconds:.1f} s of generation "
             f"({m.tokens / max(m.seconds, 1e-9):.0f} tokens/s); the preview estimated {seen['estimate_s']:.1f} s")
    points.to_parquet(ctx.run.out("labels", "points.parquet"), index=False)
    np.save(ctx.run.out("labels", "features.npy"), feats)
    plot_positive_rate(points, ctx.run.out("plots", "positive_rate_per_t.png"))
    s = summarize(points)
    _say(format_summary(s))
    if not (s["points"] and 0 < s["positive_rate"] < 1):
        _say("labels: only one class; every head will be a never-release policy (see heads stage).")
    return s


def stage_heads(ctx: Context) -> dict:
    points = pd.read_parquet(ctx.run.path("labels", "points.parquet"))
    feats = np.load(ctx.run.path("labels", "features.npy"))
    heads = fit_heads(points, feats, lam=float(ctx.section("predictor")["lam"]))
    save_heads(ctx.run.out("heads", "heads.safetensors"), heads)
    sw = ctx.section("sweep")
    cands = build_candidates(heads, points, feats, n_quantiles=int(sw["n_tau"]), ks=sw["ks"],
                             skip_levels=sw["skip_levels"], lag=int(sw["decision_lag"]))
    cands.save(ctx.run.out("heads", "candidates.json"))
    for h in heads.values():
        _say(f"head {h.adapter}: {h.status}, {h.n_requests} requests, {h.n_points} points, "
             f"{h.positives} positive" + (f" — {h.message}" if h.message else ""))
    return {a: {"status": h.status, "points": h.n_points, "positives": h.positives} for a, h in heads.items()}


def stage_sweep(ctx: Context) -> dict:
    """One full-LoRA validation pass with forks at distinct release points; price all candidates."""
    heads = load_heads(ctx.run.path("heads", "heads.safetensors"))
    cands = Candidates.load(ctx.run.path("heads", "candidates.json"))
    scorer = StepTrim([heads[a].policy(0.0) if a in heads else None for a in ctx.adapter_names],
                      ctx.engine.hidden_size)
    tp = run_trees(ctx.engine, ctx.task, ctx.task.load_split("validation"), ctx.adapter_names, scorer,
                   ForkPlanner(cands.taus, cands.ks, cands.lag), ctx.adapter_parts)
    save_trees(ctx.run.out("sweep", "trees.parquet"), tp.trees)
    priced = price(tp.trees, cands, confidence=float(ctx.section("sweep")["confidence"]))
    tables = {"candidates": priced, "frontier": pareto(priced), "k_table": k_table(priced)}
    write_tables(ctx.run.out("sweep"), tables)
    cost = sweep_cost(tp.trees, cands)
    full = {a: float(g["full_accuracy"].iloc[0]) for a, g in priced.groupby("adapter")}
    full_tokens = sum(t.on_length for t in tp.trees)
    summary = {"requests": len(tp.trees), "backbone_accuracy": tp.backbone_accuracy, "full_lora_accuracy": full,
               "full_generation_tokens": full_tokens, "tree_tokens": cost.tree_tokens,
               "naive_tokens": cost.naive_tokens, "token_ratio": cost.naive_tokens / max(1, cost.tree_tokens),
               "pass_seconds": tp.seconds}
    _say(f"sweep: {len(tp.trees)} request trees; full LoRA {full}, backbone only {tp.backbone_accuracy}; "
         f"{cost.tree_tokens} generated tokens ({cost.tree_tokens / max(1, full_tokens):.1f} full validation "
         f"generations) for {len(priced)} candidates vs {cost.naive_tokens} naive "
         f"({summary['token_ratio']:.1f}× fewer)")
    _say(tables["k_table"].to_string(index=False))
    return summary


def stage_export(ctx: Context) -> dict:
    """Choose the operating point, write the bundle, the plots, the selection of every rule and the
    learned-vs-profiled comparison at ``export.budget`` (so another budget re-runs only this stage
    and the test); print the bundle's digest. The bundle's config fingerprint covers the config as
    the stages' fingerprints see it (:meth:`Context.fingerprint_section`): a switch that changes no
    output, such as ``labeling.early_stop``, leaves the bundle byte for byte the same."""
    ex = ctx.section("export")
    priced = pd.read_csv(ctx.run.path("sweep", "candidates.csv"))
    heads = load_heads(ctx.run.path("heads", "heads.safetensors"))
    trees = load_trees(ctx.run.path("sweep", "trees.parquet"))
    lag = Candidates.load(ctx.run.path("heads", "candidates.json")).lag  # the lag the sweep priced
    entries = export_bundle(ctx.run.out("bundle"), priced=priced, heads=heads,
                            config={s: ctx.fingerprint_section(s) for s in CONFIG_SECTIONS},
                            adapter_weights={a.name: a.path for a in ctx.adapters}, trees=trees, lag=lag)
    digest = bundle_digest(ctx.run.out("bundle"))
    rule = resolve_rule(ex["rule"], ex["budget"])
    front, sel = pareto(priced), select(priced, list(dict.fromkeys([*DEFAULT_RULES, rule, f"budget={ex['budget']:g}"])))
    budget = parse_rule(rule).max_loss
    write_tables(ctx.run.out("export"), {"selection": sel, "budget_comparison": compare_at_budget(priced, ex["budget"])})
    why = {}
    for a in ctx.adapter_names:
        e = next(e for e in entries if e.name == a)
        param = e.tau if e.policy == "learned" else e.k
        releases = release_points(trees, a, e.policy, param, lag) if e.policy != "none" else []
        why[a] = explain(priced, a, rule, ex["policy"], releases)
        plot_frontier(priced, front, sel, a, ctx.run.out("plots", f"frontier_{a}.png"), rule=rule, budget=budget,
                      note=why[a])
        plot_k_curves(k_table(priced), a, ctx.run.out("plots", f"k_curves_{a}.png"))
        if e.policy != "none":
            plot_release_histogram(releases, ctx.run.out("plots", f"release_hist_{a}.png"),
                                   title=f"{a}: validation release points ({e.policy} {param:.3g})")
    chosen = {e.name: {"policy": e.policy, "tau": e.tau, "k": e.k, "val_skip": e.stats["val_skip"],
                       "val_loss_points": e.stats["val_loss_points"], "val_loss_high": e.stats["val_loss_high"],
                       "why": why[e.name]} for e in entries}
    _say(f"export: bundle at {ctx.run.path('bundle')} (rule {rule}, policy {ex['policy']}), digest {digest} "
         f"(serve it pinned with LORAZOR_BUNDLE_DIGEST={digest})")
    return {"rule": rule, "policy": ex["policy"], "adapters": chosen, "bundle_digest": digest}


def _bundle_steptrim(ctx: Context, engine) -> tuple[Bundle, StepTrim]:
    """The exported bundle, loaded through the serving-side reader, as a StepTrim over the run's adapters."""
    bundle = load_bundle(ctx.run.path("bundle"), expected_hidden_size=engine.hidden_size,
                         expected_backbone=ctx.backbone_spec.name, known_adapters=ctx.adapter_names)
    return bundle, StepTrim([bundle.policies.get(a) for a in ctx.adapter_names], engine.hidden_size)


def realize(ctx: Context, engine, split: str, steptrim: StepTrim, desc: str) -> dict[str, dict]:
    """Run ``split`` × adapters with full LoRA and with ``steptrim`` on ``engine``; per adapter:
    requests, full-LoRA and policy accuracy (%), loss (points) and realized skip (0–1).

    A request whose adapter has no policy (never released) runs exactly as full LoRA under
    ``steptrim``, so its full-LoRA response stands for it; only the others are generated again."""
    pairs = build_requests(engine, ctx.task, ctx.task.load_split(split), range(len(ctx.adapter_names)),
                           ctx.adapter_parts)
    reqs = [r for _, r in pairs]
    full = engine.generate(reqs, ctx.task.max_new_tokens, desc=f"{desc}: full LoRA")
    released = [i for i, r in enumerate(reqs) if steptrim.policies[r.slot] is not None]
    trim = list(full)
    if released:
        again = engine.generate([reqs[i] for i in released], ctx.task.max_new_tokens, steptrim=steptrim,
                                desc=f"{desc}: bundle policy")
        for i, res in zip(released, again):
            trim[i] = res
    out = {}
    for a_idx, a in enumerate(ctx.adapter_names):
        sel = [i for i, (_, r) in enumerate(pairs) if r.slot == a_idx]
        acc_full = 100.0 * float(np.mean([ctx.task.score(pairs[i][0], engine.decode(full[i].tokens)) for i in sel]))
        acc_trim = 100.0 * float(np.mean([ctx.task.score(pairs[i][0], engine.decode(trim[i].tokens)) for i in sel]))
        out[a] = {"n_requests": len(sel), "full_accuracy": acc_full, "policy_accuracy": acc_trim,
                  "loss_points": acc_full - acc_trim,
                  "skip": skip_fraction([len(trim[i].tokens) for i in sel], [trim[i].release for i in sel])}
    return out


def stage_test(ctx: Context) -> dict:
    """Serve the exported bundle on the test split through StepTrim; realized vs full LoRA."""
    bundle, steptrim = _bundle_steptrim(ctx, ctx.engine)
    realized = realize(ctx, ctx.engine, "test", steptrim, "test")
    rows = []
    for a in ctx.adapter_names:
        r, e = realized[a], bundle.adapters[a]
        rows.append({"adapter": a, "policy": e.policy, "tau": e.tau, "k": e.k,
                     "val_skip": e.stats.get("val_skip"), "val_loss_points": e.stats.get("val_loss_points"),
                     "test_skip": r["skip"], "test_loss_points": r["loss_points"],
                     "test_full_accuracy": r["full_accuracy"], "test_policy_accuracy": r["policy_accuracy"]})
    df = pd.DataFrame(rows)
    write_tables(ctx.run.out("test"), {"realized": df})
    return {"rows": df.to_dict(orient="records")}


AGREEMENT_BAND = 3.0  # points: predicted and realized agree within this


def stage_agreement(ctx: Context) -> dict:
    """The exported bundle realized on ``ctx.agreement_engine`` (vLLM) on the validation and test
    requests, against what calibration predicted: the sweep's selection (validation) and the
    test stage (test). Skip in %, accuracy in %, differences in points (realized − predicted)."""
    engine = ctx.agreement_engine
    bundle, steptrim = _bundle_steptrim(ctx, engine)
    test_rows = {r["adapter"]: r for r in ctx.run.summary("test")["rows"]}
    realized_by = getattr(engine, "name", type(engine).__name__)
    rows = []
    for split in ("validation", "test"):
        realized = realize(ctx, engine, split, steptrim, f"agreement {split}")
        for a in ctx.adapter_names:
            e, r = bundle.adapters[a], realized[a]
            if split == "validation":
                full = e.stats.get("full_accuracy", np.nan)
                pred = {"skip": e.stats.get("val_skip", np.nan), "loss": e.stats.get("val_loss_points", np.nan),
                        "accuracy": e.stats.get("val_accuracy", full - e.stats.get("val_loss_points", np.nan)),
                        "full": full, "by": "sweep selection"}
            else:
                t = test_rows[a]
                pred = {"skip": t["test_skip"], "loss": t["test_loss_points"], "accuracy": t["test_policy_accuracy"],
                        "full": t["test_full_accuracy"], "by": f"test stage ({ctx.engine_options.name})"}
            row = {"adapter": a, "split": split, "policy": e.policy,
                   "param": e.tau if e.policy == "learned" else (e.k if e.policy == "profiled" else None),
                   "n_requests": r["n_requests"], "predicted_by": pred["by"], "realized_by": realized_by,
                   "predicted_skip_pct": 100.0 * pred["skip"], "realized_skip_pct": 100.0 * r["skip"],
                   "predicted_accuracy": pred["accuracy"], "realized_accuracy": r["policy_accuracy"],
                   "predicted_full_accuracy": pred["full"], "realized_full_accuracy": r["full_accuracy"],
                   "predicted_loss_points": pred["loss"], "realized_loss_points": r["loss_points"]}
            row["skip_diff_points"] = row["realized_skip_pct"] - row["predicted_skip_pct"]
            row["accuracy_diff_points"] = row["realized_accuracy"] - row["predicted_accuracy"]
            row["loss_diff_points"] = row["realized_loss_points"] - row["predicted_loss_points"]
            row["within_band"] = bool(abs(row["skip_diff_points"]) <= AGREEMENT_BAND
                                      and abs(row["accuracy_diff_points"]) <= AGREEMENT_BAND)
            rows.append(row)
    df = pd.DataFrame(rows)
    write_tables(ctx.run.out("agreement"), {"agreement": df})
    plot_agreement(df, ctx.run.out("plots", "agreement.png"), band=AGREEMENT_BAND)
    summary = agreement_summary(df)
    _say(summary)
    return {"realized_by": realized_by, "summary": summary, "rows": json.loads(df.to_json(orient="records"))}


def agreement_summary(df: pd.DataFrame) -> str:
    """One paragraph: how far realized skip and accuracy are from the predicted ones."""
    n, ok = len(df), int(df["within_band"].sum())
    skip, acc = df["skip_diff_points"].abs(), df["accuracy_diff_points"].abs()
    worst = df.loc[(skip + acc).idxmax()] if n else None
    text = (f"agreement: the bundle realized on {df['realized_by'].iloc[0] if n else '-'} vs calibration's "
            f"predictions (validation: the sweep's selection; test: the test stage), {n} adapter×split points: "
            f"skip differs by {skip.mean():.1f} points on average (max {skip.max():.1f}), accuracy by "
            f"{acc.mean():.1f} (max {acc.max():.1f}); {ok}/{n} agree within ±{AGREEMENT_BAND:g} points on both")
    if worst is not None and not worst["within_band"]:
        text += (f"; farthest: {worst['adapter']} on {worst['split']} (skip {worst['skip_diff_points']:+.1f}, "
                 f"accuracy {worst['accuracy_diff_points']:+.1f} points)")
    return text + ". Table: agreement/agreement.csv, plot: plots/agreement.png."


STAGES: dict[str, tuple[Callable[[Context], dict], tuple[str, ...], tuple[str, ...]]] = {
    # name: (function, config sections it depends on, upstream stages)
    "data": (stage_data, ("task",), ()),
    "labels": (stage_labels, ("task", "backbone", "adapter", "engine", "labeling"), ("data",)),
    "heads": (stage_heads, ("predictor", "sweep"), ("labels",)),
    "sweep": (stage_sweep, ("task", "backbone", "adapter", "engine", "sweep"), ("heads",)),
    "export": (stage_export, ("export",), ("sweep",)),
    "test": (stage_test, ("task", "backbone", "adapter", "engine"), ("export",)),
    "agreement": (stage_agreement, ("task", "backbone", "adapter", "engine"), ("test",)),
}


def stage_fingerprints(ctx: Context) -> dict[str, str]:
    """Each stage's fingerprint: its config sections (Context.fingerprint_section) chained with
    its upstream stages' fingerprints."""
    fps: dict[str, str] = {}
    for name, (_, sections, upstream) in STAGES.items():
        fps[name] = fingerprint(name, [ctx.fingerprint_section(s) for s in sections], [fps[u] for u in upstream])
    return fps


# What each stage must write (besides plots): a marker without one of these is not trusted.
OUTPUTS: dict[str, tuple[str, ...]] = {
    "data": tuple(f"data/{split}.jsonl" for split in SPLITS),
    "labels": ("labels/points.parquet", "labels/features.npy"),
    "heads": ("heads/heads.safetensors", "heads/candidates.json"),
    "sweep": ("sweep/trees.parquet", "sweep/candidates.csv", "sweep/frontier.csv", "sweep/k_table.csv"),
    "export": ("bundle/manifest.json", "bundle/heads.safetensors", "export/selection.csv",
               "export/budget_comparison.csv"),
    "test": ("test/realized.csv",),
    "agreement": ("agreement/agreement.csv",),
}


def wanted_stages(ctx: Context) -> list[str]:
    """The stages ``ctx`` asks for, in its order (``agreement=true`` appends ``agreement``)."""
    wanted = list(ctx.cfg.stages)
    if ctx.cfg.agreement and "agreement" not in wanted:
        wanted.append("agreement")
    unknown = [s for s in wanted if s not in STAGES]
    if unknown:
        raise ConfigError(f"unknown stage(s) {unknown} in `stages`; known: {list(STAGES)}")
    return wanted


def run_pipeline(ctx: Context, on_locked: Callable[[], None] | None = None) -> dict[str, dict]:
    """Run the configured stages in order, skipping those already done; return their summaries.

    Every check comes first (config, inputs, engines, the run directory); then the run holds
    the directory's lock, calls ``on_locked`` (the command line writes its config record and
    log file there) and runs the stages. A file system that fills up or turns read-only during
    a stage is a RunDirError; the stage's scratch output is dropped and finished stages are kept."""
    wanted = wanted_stages(ctx)
    validate(ctx)
    with ctx.run.locked():
        try:
            if on_locked is not None:
                on_locked()
            return _run_stages(ctx, wanted)
        except OSError as err:
            if err.errno not in STORAGE_ERRNOS:
                raise
            raise storage_error(err, f"run directory {ctx.run.root} cannot take the run's output") from err


def _run_stages(ctx: Context, wanted: list[str]) -> dict[str, dict]:
    for name in ctx.run.recover():
        _say(f"[{name}] finished publishing the outputs an interrupted run had committed")
    fps = stage_fingerprints(ctx)
    for name in wanted:  # a stage run without its input stage reads that stage's last intact output
        for u in STAGES[name][2]:
            why = None if u in wanted else ctx.run.intact(u, OUTPUTS[u])
            if why:
                raise ConfigError(f"stage {name!r} needs the output of stage {u!r}, which has none ({why}); "
                                  f"add {u!r} to `stages`.")
    reason = ctx.engine_choice.reason if ctx.engine_choice is not None else f"engine={ctx.engine_options.name} (explicit)"
    if ctx.engine_choice is not None:
        _say(reason)
    write_atomic(ctx.run.path("engine.json"), json.dumps({**asdict(ctx.engine_options), "why": reason}, indent=2))
    summaries = {}
    for name, (fn, _, upstream) in STAGES.items():
        if name not in wanted:
            continue
        reason = ctx.run.stale(name, fps[name], upstream, OUTPUTS[name])
        if reason is None:
            _say(f"[{name}] cached")
            summaries[name] = ctx.run.summary(name)
        else:
            _say(f"[{name}] running" if reason in (NOT_RUN, CONFIG_CHANGED) else f"[{name}] recomputing: {reason}")
            start = time.perf_counter()
            ctx.run.begin(name)
            try:
                summaries[name] = fn(ctx)
            except PreviewDone:
                ctx.run.discard(name)
                _say("preview=true: stopped after the preview; the measured shard is kept, so the same command "
                     "without preview=true goes on from there.")
                return summaries
            except BaseException:
                ctx.run.discard(name)
                raise
            ctx.run.commit(name, fps[name], summaries[name], upstream, OUTPUTS[name])
            _say(f"[{name}] done in {time.perf_counter() - start:.1f} s")
        if name == "labels" and ctx.cfg.preview:
            _say("preview=true: labeling is already done, nothing left to preview.")
            return summaries
    return summaries


def format_final(summaries: dict[str, dict]) -> str:
    """The end-of-run table per adapter: policy, τ or k, validation skip and loss, test realized; the
    bundle's digest."""
    if "export" not in summaries:
        return ""
    test = {r["adapter"]: r for r in summaries.get("test", {}).get("rows", [])}
    ex = summaries["export"]
    lines = [f"operating point: rule {ex['rule']}, policy {ex['policy']} (val loss bound: exact, one-sided)",
             f"{'adapter':<16}{'policy':<10}{'tau/k':>10}{'val skip':>10}{'val loss':>10}{'bound':>8}"
             f"{'test skip':>11}{'test loss':>11}"]
    for a, c in ex["adapters"].items():
        param = f"{c['tau']:.4g}" if c["tau"] is not None else (str(c["k"]) if c["k"] is not None else "-")
        t = test.get(a, {})
        ts = f"{100 * t['test_skip']:.1f}%" if t else "-"
        tl = f"{t['test_loss_points']:.1f}" if t else "-"
        lines.append(f"{a:<16}{c['policy']:<10}{param:>10}{100 * c['val_skip']:>9.1f}%{c['val_loss_points']:>10.1f}"
                     f"{c['val_loss_high']:>8.1f}{ts:>11}{tl:>11}")
    lines += [f"- {c['why']}" for c in ex["adapters"].values()]
    if "bundle_digest" in ex:  # exports cached before the digest was printed lack it
        lines.append(f"bundle digest (LORAZOR_BUNDLE_DIGEST): {ex['bundle_digest']}")
    return "\n".join(lines)
