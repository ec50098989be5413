"""GridTrim under tensor parallelism, simulated on CPU (TP = 2): serve_bridge/gridtrim.py's
``add_lora_linear``, ``shrink`` and ``expand``, and the punica wrapper's ``add_shrink`` /
``add_expand``.

Each rank's call gets what vLLM 0.26.0 gives it (``lora/layers/column_parallel_linear.py``,
``row_parallel_linear.py``, ``base_linear.py``; see serve_bridge/gridtrim.py's docstring): sharded
weights and activations, the same token mapping. The collectives are done here by hand
(all-gather = concatenation on the buffer's last dimension, all-reduce = sum), and the reassembled
result is checked against ``lora_kernels.reference`` on the unsharded LoRA. Inputs are fresh random
values, outputs are poisoned (NaN or random) before the calls, and rows mapped to -1 (no adapter)
and CUDA-graph padding rows must come back bit for bit.
"""
from __future__ import annotations

import importlib
import importlib.util
import logging

import pytest
import torch

from lora_kernels.reference import expand_reference, shrink_reference
from lora_kernels.worklist import RowTileWorklist
from serve_bridge import gridtrim
from tests.serve_bridge.test_gridtrim import (MAX_LORAS, MAX_TOKENS, PROGRAMS, VllmKernelMeta,
                                              _stub_vllm, _wrapper, vllm_mapping)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.float16  # the interpreter's dtype (tests/lora_kernels/test_lora_kernels.py)
TP = 2
HIDDEN, RANK = 96, 8
QKV = (40, 16, 16)  # a column-parallel layer's full slice widths, each split across the ranks
OUT = 48  # a row-parallel layer's output width
ROWS = 32  # x rows: the step's tokens plus CUDA-graph padding
GROUPS = {-1: 5, 0: 3, 2: 19, 3: 1}  # 28 tokens; adapter 1 absent, 5 rows without adapter

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="the Triton kernels need the triton package")


def _randn(*shape: int, gen: torch.Generator, scale: float = 1.0, dtype: torch.dtype = DTYPE) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)


def _step(gen: torch.Generator, groups: dict[int, int] = GROUPS):
    """One step's vLLM metadata and work list (shared by every rank), and the full mapping of the
    ROWS rows (padding rows: -1)."""
    ids = torch.cat([torch.full((n,), lora, dtype=torch.int32) for lora, n in groups.items()])
    mapping = ids[torch.randperm(ids.numel(), generator=gen)].to(DEVICE)
    meta = VllmKernelMeta(MAX_LORAS, MAX_TOKENS)
    meta.prepare(mapping)
    wl = RowTileWorklist.allocate(MAX_TOKENS, MAX_LORAS + 1, DEVICE)
    gridtrim.refresh_worklist(wl, meta.meta_args(MAX_TOKENS))
    full = torch.full((ROWS,), -1, dtype=torch.int32, device=DEVICE)
    full[: mapping.numel()] = mapping
    return meta.meta_args(ROWS), wl, full


def _a(gen: torch.Generator, rank: int = RANK, hidden: int = HIDDEN) -> torch.Tensor:
    return _randn(MAX_LORAS, 1, rank, hidden, gen=gen, scale=hidden ** -0.5)


def _b(gen: torch.Generator, out: int, rank: int = RANK) -> torch.Tensor:
    return _randn(MAX_LORAS, 1, out, rank, gen=gen, scale=rank ** -0.5)


def _shard(w: torch.Tensor, dim: int, r: int) -> torch.Tensor:
    """Rank r's shard of ``w`` along ``dim``, as its own contiguous stacked tensor (vLLM copies the
    sliced weights into per-rank stacks, base_linear.py:179-184)."""
    n = w.shape[dim] // TP
    return w.narrow(dim, r * n, n).contiguous()


def _poisoned_buffer(slices: int, rank: int, gen: torch.Generator) -> torch.Tensor:
    buf = torch.randn(slices, ROWS, rank, generator=gen).to(DEVICE)
    buf[:, ::3] = float("nan")
    return buf


def _assert_rows_kept(y: torch.Tensor, y0: torch.Tensor, rows: torch.Tensor) -> None:
    assert torch.equal(y[rows].view(torch.int16), y0[rows].view(torch.int16)), "rows without adapter changed"


def _close(got: torch.Tensor, want: torch.Tensor, atol: float = 2e-3) -> None:
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=atol)


