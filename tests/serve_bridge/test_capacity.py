"""The slot capacity model (serve_bridge/capacity.py) against a brute-force run of the real
ReleaseScheduler over the stand-in of vLLM's scheduler (tests/serve_bridge/vllm/test_scheduler.py),
and its command."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from serve_bridge import capacity
from serve_bridge.bundle import AdapterEntry, write_bundle
from tests.serve_bridge.vllm.test_scheduler import FakeRequest, FakeScheduler, sched, vllm_config  # noqa: F401

H = 8


def brute_force(module, reqs: capacity.Requests, max_loras: int, release: bool, monkeypatch, bundle,
                max_num_seqs: int, budget: int) -> tuple[int, float, float, float, int]:
    """(steps, mean running, mean slots held, share of token forwards with an adapter, slot loads)
    of serving ``reqs`` offline through the stand-in scheduler, every request one at a time,
    releases forced through extra_args; the slots a list in least-recently-used order."""
    monkeypatch.setenv("LORAZOR_BUNDLE", str(bundle))
    monkeypatch.setenv("LORAZOR_SLOTS", "1" if release else "0")
    s = module.ReleaseScheduler(vllm_config(max_loras), budget=budget, max_running=max_num_seqs)
    end = {}
    for i, (a, p, o, r) in enumerate(zip(reqs.adapter, reqs.prompt, reqs.output, reqs.release)):
        extra = None if r == capacity.NEVER else {"lorazor": {"release_position": int(p + r)}}
        req = FakeRequest(f"r{i}", None, None, int(p), int(o), extra)
        req.lora_request = SimpleNamespace(lora_name=f"x{a}", lora_path="/nowhere", lora_int_id=int(a) + 1)
        s.add_request(req)
        end[req.request_id] = int(p + r) if release and r != capacity.NEVER else 1 << 60
    steps = work = running = held = tokens = lora_tokens = loads = 0
    slots: list[int] = []
    while s.requests:
        holds = {r.request_id: s.holds_slot(r) for r in list(s.running) + list(s.waiting)}
        before = {q: r.num_computed_tokens for q, r in s.requests.items()}
        so = s.schedule()
        steps += 1
        if so.num_scheduled_tokens:
            work += 1
            running += len(so.num_scheduled_tokens)
            held += len({s.requests[q].lora_request.lora_int_id for q in so.num_scheduled_tokens if holds[q]})
        used = []
        for q, n in so.num_scheduled_tokens.items():
            tokens += n
            lora_tokens += max(0, min(n, end[q] - before[q]))
            a = s.requests[q].lora_request.lora_int_id
            if before[q] < end[q] and a not in used:
                used.append(a)
        slots = [a for a in slots if a not in used] + [a for a in used if a in slots]
        for a in (a for a in used if a not in slots):
            slots = slots[1:] if len(slots) >= max_loras else slots
            slots.append(a)
            loads += 1
        s.update_from_output(so, None)
    return steps, running / work, held / work, lora_tokens / tokens, loads


@pytest.fixture
def bundle(tmp_path):
    entries = [AdapterEntry("p", "0" * 64, "profiled", k=3),
               AdapterEntry("d", "1" * 64, "profiled", k=9, stats={"release_points": {"r": [1, 4], "count": [3, 1],
                                                                                     "never": 4}}),
               AdapterEntry("n", "2" * 64, "none"),
               AdapterEntry("l", "3" * 64, "learned", tau=0.0, weight=np.zeros(H, np.float32), bias=0.0)]
    return write_bundle(tmp_path / "bundle", backbone="m", hidden_size=H, config_fingerprint="c", adapters=entries)


@pytest.mark.parametrize("max_loras,skew", [(2, None), (4, 0.8), (16, None)])
def test_model_matches_brute_force(sched, monkeypatch, bundle, max_loras, skew):  # noqa: F811
    names, dists, _ = capacity.distributions_from_bundle(bundle)
    reqs = capacity.draw_requests(120, dists, 16, skew=skew, prompt_len=(5, 30), output_len=(2, 25), seed=7)
    assert (reqs.release != capacity.NEVER).any() and (reqs.release == capacity.NEVER).any()
    for release in (False, True):
        model = capacity.simulate(reqs, max_loras, release=release, max_num_seqs=24, token_budget=64)
        steps, running, held, share, loads = brute_force(sched, reqs, max_loras, release, monkeypatch, bundle,
                                                         24, 64)
        assert model.steps == steps and model.slot_loads == loads
        assert model.lora_share == pytest.approx(share, rel=1e-12)
        assert model.mean_running == pytest.approx(running, rel=1e-9)
        assert model.mean_occupancy == pytest.approx(held, rel=1e-9)
        assert model.max_occupancy <= max_loras


def test_idle_time_between_arrivals_is_skipped_not_stepped():
    """Arrivals 10**12 steps apart: each request is served alone as soon as it arrives (one step
    for its prompt and first token, one per further token), and the idle steps between them count
    in ``steps`` without being simulated one by one."""
    gap = 10 ** 12
    reqs = capacity.Requests(np.array([0, 1, 2]), np.array([7, 3, 5]), np.array([4, 2, 6]),
                             np.full(3, capacity.NEVER), np.array([0, gap, 2 * gap]))
    result = capacity.simulate(reqs, 1, max_num_seqs=4, token_budget=16)
    assert result.steps == 2 * gap + 6
    assert result.mean_wait_steps == 0 and result.mean_running == 1 and result.slot_loads == 3


def test_steps_past_the_largest_cuda_graph_by_hand():
    """Prompts 7 and 3 at once, budget 16: step 1 schedules 10 tokens (both prompts), then one token
    per running request (2, then 1 and 1 once the 2-token request ends): only the first is past 4."""
    reqs = capacity.Requests(np.array([0, 1]), np.array([7, 3]), np.array([4, 2]), np.full(2, capacity.NEVER),
                             np.zeros(2, np.int64))
    assert capacity.simulate(reqs, 2, max_num_seqs=4, token_budget=16, graph_tokens=4).steps_past_graphs == 1
    assert capacity.simulate(reqs, 2, max_num_seqs=4, token_budget=16, graph_tokens=1).steps_past_graphs == 2
    assert capacity.simulate(reqs, 2, max_num_seqs=4, token_budget=16, graph_tokens=0).steps_past_graphs == 4
    assert capacity.simulate(reqs, 2, max_num_seqs=4, token_budget=16).steps_past_graphs == 0  # not asked


def test_release_admits_more_and_unlimited_slots_do_not_care():
    dists = [capacity.ReleaseDistribution.point(2)]
    reqs = capacity.draw_requests(400, dists, 64, prompt_len=(5, 20), output_len=(10, 30), seed=1)
    without = capacity.simulate(reqs, 8, release=False, max_num_seqs=64, token_budget=256)
    with_ = capacity.simulate(reqs, 8, release=True, max_num_seqs=64, token_budget=256)
    assert with_.mean_running > 1.5 * without.mean_running and with_.steps < without.steps
    free = [capacity.simulate(reqs, 64, release=rel, max_num_seqs=64, token_budget=256) for rel in (False, True)]
    assert free[0].steps == free[1].steps and free[1].mean_occupancy < free[0].mean_occupancy
    results = capacity.sweep(reqs, [2, 4, 8, 16, 32], max_num_seqs=64, token_budget=256)
    need = capacity.needed_max_loras(results + free, {False: free[0], True: free[1]}, 0.05)
    assert need[True] < need[False]


def test_zipf_popularity():
    p = capacity.popularity(512, 1.0)
    assert p.sum() == pytest.approx(1.0) and p[0] == pytest.approx(0.1467, abs=1e-4)
    assert p[0] / p[1] == pytest.approx(2.0) and p[0] / p[9] == pytest.approx(10.0)
    assert p[:32].sum() == pytest.approx(0.60, abs=0.005)
    assert capacity.popularity(4, 0.0).tolist() == [0.25] * 4
    assert capacity.popularity(3, 2.0)[2] == pytest.approx(1 / 9 / (1 + 1 / 4 + 1 / 9))
    dists = [capacity.ReleaseDistribution.point(2)]
    reqs = capacity.draw_requests(20000, dists, 64, zipf=1.0, seed=3)
    counts, q = np.bincount(reqs.adapter, minlength=64), capacity.popularity(64, 1.0)
    assert np.all(np.abs(counts - 20000 * q) < 4 * np.sqrt(20000 * q))  # every adapter within 4 sd of its share
    with pytest.raises(ValueError, match="skew or zipf"):
        capacity.draw_requests(10, dists, 64, zipf=1.0, skew=0.8)


def test_p90_wait_by_hand():
    """One slot, adapters 0, 1, 0 at step 0, nothing released: r0 and r2 are admitted at once and
    finish after 3 steps, r1 is admitted at step 3; waits 0, 3, 0, so the mean is 1 and the P90
    (linear between order statistics) 2.4."""
    kept = capacity.simulate(_three(capacity.NEVER), 1, release=False, max_num_seqs=8, token_budget=64)
    assert kept.mean_wait_steps == 1 and kept.p90_wait_steps == pytest.approx(2.4)


def _three(release: int) -> capacity.Requests:
    """Requests of adapters 0, 1, 0, prompts of 4 tokens, 3 tokens out, released at ``release``."""
    return capacity.Requests(np.array([0, 1, 0]), np.full(3, 4), np.full(3, 3), np.full(3, release),
                             np.zeros(3, np.int64))


def test_slot_loads_and_adapter_share_by_hand():
    # One slot: r0 and r2 (adapter 0) run together, r1 waits for the slot: 2 loads, 6 forwards each.
    kept = capacity.simulate(_three(capacity.NEVER), 1, release=False, max_num_seqs=8, token_budget=64)
    assert (kept.steps, kept.slot_loads, kept.lora_share) == (6, 2, 1.0)
    # Released at r = 1: forwards 0 (the 4 prompt tokens) and 1 run the adapter, 5 of 6 tokens; the
    # slot is handed on at step 2, so r1 starts a step earlier.
    freed = capacity.simulate(_three(1), 1, release=True, max_num_seqs=8, token_budget=64)
    assert (freed.steps, freed.slot_loads) == (5, 2) and freed.lora_share == pytest.approx(15 / 18)
    # One request at a time: adapter 0 is written again after adapter 1 took the only slot, not
    # when a second slot keeps it resident.
    one_by_one = [capacity.simulate(_three(capacity.NEVER), m, release=False, max_num_seqs=1, token_budget=64)
                  for m in (1, 2)]
    assert [r.slot_loads for r in one_by_one] == [3, 2]


def test_distributions_from_the_bundle(bundle):
    names, dists, notes = capacity.distributions_from_bundle(bundle)
    by = dict(zip(names, dists))
    assert by["p"] == capacity.ReleaseDistribution.point(3)  # profiled without stats: a point mass at k
    assert by["d"].r == (1, 4) and by["d"].p == (0.375, 0.125) and by["d"].never == 0.5
    assert by["n"].never == 1.0 and by["l"].never == 1.0
    assert notes == ["adapter 'l': learned, without release points in its stats (re-export the bundle); "
                     "modelled as never released"]
    draws = by["d"].draw(4000, np.random.default_rng(0))
    assert abs((draws == capacity.NEVER).mean() - 0.5) < 0.03 and set(draws.tolist()) == {1, 4, capacity.NEVER}


def test_command(bundle, tmp_path, capsys):
    png, out = tmp_path / "slots.png", tmp_path / "slots.json"
    rc = capacity.main(["--bundle", str(bundle), "--adapters", "32", "--skew", "0.8", "--requests", "200",
                        "--prompt-len", "5", "20", "--output-len", "5", "30", "--max-num-seqs", "32",
                        "--max-num-batched-tokens", "256", "--plot", str(png), "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and "max_loras needed with release" in text and "| 8 | yes |" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(out.read_text())
    assert {r["max_loras"] for r in data["results"]} == {1, 2, 4, 8, 16, 32}
    assert all(0 < r["lora_share"] <= 1 and r["slot_loads"] >= 1 for r in data["results"])
    assert "steps past 512 tokens (no CUDA graph) |" in text  # 200 requests of ≤ 50 tokens: 256-token steps
    assert all(r["steps_past_graphs"] == 0 for r in data["results"])
    assert capacity.main(["--bundle", str(bundle), "--adapters", "32", "--requests", "200", "--prompt-len", "5", "20",
                          "--output-len", "5", "30", "--max-num-seqs", "32", "--max-num-batched-tokens", "256",
                          "--graph-tokens", "0", "--max-loras", "8"]) == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| 8 |")]
    assert len(rows) == 2 and all(r[2] in r[-1] and r[-1].endswith("(100%) |") for r in rows)  # every step
    assert capacity.main(["--bundle", str(bundle), "--adapters", "8", "--rate", "5", "--requests", "50",
                          "--step-ms", "20", "--prompt-len", "5", "9", "--output-len", "3", "9"]) == 0
    assert capacity.main(["--bundle", str(bundle), "--adapters", "64", "--zipf", "1", "--requests", "200",
                          "--prompt-len", "5", "9", "--output-len", "3", "9", "--max-loras", "8"]) == 0
    text = capsys.readouterr().out
    assert "(Zipf s = 1)" in text and "| 8 | yes |" in text and "wait mean / P90 (steps)" in text
    for argv, msg in ((["--adapters", "8", "--rate", "5"], "--rate=5.0: needs --step-ms"),
                      (["--adapters", "8", "--skew", "1.5"], "--skew=1.5: use a number in (0, 1)"),
                      (["--adapters", "8", "--zipf", "-1"], "--zipf=-1.0: use a non-negative number"),
                      (["--adapters", "8", "--zipf", "1", "--skew", "0.8"], "--zipf=1.0: is a popularity as --skew")):
        assert capacity.main(["--bundle", str(bundle), *argv]) == 2
        assert msg in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:  # refused while the arguments are parsed
        capacity.main(["--bundle", str(bundle), "--adapters", "8", "--prompt-len", "9", "5"])
    assert exit_.value.code == 2 and "--prompt-len=[9, 5]: give MIN ≤ MAX" in capsys.readouterr().err
    assert capacity.main(["--bundle", str(tmp_path / "missing"), "--adapters", "8"]) == 2
    (tmp_path / "broken").mkdir()
    assert capacity.main(["--bundle", str(tmp_path / "broken"), "--adapters", "8"]) == 2
    assert capsys.readouterr().err.startswith("error: ")
