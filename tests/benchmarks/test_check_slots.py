"""The GPU slot check's comparison and engine environments (benchmarks/serving/check_slots.py), on
fabricated engine results."""
from __future__ import annotations

import json
import time
from types import SimpleNamespace

from benchmarks.serving import check_slots


def _run(tokens, releases=None):
    """A family's result: its tokens and, as each position's most likely tokens, the token and its two
    neighbours (so a neighbour chosen by the other run is a near-tie, anything else is far)."""
    return {"tokens": tokens, "top": [[[t - 1, t, t + 1] for t in seq] for seq in tokens],
            **({} if releases is None else {"releases": releases})}


def _requests(n, max_tokens=lambda i: 3 + i % 4):
    return [{"adapter": i % 6, "max_tokens": max_tokens(i)} for i in range(n)]


def _dropped(requests):
    return [i for i, r in enumerate(requests) if check_slots.learned_bias(r["adapter"]) < 0 and r["max_tokens"] > 1]


def _write(out, requests, *, keep_tokens=None, keep_releases=None, learn_tokens=None, on_adapters=12,
           keep_adapters=8, keep_scheduler="ReleaseAsyncScheduler"):
    tokens = [[10 * i] * r["max_tokens"] for i, r in enumerate(requests)]
    # learned requests released at t = 0 run without their adapter from the second token on
    dropped = set(_dropped(requests))
    learned = learn_tokens or [t[:1] + [t[0] + 5] * (len(t) - 1) if i in dropped else t
                               for i, t in enumerate(tokens)]
    releases = [0 if i % 2 else None for i in range(len(requests))]
    stats = {"slot_steps": 10, "max_slots_held": 8, "max_adapters_scheduled": on_adapters}
    keep_stats = {**stats, "slot_steps": 14, "max_adapters_scheduled": keep_adapters}
    asynchronous = {"async_scheduling": True}  # vLLM's default: the engines' schedulers are the async ones
    (out / "stock.json").write_text(json.dumps({"scheduler": "AsyncScheduler", "full": _run(tokens)} | asynchronous))
    (out / "slots.json").write_text(json.dumps({"scheduler": "ReleaseAsyncScheduler", **asynchronous,
                                                "off": _run(tokens, [None] * len(requests)),
                                                "prof": _run(tokens, releases) | stats,
                                                "learn": _run(learned, releases) | stats}))
    (out / "keep.json").write_text(json.dumps({"scheduler": keep_scheduler, **asynchronous,
                                               "prof": _run(keep_tokens or tokens, keep_releases or releases)
                                               | keep_stats,
                                               "learn": _run(keep_tokens or learned, keep_releases or releases)
                                               | keep_stats}))


def test_compare_passes_and_fails(tmp_path):
    requests = _requests(12)
    _write(tmp_path, requests)
    rows = check_slots.compare(tmp_path, requests)
    assert len(rows) == check_slots.N_CHECKS and all(ok for _, ok, _ in rows), rows
    assert check_slots.tally(rows) == (f"{check_slots.N_CHECKS}/{check_slots.N_CHECKS} checks pass", True)
    # an engine that did not finish leaves its checks out: counted, never a pass
    (tmp_path / "keep.json").unlink()
    partial = check_slots.compare(tmp_path, requests)
    assert 0 < len(partial) < check_slots.N_CHECKS and all(ok for _, ok, _ in partial)
    assert check_slots.tally(partial) == (f"{len(partial)}/{check_slots.N_CHECKS} checks pass, "
                                          f"{check_slots.N_CHECKS - len(partial)} not reached", False)
    failed = partial[:1] + [(partial[1][0], False, "x")] + partial[2:]
    assert check_slots.tally(failed)[0].endswith(", 1 failed, " + f"{check_slots.N_CHECKS - len(partial)} not reached")
    bad = [[999] * r["max_tokens"] for r in requests]
    # keep serves the bundle with hand-back off: LoRazor's scheduler still, not vLLM's
    _write(tmp_path, requests, keep_tokens=bad, on_adapters=8, keep_adapters=9, keep_scheduler="AsyncScheduler")
    failed = {name for name, ok, _ in check_slots.compare(tmp_path, requests) if not ok}
    assert failed == {"engines run the expected schedulers",
                      "(b) profiled: tokens with hand-back ≡ without, up to near-ties",
                      "(c) learned: tokens with hand-back ≡ without, up to near-ties",
                      "(b) profiled (d): slots handed on", "(c) learned (d): slots handed on",
                      "(b) profiled (e): without hand-back ≤ max_loras adapters per step",
                      "(c) learned (e): without hand-back ≤ max_loras adapters per step"}
    detail = dict((n, d) for n, _, d in check_slots.compare(tmp_path, requests))
    assert detail["(b) profiled: tokens with hand-back ≡ without, up to near-ties"].startswith(
        "0/12 identical, 0 near-tie, 12 far (req 0: far at token 0, release None")


