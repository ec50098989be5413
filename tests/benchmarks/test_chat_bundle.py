"""The chat benchmark's learned bundle on CPU (benchmarks/serving/chat_bundle.py): heads fit with
sklearn on synthetic hidden states, τ chosen for half the decode forwards on held-out requests, the
bundle written and read back with safetensors, and the planned release equal to StepTrim's decision."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.serving import bench, chat_bundle, synthetic
from benchmarks.serving.chat_bundle import Captured
from serve_bridge.bundle import load_bundle
from serve_bridge.steptrim import LearnedPolicy, StepTrim, skip_fraction

H = 64  # hidden size of the synthetic states
SCALE = 1e-3  # the dummy model's final-norm states are of this order (weights uniform in ±1e-3)


def hidden_states(rng: np.random.Generator, adapter: int, length: int) -> np.ndarray:
    """[length, H] states: noise, plus a direction of the adapter's that is on before the half-skip point."""
    direction = np.random.default_rng(100 + adapter).normal(size=H)
    half = chat_bundle.half_release(length)
    on = (np.arange(length) < half)[:, None]
    return ((rng.normal(size=(length, H)) + 0.8 * on * direction) * SCALE).astype(np.float32)


def requests(seed: int, adapters: int, per_adapter: int, every: int | None) -> tuple[list[Captured], list[np.ndarray]]:
    """Captured requests (h_t every ``every`` forwards; None: none) and each one's states at every forward."""
    rng = np.random.default_rng(seed)
    out, states = [], []
    for a in range(adapters):
        for _ in range(per_adapter):
            length = int(rng.integers(20, 101))
            h = hidden_states(rng, a, length)
            captured = {} if every is None else {t: h[t] for t in range(0, length, every)}
            out.append(Captured(a, length, captured, []))
            states.append(h)
    return out, states


def scored(heldout: list[Captured], states: list[np.ndarray], heads) -> list[Captured]:
    """The held-out requests scored at every forward as the calibration scorer scores them
    (StepTrim.scores, torch's float32 path off CUDA), through the benchmark's own entries."""
    policies = [chat_bundle.learned_entry(bench.adapter_name(a), "0" * 64, heads[a], 0.0, {}).to_policy()
                for a in sorted(heads)]
    st = StepTrim(policies, H)
    out = []
    for r, h in zip(heldout, states):
        s = st.scores(torch.full((r.length,), r.adapter), torch.from_numpy(h)).tolist()
        out.append(Captured(r.adapter, r.length, {}, s))
    return out


@pytest.fixture(scope="module")
def fitted():
    fit, _ = requests(0, adapters=2, per_adapter=24, every=chat_bundle.CAPTURE_EVERY)
    heads = chat_bundle.fit_adapter_heads(fit)
    held, states = requests(1, adapters=2, per_adapter=16, every=None)
    return fit, heads, scored(held, states, heads)


def test_labels_are_risky_before_the_half_skip_point():
    assert chat_bundle.half_release(21) == 10  # releases after forward 10: 10 of 20 decode forwards skipped
    assert skip_fraction([57], [chat_bundle.half_release(57)]) == pytest.approx(0.5, abs=1 / 56)
    r = Captured(0, 21, {t: np.full(3, t, np.float32) for t in (0, 8, 16)}, [])
    x, y, rid = chat_bundle.labeled_points([r, Captured(0, 40, {0: np.zeros(3, np.float32)}, [])])
    assert x.dtype == np.float32 and x[:, 0].tolist() == [0, 8, 16, 0]
    assert y.tolist() == [1, 1, 0, 1] and rid.tolist() == ["0", "0", "0", "1"]


def test_heads_fit_on_hidden_states(fitted):
    fit, heads, _ = fitted
    assert sorted(heads) == [0, 1]
    for a, head in heads.items():
        own = [r for r in fit if r.adapter == a]
        _, y, _ = chat_bundle.labeled_points(own)
        assert head.ok and head.n_requests == 24 and head.n_points == len(y) and head.positives == int(y.sum())
        x, _, _ = chat_bundle.labeled_points(own)
        s = head.scores(x)
        assert s[y == 1].mean() > s[y == 0].mean()  # risky points score higher (the logit of P(risky))


