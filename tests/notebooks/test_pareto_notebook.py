"""notebooks/pareto_frontier.ipynb runs headless on a synthetic two-adapter run directory, shows both adapters'
frontiers with the reason for each operating point, and re-exports a valid bundle at another rule or budget.

The run directory is written by the pipeline's own writers (trees, heads, candidates, priced
tables, stage markers, Hydra config) from random but valid data, so no model runs.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from omegaconf import OmegaConf
from safetensors.numpy import save_file

from calibrate.rundir import RunDir
from predictors.candidates import build_candidates
from predictors.frontier import DEFAULT_RULES, compare_at_budget, k_table, pareto, select, write_tables
from predictors.heads import fit_heads, save_heads
from predictors.sweep import ForkPlanner, RequestTree, price, save_trees, sweep_cost
from serve_bridge.bundle import load_bundle
from serve_bridge.steptrim import ProfiledPolicy

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")  # jupyter_client's built-in "python3" kernel needs no installed kernel spec

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "pareto_frontier.ipynb"
ADAPTERS = ("alpha", "beta")
H = 16
T = (0, 1, 2, 3, 7, 15)
KS = (0, 1, 2, 4, 8, 16)
BUDGET = 2.0
VAL_REQUESTS = 80  # per adapter: enough for a loss upper bound within a few points


def _adapter_dir(path: Path, seed: int) -> Path:
    """A minimal peft LoRA directory (the bundle only hashes its safetensors file)."""
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4,
                                                          "target_modules": ["q_proj"]}))
    w = np.random.default_rng(seed).normal(size=(2, H)).astype(np.float32)
    save_file({"base_model.model.q_proj.lora_A.weight": w, "base_model.model.q_proj.lora_B.weight": w.T.copy()},
              str(path / "adapter_model.safetensors"))
    return path


def _labels(rng: np.random.Generator) -> tuple[pd.DataFrame, np.ndarray]:
    """Training points for 12 requests per adapter at every t of T, both classes present."""
    rows = []
    for a in ADAPTERS:
        for i in range(12):
            on_length = int(rng.integers(20, 40))
            for t in T:
                y = int(rng.random() < 0.5)
                rows.append({"uid": f"train-{i}", "adapter": a, "t": t, "y": y, "q_on": 1, "q_off": 1 - y,
                             "on_length": on_length, "off_length": on_length})
    points = pd.DataFrame(rows)
    features = rng.normal(size=(len(points), H)).astype(np.float32)
    features[:, 0] += 2.0 * points["y"].to_numpy()  # something for the heads to learn
    return points, features


def _trees(rng: np.random.Generator, heads, planner: ForkPlanner) -> list[RequestTree]:
    """Validation trees forked where the planner says, as the sweep pass records them."""
    trees = []
    for a in ADAPTERS:
        for i in range(VAL_REQUESTS):
            on_length = int(rng.integers(8, 30))
            drift = (4.0 - 0.4 * np.arange(on_length)).astype(np.float32)  # risky early, safe late, as real heads
            scores = heads[a].scores(rng.normal(size=(on_length, H))) + drift
            state, branches = planner.new_state(), {}
            for t, s in enumerate(scores):
                if planner.should_fork(state, a, t, float(s)) and t < on_length - 1:
                    branches[t] = (int(rng.random() < 0.3 + 0.1 * t), t + 1 + int(rng.integers(1, 30)))  # safe from t=7
            trees.append(RequestTree(f"val-{i}", a, on_length, int(rng.random() < 0.9), scores, branches))
    return trees


def build_run_dir(root: Path) -> Path:
    """A finished run directory (labels → heads → sweep) whose adapters live under ``root``."""
    rng = np.random.default_rng(0)
    run = RunDir(root / "run")
    points, features = _labels(rng)
    per_t = points.groupby("t")["y"].agg(["count", "mean"])
    run.begin("data")
    run.commit("data", "fp-data", {"train": 12, "validation": VAL_REQUESTS, "test": 0})
    run.begin("labels")
    points.to_parquet(run.out("labels", "points.parquet"), index=False)
    np.save(run.out("labels", "features.npy"), features)
    run.commit("labels", "fp-labels", {
        "requests": int(points[["uid", "adapter"]].drop_duplicates().shape[0]), "points": len(points),
        "positive_rate": float(points["y"].mean()),
        "per_t": {int(t): {"points": int(r["count"]), "positive_rate": float(r["mean"])} for t, r in per_t.iterrows()}})
    heads = fit_heads(points, features)
    run.begin("heads")
    save_heads(run.out("heads", "heads.safetensors"), heads)
    cands = build_candidates(heads, points, features, n_quantiles=8, ks=KS)
    cands.save(run.out("heads", "candidates.json"))
    run.commit("heads", "fp-heads", {a: {"status": h.status, "points": h.n_points, "positives": h.positives}
                                     for a, h in heads.items()})

    trees = _trees(rng, heads, ForkPlanner(cands.taus, cands.ks))
    run.begin("sweep")
    save_trees(run.out("sweep", "trees.parquet"), trees)
    priced = price(trees, cands)
    write_tables(run.out("sweep"), {
        "candidates": priced, "frontier": pareto(priced),
        "selection": select(priced, [*DEFAULT_RULES, f"budget={BUDGET:g}"]),
        "k_table": k_table(priced), "budget_comparison": compare_at_budget(priced, BUDGET)})
    cost = sweep_cost(trees, cands)
    run.commit("sweep", "fp-sweep", {
        "requests": len(trees), "backbone_accuracy": 10.0,
        "full_lora_accuracy": {a: float(g["full_accuracy"].iloc[0]) for a, g in priced.groupby("adapter")},
        "tree_tokens": cost.tree_tokens, "naive_tokens": cost.naive_tokens,
        "token_ratio": cost.naive_tokens / cost.tree_tokens, "pass_seconds": 1.0})

    # Adapter paths as users give them: one relative to the launch directory, one absolute.
    _adapter_dir(root / "adapters" / "alpha", 1)
    config = {
        "task": {"name": "synthetic"}, "backbone": {"name": "tiny-backbone"},
        "adapter": {"name": "synthetic", "adapters": [
            {"name": "alpha", "path": "adapters/alpha"},
            {"name": "beta", "path": str(_adapter_dir(root / "elsewhere" / "beta", 2))}]},
        "labeling": {"points": list(T)}, "predictor": {"name": "linear", "lam": 0.1},
        "sweep": {"n_tau": 8, "ks": list(KS)},
        "export": {"rule": "P50", "budget": BUDGET, "policy": "learned", "table_format": "csv"}}
    OmegaConf.save(config, run.path(".hydra", "config.yaml"))
    OmegaConf.save({"hydra": {"runtime": {"cwd": str(root)}}}, run.path(".hydra", "hydra.yaml"))
    return run.root


def execute_notebook(params: str) -> nbformat.NotebookNode:
    """Run the notebook with its parameters cell replaced by ``params`` (cwd: notebooks/)."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    cell.source = params
    nbclient.NotebookClient(nb, kernel_name="python3", timeout=120,
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    return nb


def test_committed_notebook_has_no_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert "parameters" in code[0].metadata.get("tags", [])
    assert all(not c.outputs and c.execution_count is None for c in code)


def test_notebook_reexports_the_selected_operating_point(tmp_path):
    run = build_run_dir(tmp_path)
    nb = execute_notebook(f'RUN_DIR = {str(run)!r}\nRULE = "P25"\nBUDGET = {BUDGET}\nPOLICY = "profiled"\n'
                          f'EXPORT_DIR = None')

    assert any("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    bundle = load_bundle(run / "bundle_P25_profiled", expected_hidden_size=H, expected_backbone="tiny-backbone",
                         known_adapters=ADAPTERS)
    chosen = select(pd.read_csv(run / "sweep" / "candidates.csv"), ["P25"]).query("policy == 'profiled'")
    expected = {r.adapter: None if r.fallback else ProfiledPolicy(int(r.param)) for r in chosen.itertuples()}
    assert bundle.policies == expected
    assert any(p is not None for p in expected.values())


def test_notebook_shows_both_frontiers_and_reexports_at_another_budget(tmp_path):
    run = build_run_dir(tmp_path)
    other = 4 * BUDGET  # the run's config says BUDGET
    nb = execute_notebook(f'RUN_DIR = {str(run)!r}\nRULE = "budget"\nBUDGET = {other}\nPOLICY = "learned"\n'
                          f'EXPORT_DIR = None')
    frontier_cell = next(c for c in nb.cells if c.cell_type == "code" and "plot_frontier(" in c.source)
    images = [o for o in frontier_cell.outputs if "image/png" in o.get("data", {})]
    text = "".join(o.get("text", "") for o in frontier_cell.outputs)
    assert len(images) == len(ADAPTERS)
    assert all(text.count(f"{a}: ") == 1 for a in ADAPTERS)  # one line per adapter on its operating point
    bundle = load_bundle(run / f"bundle_budget{other:g}_learned", expected_hidden_size=H,
                         expected_backbone="tiny-backbone", known_adapters=ADAPTERS)
    priced = pd.read_csv(run / "sweep" / "candidates.csv")
    chosen = select(priced, [f"budget={other:g}"]).query("policy == 'learned'").set_index("adapter")
    assert (chosen["loss_high"] <= other).all() and not chosen["fallback"].all()
    for a in ADAPTERS:
        e = bundle.adapters[a]
        assert e.stats["rule"] == f"budget={other:g}"
        if chosen.loc[a, "fallback"]:
            assert e.policy == "none"
        else:
            assert e.policy == "learned" and e.tau == pytest.approx(chosen.loc[a, "param"])
            assert e.stats["val_loss_high"] == pytest.approx(chosen.loc[a, "loss_high"])