def test_a_near_tie_passes_and_is_counted(tmp_path):
    requests = _requests(6)
    tokens = [[10 * i] * r["max_tokens"] for i, r in enumerate(requests)]
    tokens[4] = tokens[4][:2] + [41] * (len(tokens[4]) - 2)  # the neighbour of 40 from token 2 on
    _write(tmp_path, requests, keep_tokens=tokens)
    rows = {n: (ok, d) for n, ok, d in check_slots.compare(tmp_path, requests)}
    ok, detail = rows["(b) profiled: tokens with hand-back ≡ without, up to near-ties"]
    assert ok and detail == "5/6 identical, 1 near-tie, 0 far (req 4: near-tie at token 2, release None)"
    tokens[4] = tokens[4][:2] + [47] * (len(tokens[4]) - 2)  # 47 is among no top-3 of 40's run
    _write(tmp_path, requests, keep_tokens=tokens)
    ok, detail = {n: (ok, d) for n, ok, d in check_slots.compare(tmp_path, requests)}[
        "(b) profiled: tokens with hand-back ≡ without, up to near-ties"]
    assert not ok and detail.endswith("1 far (req 4: far at token 2, release None)")


def test_release_points_are_compared_where_the_tokens_before_them_agree(tmp_path):
    requests = _requests(6, max_tokens=lambda i: 6)
    tokens = [[10 * i] * 6 for i in range(6)]
    name = "(c) learned: release points with hand-back ≡ without, where the tokens before them agree"

    def release_row(keep_tokens):
        _write(tmp_path, requests, learn_tokens=tokens, keep_tokens=keep_tokens, keep_releases=[3, 5, 3, 3, 3, 3])
        slots = json.loads((tmp_path / "slots.json").read_text())
        for fam in ("prof", "learn"):
            slots[fam]["releases"] = [3] * 6
        (tmp_path / "slots.json").write_text(json.dumps(slots))
        return {n: (ok, d) for n, ok, d in check_slots.compare(tmp_path, requests)}[name]

    # request 1: a near-tie at token 1, then another release point: its decision saw other tokens
    moved = [t if i != 1 else [10, 11, 11, 11, 11, 11] for i, t in enumerate(tokens)]
    assert release_row(moved) == (True, "5/5 equal (1 diverged earlier); 6 released")
    ok, detail = release_row(tokens)  # the same release difference after identical tokens
    assert not ok and detail.startswith("5/6 equal (0 diverged earlier)")


def test_the_near_tie_test_must_see_a_dropped_adapter(tmp_path):
    requests = _requests(12)
    tokens = [[10 * i] * r["max_tokens"] for i, r in enumerate(requests)]
    _write(tmp_path, requests, learn_tokens=tokens)  # dropping the adapter changed nothing: blind
    ok, detail = {n: (ok, d) for n, ok, d in check_slots.compare(tmp_path, requests)}[
        "(g) dropping the adapter is far, not a near-tie (learned release at t = 0 vs full LoRA)"]
    assert not ok and detail == f"{len(_dropped(requests))}/{len(_dropped(requests))} identical, 0 near-tie, 0 far"


def test_engine_environments(tmp_path):
    base = {"LORAZOR_GRIDTRIM": "1", "PATH": "/bin"}
    stock = check_slots.engine_env("stock", tmp_path, base)
    assert "LORAZOR_GRIDTRIM" not in stock and stock["VLLM_BATCH_INVARIANT"] == "1" and stock["PATH"] == "/bin"
    slots = check_slots.engine_env("slots", tmp_path, base)
    assert slots["LORAZOR_BUNDLE"] == str(tmp_path / "bundle") and "LORAZOR_SLOTS" not in slots
    assert check_slots.engine_env("keep", tmp_path, base)["LORAZOR_SLOTS"] == "0"


