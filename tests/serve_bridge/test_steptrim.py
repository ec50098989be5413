"""StepTrim (packed per-slot table, few ops) against a per-row Python reference of docs/design.md §2,
and the decision launcher that the serving runtime drives."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from serve_bridge.decision import MIN_BUCKET, DecisionLauncher, bucket_size
from serve_bridge.steptrim import NO_SLOT, LearnedPolicy, ProfiledPolicy, StepTrim

H = 24


def _policies(g: torch.Generator, n: int) -> list:
    """A mix of profiled (k 0–5), learned and None slots."""
    out = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            out.append(ProfiledPolicy(int(torch.randint(0, 6, (1,), generator=g))))
        elif kind == 1:
            out.append(LearnedPolicy(torch.randn(H, generator=g), float(torch.randn(1, generator=g)),
                                     float(torch.randn(1, generator=g))))
        else:
            out.append(None)
    return out


def _row_score(p: LearnedPolicy, h: torch.Tensor) -> float:
    """s for one row alone, float32: Σ h·w then + b."""
    return float((h.float() * p.weight.float()).sum() + torch.tensor(p.bias, dtype=torch.float32))


def _reference(policies, slots, t, released, hidden) -> list[bool]:
    """docs/design.md §2 per row: released stays released; NO_SLOT / None never; profiled t ≥ k;
    learned s_t < τ (s in float32)."""
    out = []
    for i, slot in enumerate(slots.tolist()):
        p = None if slot == NO_SLOT else policies[slot]
        fire = False
        if isinstance(p, ProfiledPolicy):
            fire = int(t[i]) >= p.k
        elif isinstance(p, LearnedPolicy):
            fire = np.float32(_row_score(p, hidden[i])) < np.float32(p.tau)
        out.append(bool(released[i]) or fire)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_step_matches_per_row_reference(seed):
    g = torch.Generator().manual_seed(seed)
    n, R = 7, 97
    policies = _policies(g, n)
    hidden = torch.randn(R, H, generator=g)
    slots = torch.randint(-1, n, (R,), generator=g)  # -1 = NO_SLOT
    t = torch.randint(0, 8, (R,), generator=g)  # around the k's
    released = torch.rand(R, generator=g) < 0.2
    # scores right at τ: move some learned slots' τ onto a row's exact score, or one ulp off it
    for j, slot in enumerate(slots.tolist()[:30]):
        p = policies[slot] if slot != NO_SLOT else None
        if isinstance(p, LearnedPolicy):
            s = np.float32(_row_score(p, hidden[j]))
            tau = float([s, np.nextafter(s, np.float32(np.inf)), np.nextafter(s, np.float32(-np.inf))][j % 3])
            policies[slot] = LearnedPolicy(p.weight, p.bias, tau)
    st = StepTrim(policies, H)
    ref = _reference(policies, slots, t, released, hidden)
    got = st.step(slots, t, released, hidden)
    assert got.dtype == torch.bool and got.tolist() == ref
    assert st.fires(slots, t, hidden).tolist() == _reference(policies, slots, t, torch.zeros(R, dtype=torch.bool),
                                                             hidden)
    # the profiled rule the serving runtime applies on the host is the table's
    host = [policies[i].fires(int(ti)) for i, ti in zip(slots.tolist(), t.tolist())
            if i != NO_SLOT and isinstance(policies[i], ProfiledPolicy)]
    table = [f for i, f in zip(slots.tolist(), st.fires(slots, t, hidden).tolist())
             if i != NO_SLOT and isinstance(policies[i], ProfiledPolicy)]
    assert host == table and any(host) and not all(host)
    # bf16 hidden (vLLM): the same decisions as on its exact float32 values
    hb = hidden.to(torch.bfloat16)
    assert st.step(slots, t, released, hb).tolist() == _reference(policies, slots, t, released, hb.float())


def test_scores_are_the_former_formula_bit_for_bit():
    """scores() = (h.float() * w[slot]).sum(-1) + b[slot], the formula the sweep recorded with,
    exactly; per-row (batch of one) results agree too; non-learned slots score 0."""
    g = torch.Generator().manual_seed(3)
    n, R, Hs = 9, 64, 576
    policies = [LearnedPolicy(torch.randn(Hs, generator=g) / 24, 0.1 * i, 0.0) if i % 2 else
                (ProfiledPolicy(i) if i % 4 == 0 else None) for i in range(n)]
    st = StepTrim(policies, Hs)
    slots = torch.randint(-1, n, (R,), generator=g)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        h = torch.randn(R, Hs, generator=g).to(dtype)
        w = torch.stack([p.weight.float() if isinstance(p, LearnedPolicy) else torch.zeros(Hs) for p in policies]
                        + [torch.zeros(Hs)])
        b = torch.tensor([p.bias if isinstance(p, LearnedPolicy) else 0.0 for p in policies] + [0.0])
        idx = torch.where(slots < 0, torch.full_like(slots, n), slots)
        former = (h.float() * w[idx]).sum(-1) + b[idx]
        s = st.scores(slots, h)
        assert s.dtype == torch.float32 and torch.equal(s, former)
        assert torch.equal(torch.cat([st.scores(slots[i:i + 1], h[i:i + 1]) for i in range(R)]), s)
        learned = torch.tensor([s_ != NO_SLOT and isinstance(policies[s_], LearnedPolicy) for s_ in slots.tolist()])
        assert (s[~learned] == 0).all()
    assert torch.equal(StepTrim([ProfiledPolicy(1), None], 4).scores(torch.tensor([0, -1]), torch.ones(2, 4)),
                       torch.zeros(2))


def test_no_slot_is_the_last_table_row_and_never_fires():
    """torch indexing wraps −1 to the last row, which holds the never-firing parameters."""
    st = StepTrim([ProfiledPolicy(0), LearnedPolicy(torch.ones(2), 0.0, 1e30)], 2)
    assert torch.equal(st.table[torch.tensor([NO_SLOT])], st.table[-1:])
    assert st.table[-1, 0] == float("inf") and st.table[-1, 1] == float("-inf") and (st.table[-1, 2:] == 0).all()
    slots = torch.tensor([NO_SLOT, 0, 1, NO_SLOT])
    t = torch.tensor([10**6, 0, 0, 0])
    h = torch.tensor([[-1e30, -1e30], [0.0, 0.0], [1.0, 1.0], [float("nan"), 0.0]])
    assert st.fires(slots, t, h).tolist() == [False, True, True, False]


def test_edge_cases():
    st = StepTrim([ProfiledPolicy(3)], 4)
    assert not st.needs_hidden and st.table.shape == (2, 3)  # no weight columns without a learned policy
    assert st.step(torch.tensor([0, 0, 0]), torch.tensor([2, 3, 2**30]), torch.tensor([True, False, False])).tolist() \
        == [True, True, True]
    none = torch.zeros(0, dtype=torch.long)
    empty = st.step(none, none, torch.zeros(0, dtype=torch.bool))
    assert empty.shape == (0,)
    learned = StepTrim([LearnedPolicy(torch.ones(4), 0.0, 0.0)], 4)
    with pytest.raises(ValueError, match="needs the final hidden states"):
        learned.step(torch.tensor([0]), torch.tensor([0]), torch.tensor([False]))
    with pytest.raises(ValueError, match=r"head weight shape \(3,\) != \(4,\)"):
        StepTrim([LearnedPolicy(torch.ones(3), 0.0, 0.0)], 4)
    with pytest.raises(ValueError, match="2\\*\\*24"):
        StepTrim([ProfiledPolicy(1 << 24)], 4)
    with pytest.raises(TypeError, match="unsupported policy"):
        StepTrim(["k=3"], 4)
    assert learned.to("cpu") is learned


@pytest.mark.parametrize("learned", [True, False])
def test_launcher_matches_steptrim_across_buckets(learned):
    """Each launch equals StepTrim.fires on the selected rows, whatever the bucket and whatever
    a previous, larger launch left in the buffers."""
    g = torch.Generator().manual_seed(5 + learned)
    n = 6
    policies = _policies(g, n) if learned else [ProfiledPolicy(i) for i in range(n)]
    st = StepTrim(policies, H)
    launcher = DecisionLauncher(st, max_rows=16)
    buckets = launcher._lanes[0].buckets
    assert launcher.mode == "cpu" and sorted(buckets) == [8, 16]
    for total, m in [(40, 33), (5, 2), (40, 40), (9, 9), (70, 1), (3, 3)]:
        hidden = torch.randn(total, H, generator=g)
        rows = sorted(torch.randperm(total, generator=g)[:m].tolist())
        slots = torch.randint(0, n, (m,), generator=g)
        t = torch.randint(0, 8, (m,), generator=g)
        launcher.launch(rows, slots.tolist(), t.tolist(), hidden if learned else None)
        with pytest.raises(RuntimeError, match="unread"):
            launcher.launch(rows, slots.tolist(), t.tolist(), hidden)
        fired, gpu_ms = launcher.result()
        assert gpu_ms is None and fired.dtype == np.bool_ and fired.shape == (m,)
        assert fired.tolist() == st.fires(slots, t, hidden[rows]).tolist()
        b = buckets[bucket_size(m)]
        assert (b.meta_np[1, m:] == NO_SLOT).all() and (b.meta_np[0, m:] == 0).all()  # padding restored
    assert sorted(buckets) == [8, 16, 64]  # grown on demand
    with pytest.raises(RuntimeError, match="nothing was launched"):
        launcher.result()


def test_launches_in_flight_are_read_oldest_first():
    """With depth 2 two launches may be unread, each in its own lane (its own input buffers), and
    results come back in launch order; a third launch waits for a read. The unread launches
    can be read ahead (Launched) without changing that order."""
    g = torch.Generator().manual_seed(21)
    st = StepTrim(_policies(g, 4), H)
    launcher = DecisionLauncher(st, max_rows=16, depth=2)
    hidden = [torch.randn(10, H, generator=g) for _ in range(3)]
    calls = [([0, 3, 5], [0, 1, 2], [1, 2, 3]), ([1, 2, 4, 9], [3, 3, 0, 1], [0, 5, 6, 2]), ([7], [2], [4])]
    expect = [st.fires(torch.tensor(s), torch.tensor(t), h[r]).tolist() for (r, s, t), h in zip(calls, hidden)]
    launcher.launch(*calls[0], hidden[0])
    launcher.launch(*calls[1], hidden[1])
    assert launcher.in_flight == 2
    with pytest.raises(RuntimeError, match="2 decisions are unread"):
        launcher.launch(*calls[2], hidden[2])
    ahead = launcher.unread()
    assert [u.fired().tolist() for u in ahead] == expect[:2]  # read ahead, without reading them
    assert launcher.in_flight == 2
    assert launcher.result()[0].tolist() == expect[0]
    assert ahead[1].fired().tolist() == expect[1]  # a copy each time, until its lane's next launch
    launcher.launch(*calls[2], hidden[2])  # reuses the first lane, whose result was read
    assert [u.fired().tolist() for u in launcher.unread()] == expect[1:]
    assert [launcher.result()[0].tolist() for _ in range(2)] == expect[1:]
    assert launcher.unread() == []
    with pytest.raises(ValueError, match="depth must be"):
        DecisionLauncher(st, depth=0)


def test_bucket_sizes():
    assert [bucket_size(n) for n in (0, 1, 8, 9, 16, 17, 256, 257)] == [MIN_BUCKET, 8, 8, 16, 16, 32, 256, 512]


def test_warm_up_off_cuda_compiles_nothing_and_keeps_decisions():
    """Off CUDA there is no kernel or graph to prepare: warm_up reports 0 buckets, at any time."""
    g = torch.Generator().manual_seed(11)
    st = StepTrim(_policies(g, 4), H)
    launcher = DecisionLauncher(st, max_rows=16)
    hidden = torch.randn(12, H, generator=g)
    assert launcher.warm_up(hidden) == 0
    slots, t = torch.tensor([0, 1, 2, 3]), torch.tensor([0, 3, 5, 1])
    launcher.launch([1, 4, 7, 9], slots.tolist(), t.tolist(), hidden)
    assert launcher.result()[0].tolist() == st.fires(slots, t, hidden[[1, 4, 7, 9]]).tolist()
    assert launcher.warm_up(hidden) == 0


def test_profiled_only_launcher_decides_on_the_host():
    """Without a learned policy no hidden state is needed: StepTrim runs on a CPU copy."""
    st = StepTrim([ProfiledPolicy(1)], 4)
    launcher = DecisionLauncher(st)
    assert launcher.steptrim.device.type == "cpu" and launcher.mode == "cpu"
    launcher.launch([0, 1], [0, 0], [0, 1], None)
    assert launcher.result()[0].tolist() == [False, True]
