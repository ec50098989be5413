"""Early stop is exact: stopping each response where its answer is decided gives the same labels,
trees, frontiers, selections, bundle and realized numbers as generating to the end and cutting
there afterwards (labeling/answer_cut.py), on the demo and on the shipped GSM8K subset."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from labeling.answer_cut import decided_length
from labeling.engines.hf import GenRequest, generated_tokens
from labeling.labels import build_requests
from labeling.tasks import build_task
from tests.calibrate.test_pipeline import run
from tests.conftest import ROOT

DEMO_TINY = ["task.options.parts.arith.sizes={train: 2, validation: 2, test: 2}",
             "task.options.parts.arith.options.max_new_tokens=32",
             "task.options.parts.counter.sizes={train: 4, validation: 4, test: 2}",
             "labeling.shard_requests=4", "engine.progress=false"]
TABLES = ["sweep/candidates.csv", "sweep/frontier.csv", "sweep/k_table.csv", "export/selection.csv",
          "export/budget_comparison.csv", "test/realized.csv"]


def _generate(engine, early_stop: bool, task, examples, **kw):
    engine.early_stop = early_stop
    try:
        pairs = build_requests(engine, task, examples, [0])
        return pairs, engine.generate([r for _, r in pairs], task.max_new_tokens, **kw)
    finally:
        engine.early_stop = True


def test_gsm8k_subset_results_are_identical_with_and_without_early_stop(engine_auto) -> None:
    task = build_task("gsm8k", source=str(ROOT / "labeling" / "data" / "gsm8k_subset"), val_size=8,
                      sizes={"validation": 3}, max_new_tokens=40)
    examples = task.load_split("validation")
    kw = {"capture": lambda t: t in (0, 1, 2, 3, 7, 15), "fork": lambda res, t, s: t in (0, 1, 2, 3, 7, 15, 31)}
    start = engine_auto.generated_tokens
    _, on = _generate(engine_auto, True, task, examples, **kw)
    middle = engine_auto.generated_tokens
    pairs, off = _generate(engine_auto, False, task, examples, **kw)
    for (ex, req), a, b in zip(pairs, on, off):
        assert (a.tokens, a.branches, a.release, sorted(a.hidden)) == (b.tokens, b.branches, b.release, sorted(b.hidden))
        for t in a.hidden:
            assert np.array_equal(a.hidden[t].numpy(), b.hidden[t].numpy())
        # a cut response scores as the whole one would, and ends at its first decided token
        n = decided_length(a.tokens, req.stop, engine_auto.decode)
        assert n is None or n == len(a.tokens)
        assert all(task.score(ex, engine_auto.decode(x)) in (0, 1) for x in [a.tokens, *a.branches.values()])
    assert middle - start == sum(map(generated_tokens, on)) <= engine_auto.generated_tokens - middle


def test_cut_responses_score_as_the_whole_ones(engine_auto) -> None:
    """The cut is exact: with no answer rule the same requests generate to the end, and each cut
    response scores as its whole one; counter's wrong commits are cut before their sentence."""
    task = build_task("counter", sizes={"validation": 6}, max_new_tokens=32)
    examples = task.load_split("validation")
    kw = {"fork": lambda res, t, s: t in (0, 1, 2, 3, 5, 8)}
    pairs, cut = _generate(engine_auto, True, task, examples, **kw)
    whole = engine_auto.generate([GenRequest(r.uid, r.prompt_ids, r.slot) for _, r in pairs], task.max_new_tokens, **kw)
    shorter = 0
    for (ex, _), a, b in zip(pairs, cut, whole):
        assert b.tokens[:len(a.tokens)] == a.tokens
        assert task.score(ex, engine_auto.decode(a.tokens)) == task.score(ex, engine_auto.decode(b.tokens))
        for t, branch in a.branches.items():
            assert b.branches[t][:len(branch)] == branch
            assert task.score(ex, engine_auto.decode(branch)) == task.score(ex, engine_auto.decode(b.branches[t]))
            shorter += len(branch) < len(b.branches[t])
    assert shorter > 0


@pytest.fixture(scope="module")
def demo_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny demo calibrated with and without early stop."""
    on, off = tmp_path_factory.mktemp("early_stop_on"), tmp_path_factory.mktemp("early_stop_off")
    run(on, DEMO_TINY)
    run(off, [*DEMO_TINY, "labeling.early_stop=false"])
    return on, off


def test_demo_labels_are_identical_and_tables_agree_with_and_without_early_stop(demo_runs: tuple[Path, Path]) -> None:
    on, off = demo_runs
    a, b = pd.read_parquet(on / "labels/points.parquet"), pd.read_parquet(off / "labels/points.parquet")
    pd.testing.assert_frame_equal(a, b)
    assert len(a) > 0 and a["y"].sum() > 0
    # The hidden states are those of each forward in batches whose rows differ once some rows stop
    # early; CPU matmuls may round them differently in the last bits.
    np.testing.assert_allclose(np.load(on / "labels/features.npy"), np.load(off / "labels/features.npy"),
                               rtol=1e-4, atol=1e-4)
    # Heads trained on those features: the same candidates, thresholds equal to float32 rounding.
    ca, cb = (json.loads((d / "heads/candidates.json").read_text()) for d in (on, off))
    assert ca["ks"] == cb["ks"] and ca["taus"].keys() == cb["taus"].keys()
    for name in ca["taus"]:
        np.testing.assert_allclose(ca["taus"][name], cb["taus"][name], rtol=1e-5)
    pd.testing.assert_frame_equal(pd.read_parquet(on / "sweep/trees.parquet"), pd.read_parquet(off / "sweep/trees.parquet"),
                                  check_exact=False, rtol=1e-5)
    for name in TABLES:
        pd.testing.assert_frame_equal(pd.read_csv(on / name), pd.read_csv(off / name), obj=name, check_exact=False,
                                      rtol=1e-5)
    ha, hb = (load_file(str(d / "bundle/heads.safetensors")) for d in (on, off))
    assert ha.keys() == hb.keys()
    for key in ha:
        torch.testing.assert_close(ha[key], hb[key], rtol=1e-4, atol=1e-4)
