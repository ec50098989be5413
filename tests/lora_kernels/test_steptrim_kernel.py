"""StepTrim's fused decision kernel (lora_kernels/steptrim.py) against StepTrim's torch path, on
fresh random inputs: on the GPU when there is one (plus the serving launcher's pinned,
graph-replayed buffers), else in Triton's interpreter."""
from __future__ import annotations

import pytest
import torch

from lora_kernels.steptrim import COLUMNS, check_hidden, hidden_source, launch_steptrim
from serve_bridge.decision import DecisionLauncher
from serve_bridge import steptrim as steptrim_module
from serve_bridge.steptrim import NO_SLOT, LearnedPolicy, ProfiledPolicy, StepTrim

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _policies(gen: torch.Generator, n: int, hidden: int) -> list:
    """Learned, profiled and None slots; learned τ near the scores' median so both outcomes occur."""
    out = []
    for i in range(n):
        if i % 3 == 0:
            out.append(LearnedPolicy(torch.randn(hidden, generator=gen), float(torch.randn(1, generator=gen)),
                                     float(torch.randn(1, generator=gen)) * 3))
        else:
            out.append(ProfiledPolicy(i % 5) if i % 3 == 1 else None)
    return out


@pytest.mark.parametrize("hidden_size,dtype", [(24, torch.float32), (576, torch.bfloat16),
                                               (1500, torch.float16), (3072, torch.bfloat16)])
def test_kernel_matches_torch_path(gen: torch.Generator, hidden_size: int, dtype: torch.dtype) -> None:
    """Scores within float32 rounding of torch's; fires exactly (t ≥ k) | (s < τ) with the
    kernel's own s; slot −1 rows never fire; hidden rows gathered by index, any row stride."""
    n, rows_total, m = 7, 40, 29
    policies = _policies(gen, n, hidden_size)
    ref = StepTrim(policies, hidden_size)
    ker = StepTrim(policies, hidden_size, DEVICE, kernel=True)
    assert not ref.kernel and ker.kernel
    wide = torch.randn(rows_total, hidden_size + 5, generator=gen).to(DEVICE, dtype)
    hidden = wide[:, 2:2 + hidden_size]  # a row stride wider than the row
    rows = torch.randint(0, rows_total, (m,), generator=gen)
    slots = torch.randint(-1, n, (m,), generator=gen)
    slots[:3] = NO_SLOT
    t = torch.randint(0, 7, (m,), generator=gen)
    meta = torch.stack([rows, slots, t]).to(DEVICE)
    score = torch.full((m,), float("nan"), device=DEVICE)
    fire = torch.randint(0, 2, (m,), generator=gen).bool().to(DEVICE)  # poisoned: every element is written
    launch_steptrim(meta, hidden_source(hidden), dtype, ker.table, True, score, fire)
    score, fire, hidden = score.cpu(), fire.cpu(), hidden.cpu()
    want = ref.scores(slots.clamp(min=0), hidden[rows])  # slot -1 scored below separately
    learned = torch.tensor([s >= 0 and isinstance(policies[s], LearnedPolicy) for s in slots.tolist()])
    torch.testing.assert_close(score[learned], want[learned], rtol=1e-5, atol=1e-4 * hidden_size ** 0.5)
    assert torch.equal(score[~learned], torch.zeros(int((~learned).sum())))  # w = 0, b = 0 there
    params = ref.table[torch.where(slots < 0, n, slots)]
    assert torch.equal(fire, (t.float() >= params[:, 0]) | (score < params[:, 1]))
    assert not fire[:3].any()
    near = (want - params[:, 1]).abs() < 1e-3  # only rows within rounding of τ may decide otherwise
    assert torch.equal(fire[~near], ref.fires(slots, t, hidden[rows])[~near])


