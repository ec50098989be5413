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
                max_num_seqs: int, budget: int) -> tuple[int, float, float]:
    """(steps, mean running, mean slots held) of serving ``reqs`` offline through the stand-in
    scheduler, every request one at a time, releases forced through extra_args."""
    monkeypatch.setenv("LORAZOR_BUNDLE", str(bundle))
    monkeypatch.setenv("LORAZOR_SLOTS", "1" if release else "0")
    s = module.ReleaseScheduler(vllm_config(max_loras), budget=budget, max_running=max_num_seqs)
    for i, (a, p, o, r) in enumerate(zip(reqs.adapter, reqs.prompt, reqs.output, reqs.release)):
        extra = None if r == capacity.NEVER else {"lorazor": {"release_position": int(p + r)}}
        req = FakeRequest(f"r{i}", None, None, int(p), int(o), extra)
        req.lora_request = SimpleNamespace(lora_name=f"x{a}", lora_path="/nowhere", lora_int_id=int(a) + 1)
        s.add_request(req)
    steps = work = running = held = 0
    while s.requests:
        holds = {r.request_id: s.holds_slot(r) for r in list(s.running) + list(s.waiting)}
        so = s.schedule()
        steps += 1
        if so.num_scheduled_tokens:
            work += 1
            running += len(so.num_scheduled_tokens)
            held += len({s.requests[q].lora_request.lora_int_id for q in so.num_scheduled_tokens if holds[q]})
        s.update_from_output(so, None)
    return steps, running / work, held / work


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
        steps, running, held = brute_force(sched, reqs, max_loras, release, monkeypatch, bundle, 24, 64)
        assert model.steps == steps
        assert model.mean_running == pytest.approx(running, rel=1e-9)
        assert model.mean_occupancy == pytest.approx(held, rel=1e-9)
        assert model.max_occupancy <= max_loras


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
    assert capacity.main(["--bundle", str(bundle), "--adapters", "8", "--rate", "5", "--requests", "50",
                          "--step-ms", "20", "--prompt-len", "5", "9", "--output-len", "3", "9"]) == 0
    for argv, msg in ((["--adapters", "8", "--rate", "5"], "--rate needs"),
                      (["--adapters", "8", "--skew", "1.5"], "--skew must"),
                      (["--adapters", "8", "--prompt-len", "9", "5"], "MIN ≤ MAX")):
        assert capacity.main(["--bundle", str(bundle), *argv]) == 2
        assert msg in capsys.readouterr().err
    assert capacity.main(["--bundle", str(tmp_path / "missing"), "--adapters", "8"]) == 2
    (tmp_path / "broken").mkdir()
    assert capacity.main(["--bundle", str(tmp_path / "broken"), "--adapters", "8"]) == 2
    assert "serve_bridge.capacity:" in capsys.readouterr().err