def test_invariance_pairs_are_reported_beside_the_checks(tmp_path):
    requests = _requests(5, max_tokens=lambda i: 4)
    _write(tmp_path, requests)
    tokens = [[10 * i] * 4 for i in range(5)]
    same = {"scheduler": "Scheduler", "full": _run(tokens)}
    near = {"scheduler": "Scheduler", "full": _run(tokens[:4] + [[40, 40, 41, 41]])}
    far = {"scheduler": "Scheduler", "full": _run(tokens[:4] + [[40, 40, 47, 40]])}
    for engine, result in (("stock16", same), ("idle", same), ("idle16", near), ("base", same), ("base16", far)):
        (tmp_path / f"{engine}.json").write_text(json.dumps(result))
    rows = {n: (ok, d) for n, ok, d in check_slots.compare(tmp_path, requests)}
    pair = "(f) stock vLLM's batch dependence is near-ties only, {} (max_num_seqs 128 vs 16)"
    assert rows[pair.format("CUDA graphs, LoRA")] == (True, "5/5 identical, 0 near-tie, 0 far")
    assert rows[pair.format("CUDA graphs, LoRA enabled, no adapter requested")] == (
        True, "4/5 identical, 1 near-tie, 0 far (req 4: near-tie at token 2)")
    assert rows[pair.format("CUDA graphs, no LoRA")] == (False, "4/5 identical, 0 near-tie, 1 far (req 4: far at token 2)")
    assert not any("eager" in n for n in rows)  # a pair with an engine missing is not reported
    assert len([n for n in rows if not n.startswith("(f)")]) == check_slots.N_CHECKS


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
    # vLLM 0.34 has no V1 runner (VLLM_USE_V2_MODEL_RUNNER=0 stops it): "every pair" leaves that pair out
    without_v1 = check_slots.engine_order(list(check_slots.ENGINES), [], v1_runner=False)
    assert set(every) - set(without_v1) == {"v1", "v1_16"}