def test_a_rows_score_does_not_depend_on_the_launch(gen: torch.Generator) -> None:
    """One row scored alone, in a small batch or in a large one: the same bits (batch invariance),
    through scores(), fires() and fires_into() alike."""
    hidden_size, n = 1100, 5
    st = StepTrim(_policies(gen, n, hidden_size), hidden_size, DEVICE, kernel=True)
    hidden = torch.randn(64, hidden_size, generator=gen).to(DEVICE, torch.bfloat16)
    slots = torch.full((64,), 3, device=DEVICE)  # a learned slot
    full = st.scores(slots, hidden)
    for lo, hi in ((0, 1), (5, 13), (17, 64)):
        assert torch.equal(st.scores(slots[lo:hi], hidden[lo:hi]), full[lo:hi])
    tau = st.table[3, 1]
    t = torch.zeros(64, dtype=torch.long, device=DEVICE)
    assert torch.equal(st.fires(slots, t, hidden), full < tau)
    assert torch.equal(st.step(slots, t, torch.zeros(64, dtype=torch.bool, device=DEVICE), hidden), full < tau)
    rows = torch.tensor([9, 2, 40, 2], device=DEVICE)
    meta = torch.stack([rows, slots[:4], t[:4]])
    score = torch.empty(4, device=DEVICE)
    fire = torch.empty(4, dtype=torch.bool, device=DEVICE)
    st.fires_into(meta, hidden_source(hidden), hidden.dtype, score, fire)
    assert torch.equal(score, full[rows]) and torch.equal(fire, full[rows] < tau)


def test_float32_and_bf16_hidden_give_the_same_scores(gen: torch.Generator) -> None:
    """bf16 rows and the same rows as float32 multiply the same float32 values (the hf engine
    scores float32 copies, serving the model's bf16 rows)."""
    hidden_size = 700
    st = StepTrim(_policies(gen, 3, hidden_size), hidden_size, DEVICE, kernel=True)
    h = torch.randn(9, hidden_size, generator=gen).to(DEVICE, torch.bfloat16)
    slots = torch.zeros(9, dtype=torch.long, device=DEVICE)
    torch.testing.assert_close(st.scores(slots, h), st.scores(slots, h.float()), rtol=0, atol=0)


def test_profiled_only_and_empty_launches(gen: torch.Generator) -> None:
    st = StepTrim([ProfiledPolicy(2), None], 16, DEVICE, kernel=True)
    t = torch.tensor([0, 1, 2, 3, 9, 0], device=DEVICE)
    slots = torch.tensor([0, 0, 0, 0, 1, NO_SLOT], device=DEVICE)
    assert st.fires(slots, t).tolist() == [False, False, True, True, False, False]
    assert st.scores(slots, torch.randn(6, 16, generator=gen).to(DEVICE)).tolist() == [0.0] * 6
    empty = torch.zeros(3, 0, dtype=torch.int64, device=DEVICE)
    launch_steptrim(empty, empty, torch.float32, st.table, False, torch.empty(0, device=DEVICE),
                    torch.empty(0, dtype=torch.bool, device=DEVICE))


def test_kernel_reads_steptrims_table_layout() -> None:
    """The kernel reads k, τ, b at columns 0, 1, 2 and w from column COLUMNS on: StepTrim's layout."""
    m = steptrim_module
    assert (m._K, m._TAU, m._B, m._W) == (0, 1, 2, COLUMNS)


