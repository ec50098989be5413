"""The GPU slot check's comparison and engine environments (benchmarks/serving/check_slots.py), on
fabricated engine results."""
from __future__ import annotations

import json

from benchmarks.serving import check_slots


def _write(out, requests, *, keep_tokens=None, on_adapters=12, keep_adapters=8, keep_scheduler="Scheduler"):
    tokens = [[i] * r["max_tokens"] for i, r in enumerate(requests)]
    releases = [0 if i % 2 else None for i in range(len(requests))]
    fam = {"tokens": tokens, "releases": releases, "slot_steps": 10, "max_slots_held": 8,
           "max_adapters_scheduled": on_adapters}
    keep = {**fam, "tokens": keep_tokens or tokens, "slot_steps": 14, "max_adapters_scheduled": keep_adapters}
    (out / "stock.json").write_text(json.dumps({"scheduler": "Scheduler", "full": {"tokens": tokens}}))
    (out / "slots.json").write_text(json.dumps({"scheduler": "ReleaseScheduler", "off": {
        "tokens": tokens, "releases": [None] * len(requests)}, "prof": fam, "learn": fam}))
    (out / "keep.json").write_text(json.dumps({"scheduler": keep_scheduler, "prof": keep, "learn": keep}))


def test_compare_passes_and_fails(tmp_path):
    requests = [{"max_tokens": 3 + i % 4} for i in range(6)]
    _write(tmp_path, requests)
    rows = check_slots.compare(tmp_path, requests)
    assert len(rows) == 12 and all(ok for _, ok, _ in rows), rows
    bad = [[9] * r["max_tokens"] for r in requests]
    _write(tmp_path, requests, keep_tokens=bad, on_adapters=8, keep_adapters=9, keep_scheduler="ReleaseScheduler")
    failed = {name for name, ok, _ in check_slots.compare(tmp_path, requests) if not ok}
    assert failed == {"engines run the expected schedulers", "(b) profiled: tokens with hand-back ≡ without",
                      "(c) learned: tokens with hand-back ≡ without", "(b) profiled (d): slots handed on",
                      "(c) learned (d): slots handed on",
                      "(b) profiled (e): without hand-back ≤ max_loras adapters per step",
                      "(c) learned (e): without hand-back ≤ max_loras adapters per step"}
    detail = dict((n, d) for n, _, d in check_slots.compare(tmp_path, requests))
    assert "req 0: first diff at token 0, release None" in detail["(b) profiled: tokens with hand-back ≡ without"]


def test_engine_environments(tmp_path):
    base = {"LORAZOR_GRIDTRIM": "1", "PATH": "/bin"}
    stock = check_slots.engine_env("stock", tmp_path, base)
    assert "LORAZOR_GRIDTRIM" not in stock and stock["VLLM_BATCH_INVARIANT"] == "1" and stock["PATH"] == "/bin"
    slots = check_slots.engine_env("slots", tmp_path, base)
    assert slots["LORAZOR_BUNDLE"] == str(tmp_path / "bundle") and "LORAZOR_SLOTS" not in slots
    assert check_slots.engine_env("keep", tmp_path, base)["LORAZOR_SLOTS"] == "0"


def test_invariance_pairs_are_reported_beside_the_twelve(tmp_path):
    requests = [{"max_tokens": 4} for _ in range(5)]
    _write(tmp_path, requests)
    same = {"scheduler": "Scheduler", "full": {"tokens": [[i] * 4 for i in range(5)]}}
    moved = {"scheduler": "Scheduler", "full": {"tokens": [[i] * 4 for i in range(4)] + [[4, 4, 7, 4]]}}
    for engine, result in (("stock16", same), ("idle", same), ("idle16", same), ("base", same), ("base16", moved)):
        (tmp_path / f"{engine}.json").write_text(json.dumps(result))
    rows = {n: (ok, d) for n, ok, d in check_slots.compare(tmp_path, requests)}
    assert rows["(f) stock vLLM is batch-invariant, CUDA graphs, LoRA (max_num_seqs 128 vs 16)"] == (True, "5/5 identical")
    assert rows["(f) stock vLLM is batch-invariant, CUDA graphs, LoRA enabled, no adapter requested (max_num_seqs 128 vs 16)"] == (
        True, "5/5 identical")
    ok, detail = rows["(f) stock vLLM is batch-invariant, CUDA graphs, no LoRA (max_num_seqs 128 vs 16)"]
    assert not ok and detail == "4/5 identical (req 4: first diff at token 2)"
    assert not any("eager" in n for n in rows)  # a pair with an engine missing is not reported
    assert len([n for n in rows if not n.startswith("(f)")]) == 12


def test_variant_engines_run_stock_vllm(tmp_path):
    for engine in check_slots.VARIANTS:
        env = check_slots.engine_env(engine, tmp_path, {"LORAZOR_BUNDLE": "x"})
        assert not any(k.startswith("LORAZOR_") for k in env) and env["VLLM_BATCH_INVARIANT"] == "1"


def test_gridtrim_kernels_in_every_engine(tmp_path):
    for engine in (*check_slots.ENGINES, *check_slots.VARIANTS):
        assert check_slots.engine_env(engine, tmp_path, {}, gridtrim=True)["LORAZOR_GRIDTRIM"] == "1"
        assert "LORAZOR_GRIDTRIM" not in check_slots.engine_env(engine, tmp_path, {})


def test_refuses_before_any_work_when_vllm_would_not_load_the_plugin(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(check_slots, "entry_points", lambda group: [])
    assert check_slots.main(["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")]) == 2
    assert "scripts/env.sh" in capsys.readouterr().err and not (tmp_path / "work").exists()


def test_variants_set_their_environment_and_only_known_options(tmp_path):
    env = check_slots.engine_env("v1_16", tmp_path, {"VLLM_USE_V2_MODEL_RUNNER": "1"})
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "0" and env["VLLM_BATCH_INVARIANT"] == "1"
    assert check_slots.engine_env("wide", tmp_path, {"VLLM_USE_V2_MODEL_RUNNER": "1"})["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    for big, small, _ in check_slots.INVARIANCE_PAIRS.values():
        one = check_slots.ENGINE | check_slots.VARIANTS.get(big, {})
        other = check_slots.ENGINE | check_slots.VARIANTS[small]
        assert {k for k in one | other if one.get(k) != other.get(k)} == {"max_num_seqs"}, (big, small)
        assert other["max_num_seqs"] == 16 and one["max_num_seqs"] == 128


def test_engine_order_runs_each_named_pair_once():
    assert check_slots.engine_order(["keep", "stock", "slots"], None) == ["stock", "slots", "keep"]
    assert check_slots.engine_order([], ["idle", "v1"]) == ["idle", "idle16", "v1", "v1_16"]
    assert check_slots.engine_order(["stock"], ["lora", "base"]) == ["stock", "stock16", "base", "base16"]
    every = check_slots.engine_order(list(check_slots.ENGINES), [])
    assert every[:3] == list(check_slots.ENGINES) and set(every[3:]) == set(check_slots.VARIANTS)
    assert len(every) == len(set(every))