def test_tau_gives_half_the_decode_forwards_on_held_out_requests(fitted):
    _, heads, held = fitted
    fps = {bench.adapter_name(a): f"{a:064x}" for a in range(5)}
    entries, summary = chat_bundle.bundle_entries(heads, held, fps, n_adapters=5)
    assert [e.name for e in entries] == ["a00", "a01", "a02", "a03", "a04"]
    for a, e in enumerate(entries):  # adapter a serves distinct adapter a mod 2's head and tau
        d = bench.adapter_name(a % 2)
        assert e.policy == "learned" and e.weights_sha256 == fps[e.name] and e.stats["head_of"] == d
        assert e.tau == summary["adapters"][d]["tau"] and np.array_equal(e.weight, heads[a % 2].weight)
    for a in (0, 1):
        own = [r for r in held if r.adapter == a]
        skip = summary["adapters"][bench.adapter_name(a)]["heldout_skip"]
        assert skip == chat_bundle.planned_skip(entries[a], own) == pytest.approx(0.5, abs=0.03)
        # nearest the target among every threshold the held-out scores allow
        taus = np.nextafter(np.unique(np.concatenate([np.float32(r.scores) for r in own])), np.float32(np.inf))
        best = min(abs(chat_bundle.planned_skip(chat_bundle.learned_entry("x", "0" * 64, heads[a], float(t), {}), own)
                       - 0.5) for t in taus)
        assert abs(skip - 0.5) == pytest.approx(best)
    planned = skip_fraction([r.length for r in held], [chat_bundle.planned_release(entries[r.adapter], r.scores)
                                                       for r in held])
    assert summary["planned_skip"] == pytest.approx(planned) and summary["heldout_requests"] == 32


FINGERPRINTS = {bench.adapter_name(a): f"{a:064x}" for a in range(4)}


def _written(fitted, directory: Path) -> Path:
    """The fitted heads' bundle, τ chosen on the held-out requests, written to ``directory``."""
    _, heads, held = fitted
    entries, _ = chat_bundle.bundle_entries(heads, held, FINGERPRINTS, n_adapters=4)
    return chat_bundle.write_learned_bundle(directory, entries, synthetic.LLAMA32_3B | {"hidden_size": H})


def test_the_bundle_reads_back_and_releases_where_planned(fitted, tmp_path):
    held, fps = fitted[2], FINGERPRINTS
    bundle = load_bundle(_written(fitted, tmp_path / "learned"), expected_hidden_size=H, known_adapters=list(fps))
    assert sorted(bundle.adapters) == list(fps) and all(isinstance(p, LearnedPolicy) for p in bundle.policies.values())
    st = StepTrim([bundle.policies[n] for n in fps], H)
    _, states = requests(1, adapters=2, per_adapter=16, every=None)
    for r, h in list(zip(held, states))[::5]:  # the first forward StepTrim fires at, plus the lag, is the plan
        slots = torch.full((r.length,), r.adapter)
        fire = st.fires(slots, torch.zeros(r.length, dtype=torch.long), torch.from_numpy(h)).tolist()
        release = st.release_point(r.adapter, fire.index(True)) if True in fire else None
        entry = bundle.adapters[bench.adapter_name(r.adapter)]
        assert entry.lag == chat_bundle.LAG == 1 and release == chat_bundle.planned_release(entry, r.scores)


def test_a_lag_variant_keeps_heads_and_thresholds_and_moves_each_release_by_the_lag(fitted, tmp_path):
    held, source = fitted[2], _written(fitted, tmp_path / "learned")
    variant = load_bundle(chat_bundle.with_lag(source, 0, tmp_path / "lag0"))
    original = load_bundle(source)
    assert variant.hidden_size == original.hidden_size and variant.config_fingerprint == original.config_fingerprint
    for name, e in original.adapters.items():
        v = variant.adapters[name]
        assert (v.lag, e.lag) == (0, 1) and v.tau == e.tau and v.bias == e.bias and v.weights_sha256 == e.weights_sha256
        assert np.array_equal(v.weight, e.weight)
    moved = [(chat_bundle.planned_release(variant.adapters[bench.adapter_name(r.adapter)], r.scores),
              chat_bundle.planned_release(original.adapters[bench.adapter_name(r.adapter)], r.scores)) for r in held]
    assert all(a is b is None or a + 1 == b for a, b in moved) and any(a is not None for a, _ in moved)


def test_one_constructor_for_learned_entries_and_policies():
    """Every learned entry and policy of the chat benchmark comes from learned_entry (one line to change
    for a field such as a decision lag)."""
    sources = {p: p.read_text() for p in Path(chat_bundle.__file__).parent.glob("chat*.py")}
    built = {p.name: len(re.findall(r"\b(AdapterEntry|LearnedPolicy)\(", s)) for p, s in sources.items()}
    assert built == {"chat.py": 0, "chat_bundle.py": 1, "chat_workload.py": 0}