def test_bad_inputs_are_refused(gen: torch.Generator) -> None:
    with pytest.raises(ValueError, match="2-D float32/bfloat16/float16"):
        check_hidden(torch.randn(4, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="unit column stride"):
        hidden_source(torch.randn(8, 4, generator=gen).T)
    st = StepTrim([ProfiledPolicy(1)], 4, kernel=True)
    with pytest.raises(ValueError, match="contiguous int64"):
        launch_steptrim(torch.zeros(3, 4, dtype=torch.int32), torch.zeros(2, dtype=torch.int64), torch.float32,
                        st.table, False, torch.empty(4), torch.empty(4, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="kernel=False"):
        StepTrim([ProfiledPolicy(1)], 4).fires_into(None, None, torch.float32, None, None)


@pytest.mark.skipif(DEVICE != "cuda", reason="pinned buffers and CUDA graphs need a GPU")
@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_serving_launcher_matches_steptrim_bit_for_bit(gen: torch.Generator, cuda_graphs: bool) -> None:
    """The runtime's launcher (pinned inputs and result read/written by the kernel, the hidden
    states' address as data, graph replays) against StepTrim on the same device: fired rows and
    scores identical, across buckets, dtypes and hidden tensors at new addresses every step; the
    result read ahead of the launch order (``unread``) too."""
    hidden_size, n = 3072, 9
    policies = _policies(gen, n, hidden_size)
    launcher = DecisionLauncher(StepTrim(policies, hidden_size, "cuda"), max_rows=32, cuda_graphs=cuda_graphs)
    same = StepTrim(policies, hidden_size, "cuda")
    outcomes = set()
    for total, m, dtype in ((40, 33, torch.bfloat16), (5, 2, torch.bfloat16), (300, 256, torch.float16),
                            (9, 9, torch.bfloat16), (64, 1, torch.float32)):
        hidden = torch.randn(total, hidden_size, generator=gen).to("cuda", dtype)
        rows = sorted(torch.randperm(total, generator=gen)[:m].tolist())
        slots = torch.randint(0, n, (m,), generator=gen)
        t = torch.randint(0, 7, (m,), generator=gen)
        launcher.launch(rows, slots.tolist(), t.tolist(), hidden)
        (ahead,) = (u.fired() for u in launcher.unread())  # waits for the launch's own event
        fired, gpu_ms = launcher.result()
        assert gpu_ms is not None and gpu_ms > 0
        h = hidden[torch.tensor(rows, device="cuda")]
        want = same.fires(slots.cuda(), t.cuda(), h).cpu().numpy()
        assert (fired == want).all() and (ahead == want).all()
        outcomes |= set(want.tolist())
        assert torch.equal(launcher.last_scores(), same.scores(slots.cuda(), h))
    assert outcomes == {True, False}  # both outcomes were compared
    assert launcher.mode == ("cuda-graph" if cuda_graphs else "cuda-eager")


@pytest.mark.skipif(DEVICE != "cuda", reason="pinned buffers and CUDA graphs need a GPU")
@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_launcher_warm_up_prepares_buckets_and_decides_nothing(gen: torch.Generator, cuda_graphs: bool) -> None:
    """warm_up (vLLM's dummy batch at start-up) captures a graph per bucket for the dummy's dtype,
    leaves every bucket's rows as padding, may repeat, and the decisions after it are StepTrim's;
    after a decision it is refused."""
    hidden_size, n = 576, 6
    policies = _policies(gen, n, hidden_size)
    launcher = DecisionLauncher(StepTrim(policies, hidden_size, "cuda"), max_rows=32, cuda_graphs=cuda_graphs)
    dummy = torch.randn(32, hidden_size, generator=gen).to("cuda", torch.bfloat16)
    assert launcher.warm_up(dummy) == 3 and launcher.warm_up(dummy[:5]) == 3  # buckets 8, 16, 32
    for b in (b for lane in launcher._lanes for b in lane.buckets.values()):
        assert list(b.graphs) == ([torch.bfloat16] if cuda_graphs else [])
        assert b.filled == 0 and (b.meta_np[1] == NO_SLOT).all() and (b.meta_np[0] == 0).all()
    same = StepTrim(policies, hidden_size, "cuda")
    hidden = torch.randn(20, hidden_size, generator=gen).to("cuda", torch.bfloat16)
    rows = list(range(0, 20, 2))
    slots = torch.randint(0, n, (len(rows),), generator=gen)
    t = torch.randint(0, 7, (len(rows),), generator=gen)
    launcher.launch(rows, slots.tolist(), t.tolist(), hidden)
    fired, _ = launcher.result()
    h = hidden[torch.tensor(rows, device="cuda")]
    assert (fired == same.fires(slots.cuda(), t.cuda(), h).cpu().numpy()).all()
    assert torch.equal(launcher.last_scores(), same.scores(slots.cuda(), h))
    with pytest.raises(RuntimeError, match="before the first decision"):
        launcher.warm_up(dummy)