def test_refuses_the_v1_pair_where_vllm_has_no_v1_runner(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(check_slots, "entry_points", lambda group: [SimpleNamespace(name="lorazor")])
    monkeypatch.setattr(check_slots, "has_v1_runner", lambda: False)
    argv = ["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--engines", "--invariance", "v1"]
    assert check_slots.main(argv) == 2
    assert "--invariance v1 needs vLLM's V1 model runner" in capsys.readouterr().err
    assert not (tmp_path / "work").exists()


def test_random_weights_are_a_complete_llama_checkpoint(tmp_path):
    """Every parameter of the config's Llama comes from the file (none left at init), at std 0.02."""
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.serving.synthetic import write_model_config, write_random_weights

    cfg = check_slots.MODEL | {"num_hidden_layers": 2, "vocab_size": 512}
    write_model_config(tmp_path, cfg)
    path = write_random_weights(tmp_path, cfg)
    tensors = load_file(str(path))
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert unexpected == [] and missing in ([], ["lm_head.weight"])  # tied: lm_head is the embedding
    q = tensors["model.layers.1.self_attn.q_proj.weight"].float()
    assert q.shape == (cfg["num_attention_heads"] * cfg["head_dim"], cfg["hidden_size"])
    assert 0.018 < q.std().item() < 0.022 and torch.all(tensors["model.norm.weight"] == 1)
    assert load_file(str(write_random_weights(tmp_path, cfg))).keys() == tensors.keys()


def test_a_release_difference_at_a_decision_near_tie_passes_and_nothing_else(tmp_path):
    """Request 1's decision fires after forward 2 with hand-back (release at 3, the lag later) and
    after 5 without (release at 6), tokens equal up to there, then far from token 4 (one run dropped
    the adapter): accepted when both runs' margins s_2 − τ lie within DECISION_TIE, refused when one
    does not or none were recorded."""
    assert check_slots.LEARNED_LAG == 1
    requests = _requests(6, max_tokens=lambda i: 7)
    tokens = [[10 * i] * 7 for i in range(6)]
    dropped = [t if i != 1 else [10, 10, 10, 10, 90, 90, 90] for i, t in enumerate(tokens)]
    rows = ("(c) learned: tokens with hand-back ≡ without, up to near-ties",
            "(c) learned: release points with hand-back ≡ without, where the tokens before them agree")

    def checked(margin_on, margin_keep, record=True):
        _write(tmp_path, requests, learn_tokens=tokens, keep_tokens=tokens, keep_releases=[4, 6, 4, 4, 4, 4])
        slots, keep = (json.loads((tmp_path / f"{e}.json").read_text()) for e in ("slots", "keep"))
        slots["learn"]["tokens"] = dropped
        slots["learn"]["releases"] = [4, 3, 4, 4, 4, 4]
        keep["learn"]["releases"] = [4, 6, 4, 4, 4, 4]
        if record:
            slots["learn"]["margins"] = [[[0, 1.0], [1, 0.7], [2, margin_on]]] * 6
            keep["learn"]["margins"] = [[[0, 1.0], [1, 0.7], [2, margin_keep]]] * 6
        for e, doc in (("slots", slots), ("keep", keep)):
            (tmp_path / f"{e}.json").write_text(json.dumps(doc))
        got = {n: (ok, d) for n, ok, d in check_slots.compare(tmp_path, requests)}
        return [got[r] for r in rows]

    (tok_ok, tok_detail), (rel_ok, rel_detail) = checked(-0.01, 0.02)
    assert tok_ok and tok_detail == "5/6 identical, 0 near-tie, 0 far, 1 far after a decision near-tie"
    assert rel_ok and rel_detail == ("5/6 equal, 1 at a decision near-tie (|s − τ| ≤ 0.05 in both runs) "
                                     "(0 diverged earlier); 6 released")
    for args, shown in (((-0.01, 0.4), "-0.010 / +0.400"), ((-0.3, 0.02), "-0.300 / +0.020"), ((0.0, 0.0, False), "— / —")):
        (tok_ok, tok_detail), (rel_ok, rel_detail) = checked(*args)
        assert not tok_ok and not rel_ok and tok_detail.endswith("1 far (req 1: far at token 4, release 6)")
        assert rel_detail.endswith(f"6 released (req 1: release 3 vs 6, margins {shown} at t = 2)")


def test_a_failed_engine_leaves_no_earlier_result_to_compare(tmp_path, monkeypatch):
    """Engines whose process fails are compared as missing (rc 1), not with a previous run's files."""
    monkeypatch.setattr(check_slots, "entry_points", lambda group: [SimpleNamespace(name="lorazor")])
    monkeypatch.setattr(check_slots.subprocess, "Popen", lambda *a, **k: SimpleNamespace(poll=lambda: 1))
    out, work = tmp_path / "out", tmp_path / "work"
    check_slots.prepare(work, 12)
    out.mkdir()
    _write(out, json.loads((work / "requests.json").read_text()))  # an earlier run that passed every check
    assert check_slots.main(["--out", str(out), "--work", str(work), "--requests", "12", "--weights", "dummy"]) == 1
    report = (out / "check_slots.md").read_text()
    assert "stock: rc 1" in report and "(a) policy off" not in report and not list(out.glob("*.json"))


def test_engines_run_side_by_side_within_the_budget(tmp_path):
    """Real child processes: at most ``parallel`` at once, in order, each logging to its file; one
    still running at the deadline is killed, one that would start in the last ``min_left_s`` is not
    started, and an earlier result file of an engine that runs is removed before it starts."""
    import subprocess
    import sys

    started: list[tuple[str, float]] = []
    naps = {"a": 0.6, "slow": 60, "b": 0.6, "c": 2.0, "late": 0}

    def launch(engine, log):
        started.append((engine, time.time()))
        code = f"import time; print('{engine} ran', flush=True); time.sleep({naps[engine]})"
        return subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT)

    (tmp_path / "a.json").write_text("{}")  # an earlier run's
    (tmp_path / "late.json").write_text("{}")
    t0 = time.time()
    notes = check_slots.run_engines(list(naps), launch, tmp_path, t0 + 6.0, parallel=2, min_left_s=3.0)
    took = time.time() - t0
    first = dict(started)
    assert list(first) == ["a", "slow", "b", "c"]  # late: c ends at least 3.2 s in, under 3 s before the deadline
    assert first["slow"] - first["a"] < 0.5 and first["b"] - first["a"] >= 0.5  # b waits for a's place
    assert [n.split(",")[0] for n in notes] == ["a: rc 0", "slow: rc timeout", "b: rc 0", "c: rc 0", "late: not run"]
    assert notes[-1].endswith(" s left")
    assert 5.9 < took < 20  # slow was killed at the deadline, not waited for
    assert (tmp_path / "a.log").read_text() == "a ran\n" and not (tmp_path / "a.json").exists()
    assert (tmp_path / "late.json").exists() and not (tmp_path / "late.log").exists()