# -- default TP paths: add_lora_linear on sharded weights ---------------------------------------------

@needs_triton
def test_column_parallel_ranks_reassemble_the_full_lora():
    """qkv-like layer: A replicated, each B slice split on its output rows
    (column_parallel_linear.py:399-420); concatenating the ranks' columns per slice is the full
    layer's LoRA output."""
    gen = torch.Generator().manual_seed(21)
    meta_args, wl, full = _step(gen)
    x = _randn(ROWS, HIDDEN, gen=gen)
    a = [_a(gen) for _ in QKV]
    b = [_b(gen, n) for n in QKV]
    y0 = _randn(ROWS, sum(QKV), gen=gen)
    y0[full < 0] = float("nan")
    cols = torch.arange(sum(QKV)).split(list(QKV))
    rank_cols = [torch.cat([c.chunk(TP)[r] for c in cols]) for r in range(TP)]  # rank r's columns of y
    y = torch.empty_like(y0)
    for r in range(TP):
        b_r = [_shard(w, 2, r) for w in b]
        y_r = y0[:, rank_cols[r]].clone()
        assert gridtrim.add_lora_linear(y_r, x, a, b_r, 0.5, tuple(n // TP for n in QKV), meta_args, wl,
                                        num_programs=PROGRAMS)
        y[:, rank_cols[r]] = y_r
    ref = expand_reference(shrink_reference(x, a, full, 0.5), b, y0, full)
    _assert_rows_kept(y, y0, full < 0)
    _close(y[full >= 0], ref[full >= 0])


@needs_triton
def test_row_parallel_rank_sum_is_the_full_lora():
    """o/down-like layer: each rank has its input columns and A's (row_parallel_linear.py:32-37), the
    full B, and adds its LoRA term to its partial output; the all-reduce (sum) of the ranks' outputs
    is the partial outputs' sum plus the full LoRA output."""
    gen = torch.Generator().manual_seed(22)
    meta_args, wl, full = _step(gen)
    x = _randn(ROWS, HIDDEN, gen=gen)
    a, b = _a(gen), _b(gen, OUT)
    total0 = torch.zeros(ROWS, OUT, device=DEVICE)
    total = torch.zeros_like(total0)
    for r in range(TP):
        x_r, a_r = _shard(x, 1, r), _shard(a, 3, r)
        y0 = _randn(ROWS, OUT, gen=gen)
        y = y0.clone()
        assert gridtrim.add_lora_linear(y, x_r, [a_r], [b], 1.0, (OUT,), meta_args, wl, num_programs=PROGRAMS)
        _assert_rows_kept(y, y0, full < 0)
        # each rank: exactly its own term (bf of its partial shrink, then B)
        _close(y[full >= 0], expand_reference(shrink_reference(x_r, [a_r], full), [b], y0, full)[full >= 0])
        total0 += y0.float()
        total += y.float()
    delta = expand_reference(shrink_reference(x, [a], full), [b], torch.zeros(ROWS, OUT, dtype=DTYPE,
                                                                              device=DEVICE), full)
    assert torch.equal(total[full < 0], total0[full < 0])
    _close(total[full >= 0], (total0 + delta.float())[full >= 0], atol=5e-3)


# -- fully_sharded_loras: add_shrink, collective, add_expand ------------------------------------------

@needs_triton
def test_fully_sharded_column_parallel_shrink_gather_expand():
    """column_parallel_linear.py:24-82 (_mcp_apply): A sliced on the rank dimension (RANK / TP rows per
    rank), shrink into the fp32 buffer, all-gather on its last dimension, expand with the rank's
    output-sliced B (full rank) at offset 0. Buffers are poisoned: shrink must write every row (0
    where there is no adapter), as the stock op's zeroing does."""
    gen = torch.Generator().manual_seed(23)
    meta_args, wl, full = _step(gen)
    x = _randn(ROWS, HIDDEN, gen=gen)
    a = [_a(gen) for _ in QKV]
    b = [_b(gen, n) for n in QKV]
    shards = []
    for r in range(TP):
        buf = _poisoned_buffer(len(QKV), RANK // TP, gen)
        assert gridtrim.shrink(buf, x, tuple(_shard(w, 2, r) for w in a), 0.5, meta_args, wl,
                               num_programs=PROGRAMS)
        shards.append(buf)
    gathered = torch.cat(shards, dim=-1)  # tensor_model_parallel_all_gather(buffers), dim=-1
    want = shrink_reference(x, a, full, 0.5)
    assert torch.equal(gathered[:, full < 0], torch.zeros_like(gathered[:, full < 0]))
    torch.testing.assert_close(gathered, want, rtol=1e-4, atol=1e-4)

    y0 = _randn(ROWS, sum(QKV), gen=gen)
    y0[full < 0] = float("nan")
    cols = torch.arange(sum(QKV)).split(list(QKV))
    y = torch.empty_like(y0)
    for r in range(TP):
        rank_cols = torch.cat([c.chunk(TP)[r] for c in cols])
        y_r = y0[:, rank_cols].clone()
        assert gridtrim.expand(y_r, gathered, tuple(_shard(w, 2, r) for w in b), tuple(n // TP for n in QKV),
                               meta_args, wl, num_programs=PROGRAMS)
        y[:, rank_cols] = y_r
    _assert_rows_kept(y, y0, full < 0)
    _close(y[full >= 0], expand_reference(want, b, y0, full)[full >= 0])


@needs_triton
def test_fully_sharded_ops_build_one_launch_config_per_layer_and_layout(monkeypatch):
    """shrink and expand build a layer's launch config once per layout of x (shrink) or y (expand),
    as add_lora_linear does, so later calls reuse its prepared launches; the same call writes the
    same bits with the cached config, and another layout gets its own."""
    from lora_kernels import expand as expand_mod
    from lora_kernels import shrink as shrink_mod

    built = {"shrink": 0, "expand": 0}
    for mod, name in ((shrink_mod, "shrink"), (expand_mod, "expand")):
        real = getattr(mod, f"{name}_config")

        def counting(*args, _real=real, _name=name, **kwargs):
            built[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(mod, f"{name}_config", counting)
    gen = torch.Generator().manual_seed(31)
    meta_args, wl, full = _step(gen)
    a, b = tuple(_a(gen) for _ in QKV), tuple(_b(gen, n) for n in QKV)
    wide = _randn(ROWS, HIDDEN + 16, gen=gen)
    x = wide[:, :HIDDEN].contiguous()
    bufs, outs = [], []
    for x_in in (x, x, wide[:, :HIDDEN]):  # the same layout twice, then a column window (another stride)
        buf = _poisoned_buffer(len(QKV), RANK, gen)
        assert gridtrim.shrink(buf, x_in, a, 0.5, meta_args, wl, num_programs=PROGRAMS)
        y = _randn(ROWS, sum(QKV), gen=gen) * 0
        assert gridtrim.expand(y, buf, b, QKV, meta_args, wl, num_programs=PROGRAMS)
        bufs.append(buf)
        outs.append(y)
    assert built == {"shrink": 2, "expand": 1}
    assert all(torch.equal(bufs[0], other) and torch.equal(outs[0], y) for other, y in zip(bufs[1:], outs[1:]))
    torch.testing.assert_close(bufs[0], shrink_reference(x, list(a), full, 0.5), rtol=1e-4, atol=1e-4)


@needs_triton
def test_fully_sharded_row_parallel_shrink_reduce_expand():
    """row_parallel_linear.py:118-159: A sliced on the input dimension (full rank), shrink, all-reduce
    of the buffer (the full shrink on every rank), expand with B sliced on its output rows at
    offset_start = rank · OUT / TP into the rank's partial output; the outputs' all-reduce is the
    partial outputs' sum plus the full LoRA output. Each rank leaves the other ranks' columns alone."""
    gen = torch.Generator().manual_seed(24)
    meta_args, wl, full = _step(gen)
    x = _randn(ROWS, HIDDEN, gen=gen)
    a, b = _a(gen), _b(gen, OUT)
    buf = torch.zeros(1, ROWS, RANK, device=DEVICE)
    for r in range(TP):
        part = _poisoned_buffer(1, RANK, gen)
        assert gridtrim.shrink(part, _shard(x, 1, r), [_shard(a, 3, r)], 1.0, meta_args, wl, num_programs=PROGRAMS)
        buf += part  # tensor_model_parallel_all_reduce(buffer)
    want = shrink_reference(x, [a], full)
    torch.testing.assert_close(buf, want, rtol=1e-4, atol=1e-4)

    width = OUT // TP
    total0 = torch.zeros(ROWS, OUT, device=DEVICE)
    total = torch.zeros_like(total0)
    for r in range(TP):
        y0 = _randn(ROWS, OUT, gen=gen)
        y = y0.clone()
        assert gridtrim.expand(y, buf, [_shard(b, 2, r)], (width,), meta_args, wl, offset_start=r * width,
                               num_programs=PROGRAMS)
        _assert_rows_kept(y, y0, full < 0)
        others = torch.ones(OUT, dtype=torch.bool)
        others[r * width:(r + 1) * width] = False
        assert torch.equal(y[:, others].view(torch.int16), y0[:, others].view(torch.int16))
        total0 += y0.float()
        total += y.float()
    delta = expand_reference(want, [b], torch.zeros(ROWS, OUT, dtype=DTYPE, device=DEVICE), full)
    assert torch.equal(total[full < 0], total0[full < 0])
    _close(total[full >= 0], (total0 + delta.float())[full >= 0], atol=5e-3)


@needs_triton
def test_shrink_over_several_hidden_chunks():
    """Inputs wider than one hidden chunk (lora_kernels/layout.py K_CHUNK) go through split-K partials that
    are summed into the buffer; a step with no adapter row zeroes the buffer (and launches nothing)."""
    from lora_kernels.layout import K_CHUNK

    gen = torch.Generator().manual_seed(25)
    hidden = K_CHUNK + 40
    meta_args, wl, full = _step(gen, {1: 4, -1: 3, 3: 2})
    x = _randn(ROWS, hidden, gen=gen)
    a = [_a(gen, hidden=hidden) for _ in range(2)]
    buf = _poisoned_buffer(2, RANK, gen)
    assert gridtrim.shrink(buf, x, a, 0.25, meta_args, wl, num_programs=PROGRAMS)
    torch.testing.assert_close(buf, shrink_reference(x, a, full, 0.25), rtol=1e-4, atol=1e-4)

    meta_args, wl, _ = _step(gen, {-1: 6})
    buf = _poisoned_buffer(2, RANK, gen)
    assert gridtrim.shrink(buf, x, a, 1.0, meta_args, wl, num_programs=PROGRAMS)
    assert int(wl.num_tiles) == 0 and torch.equal(buf, torch.zeros_like(buf))


# -- eligibility and fallbacks (no Triton) -------------------------------------------------------------

def test_shrink_and_expand_eligibility():
    x = torch.ones(6, HIDDEN, dtype=DTYPE)
    a = [torch.ones(MAX_LORAS, 1, RANK, HIDDEN, dtype=DTYPE) for _ in range(2)]
    b = [torch.ones(MAX_LORAS, 1, n, RANK, dtype=DTYPE) for n in (16, 8)]
    buf = torch.ones(2, 6, RANK)
    y = torch.ones(6, 30, dtype=DTYPE)
    assert gridtrim.shrink_ineligible_reason(buf, x, a) is None
    assert gridtrim.expand_ineligible_reason(y, buf, b, (16, 8)) is None
    assert gridtrim.expand_ineligible_reason(y, buf, b, (16, 8), offset_start=6) is None
    shrink_cases = {
        "shrink output in torch.float16": (buf.half(), x, a),
        "expected [2, 6, 8]": (torch.ones(2, 7, RANK), x, a),
        "activations in torch.float32": (buf, x.float(), [w.float() for w in a]),
        "rank 128": (torch.ones(2, 6, 128), x, [torch.ones(MAX_LORAS, 1, 128, HIDDEN, dtype=DTYPE)] * 2),
        "4 LoRA slices": (torch.ones(4, 6, RANK), x, a * 2),
    }
    for needle, args in shrink_cases.items():
        reason = gridtrim.shrink_ineligible_reason(*args)
        assert reason is not None and needle in reason, (needle, reason)
    expand_cases = {
        "expand input in torch.bfloat16": (y, buf.bfloat16(), b, (16, 8), 0),
        "differ from output_slices": (y, buf, b, (8, 16), 0),
        "the slices need": (y, buf, b, (16, 8), 7),
        "another rank": (y, torch.ones(2, 6, 4), b, (16, 8), 0),
        "output in torch.float32": (y.float(), buf, b, (16, 8), 0),
        "an output of 5 rows": (y[:5], buf, b, (16, 8), 0),
        "2 B slices and 1 output slices": (y, buf, b, (24,), 0),
    }
    for needle, args in expand_cases.items():
        reason = gridtrim.expand_ineligible_reason(*args)
        assert reason is not None and needle in reason, (needle, reason)


def test_shrink_expand_fall_back_with_one_warning_per_reason(monkeypatch, caplog):
    monkeypatch.setattr(gridtrim, "_warned", set())
    meta = VllmKernelMeta(MAX_LORAS, MAX_TOKENS)
    wl = RowTileWorklist.allocate(MAX_TOKENS, MAX_LORAS + 1, DEVICE)
    x = torch.ones(6, HIDDEN, dtype=DTYPE)
    a = (torch.ones(MAX_LORAS, 1, RANK, HIDDEN, dtype=DTYPE),)
    b = (torch.ones(MAX_LORAS, 1, 16, RANK, dtype=DTYPE),)
    with caplog.at_level(logging.WARNING, logger="vllm.lorazor.gridtrim"):
        for _ in range(3):
            assert gridtrim.shrink(torch.ones(1, 6, RANK, dtype=torch.float64), x, a, 1.0, meta.meta_args(6),
                                   wl) is False
            assert gridtrim.expand(torch.ones(6, 16, dtype=DTYPE), torch.ones(1, 6, RANK, dtype=DTYPE), b, (16,),
                                   meta.meta_args(6), wl) is False
    messages = [r.getMessage() for r in caplog.records if r.name == "vllm.lorazor.gridtrim"]
    assert len(messages) == 2, messages
    assert "add_shrink" in messages[0] and "float64" in messages[0] and "stock kernels" in messages[0]
    assert "add_expand" in messages[1] and "float16" in messages[1]


# -- the punica wrapper's add_shrink / add_expand ------------------------------------------------------

@needs_triton
def test_punica_wrapper_add_shrink_add_expand(monkeypatch):
    """The fully-sharded column-parallel call sequence on one rank through GridTrimPunicaWrapper:
    add_shrink(buffer, x, A, 1.0) and add_expand(output, buffer, B, slices, offset_start=0,
    add_input=True) as column_parallel_linear.py:57-73 makes them; ineligible calls reach the
    stock methods with the caller's arguments."""
    base = _stub_vllm(monkeypatch)
    stock = base.stock_calls

    def stock_shrink(self, y, x, lora_a_stacked, scale, **kwargs):
        stock.append(("shrink", kwargs))

    def stock_expand(self, y, x, lora_b_stacked, output_slices, offset_start=0, add_inputs=True, **kwargs):
        stock.append(("expand", offset_start, add_inputs, kwargs))

    base.add_shrink, base.add_expand = stock_shrink, stock_expand
    _, wrapper = _wrapper(monkeypatch)
    gen = torch.Generator().manual_seed(26)
    ids = torch.cat([torch.full((n,), lora, dtype=torch.int32) for lora, n in {0: 4, -1: 2, 3: 5}.items()])
    mapping = ids[torch.randperm(ids.numel(), generator=gen)]
    wrapper.update_metadata(*vllm_mapping(mapping), MAX_LORAS + 1, 1000)
    m = mapping.numel()
    x = _randn(m, HIDDEN, gen=gen)
    a = tuple(_a(gen, rank=RANK // TP) for _ in range(2))  # this rank's A shards
    b = tuple(_b(gen, n) for n in (16, 8))  # this rank's B (output shards, full rank)
    shard = torch.randn(2, m, RANK // TP, generator=gen)
    shard[:, ::2] = float("nan")
    assert wrapper.add_shrink(shard, x, a, 1.0) is None
    other = torch.randn(2, m, RANK // TP, generator=gen)  # the other rank's shard, already exact
    buf = torch.cat([shard, other], dim=-1)
    _close(shard, shrink_reference(x, a, mapping))
    y0 = _randn(m, 24, gen=gen)
    y = y0.clone()
    assert wrapper.add_expand(y, buf, b, (16, 8), offset_start=0, add_input=True) is None
    _assert_rows_kept(y, y0, mapping < 0)
    _close(y[mapping >= 0], expand_reference(buf, b, y0, mapping)[mapping >= 0])
    assert stock == []
    # ineligible: a float16 shrink buffer, a bfloat16 expand input
    wrapper.add_shrink(shard.half(), x, a, 1.0, offset_start=0)
    wrapper.add_expand(y, buf.bfloat16(), b, (16, 8), 0, False, add_input=True)
    assert stock == [("shrink", {"offset_start": 0}), ("expand", 0, False, {"add_input": True})]
