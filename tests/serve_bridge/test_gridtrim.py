"""GridTrim behind vLLM's punica contract (serve_bridge/gridtrim.py, serve_bridge/vllm/punica_wrapper.py).

The kernels run in Triton's interpreter on CPU (fp16 only there, see tests/lora_kernels/
test_lora_kernels.py). The metadata is built here the way vLLM 0.26's ``LoRAKernelMeta`` builds it
(static buffers reused across steps, ``lora/ops/triton_ops/lora_kernel_metadata.py:102-205``),
independently of ``lora_kernels.metadata``; the oracle is ``lora_kernels.reference``.
"""
from __future__ import annotations

import bisect
import importlib
import importlib.util
import logging
import sys
from types import ModuleType, SimpleNamespace

import pytest
import torch

from lora_kernels.metadata import LoRABatchMeta
from lora_kernels.reference import expand_reference, shrink_reference
from lora_kernels.worklist import RowTileWorklist
from serve_bridge import gridtrim

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.float16
PROGRAMS = 3  # persistent grid smaller than the work: programs stride over items
MAX_LORAS, MAX_TOKENS = 4, 48
HIDDEN, RANK, WIDTHS = 80, 8, (40, 16, 16)  # qkv-like: q wider than k and v


class VllmKernelMeta:
    """vLLM's LoRAKernelMeta contract (``make``, ``prepare_tensors``, ``meta_args``), restated for
    the tests: static buffers of max_tokens / max_loras + 1 (+2) entries; each step resets the slot
    arrays, and a batch without adapter rows stops there; otherwise the mapping and its stable sort
    are written to the front of the buffers, and the unique ids (sorted, -1 first when present) with
    their counts and the start offsets to the slot arrays, the id count rounded up to a captured one
    (:153-159). Entries past the batch keep stale values."""

    def __init__(self, max_loras: int, max_tokens: int, captured_lora_counts: list[int] | None = None) -> None:
        def stale(n: int) -> torch.Tensor:
            return torch.full((n,), 9999, dtype=torch.int32, device=DEVICE)

        self.token_lora_mapping, self.token_indices_sorted_by_lora_ids = stale(max_tokens), stale(max_tokens)
        self.active_lora_ids, self.num_tokens_per_lora = stale(max_loras + 1), stale(max_loras + 1)
        self.lora_token_start_loc = stale(max_loras + 2)
        self.no_lora_flag_cpu = torch.tensor([False])
        self.num_active_loras_cpu = torch.tensor([9999], dtype=torch.int32)
        self.default_num_active_loras_cpu = torch.tensor([max_loras + 1], dtype=torch.int32)
        self.captured_lora_counts = sorted(captured_lora_counts or [])

    def prepare(self, mapping: torch.Tensor) -> None:
        self.active_lora_ids.fill_(-1)
        self.num_tokens_per_lora.fill_(0)
        self.lora_token_start_loc.fill_(0)
        self.num_active_loras_cpu[0] = 0
        self.no_lora_flag_cpu[0] = bool((mapping == -1).all())
        if self.no_lora_flag_cpu[0]:
            return
        n = mapping.numel()
        self.token_lora_mapping[:n] = mapping
        self.token_indices_sorted_by_lora_ids[:n] = torch.sort(mapping, stable=True).indices.to(torch.int32)
        ids, counts = torch.unique(mapping, sorted=True, return_counts=True)
        self.active_lora_ids[: ids.numel()] = ids
        self.num_tokens_per_lora[: ids.numel()] = counts.to(torch.int32)
        self.lora_token_start_loc[1: 1 + ids.numel()] = torch.cumsum(counts, 0).to(torch.int32)
        at = bisect.bisect_left(self.captured_lora_counts, ids.numel())
        self.num_active_loras_cpu[0] = (self.captured_lora_counts[at] if at < len(self.captured_lora_counts)
                                        else ids.numel())

    def meta_args(self, token_nums: int, specialize: bool = False) -> tuple[torch.Tensor, ...]:
        return (self.token_lora_mapping[:token_nums], self.token_indices_sorted_by_lora_ids[:token_nums],
                self.num_tokens_per_lora, self.lora_token_start_loc, self.active_lora_ids, self.no_lora_flag_cpu,
                self.num_active_loras_cpu if specialize else self.default_num_active_loras_cpu)


# Slot s of the tests' adapter manager holds adapter id LORA_INDEX_TO_ID[s] (vLLM's lora_index_to_id).
LORA_INDEX_TO_ID = [100 + 7 * s for s in range(MAX_LORAS)]


def vllm_mapping(tokens: torch.Tensor, sampled: torch.Tensor | None = None) -> tuple[SimpleNamespace, list[int]]:
    """(a LoRAMapping, lora_index_to_id) for slot indices per token and per sampled row (-1 = none;
    default: the tokens), as ``update_metadata`` receives them (``lora/layers/utils.py:33-42``: adapter
    ids, 0 for none)."""
    def ids(slots: torch.Tensor) -> tuple[int, ...]:
        return tuple(0 if s < 0 else LORA_INDEX_TO_ID[s] for s in slots.tolist())
    mapping = SimpleNamespace(index_mapping=ids(tokens), prompt_mapping=ids(tokens if sampled is None else sampled),
                              is_prefill=False)
    return mapping, LORA_INDEX_TO_ID


def _mapping(groups: dict[int, int], gen: torch.Generator) -> torch.Tensor:
    ids = torch.cat([torch.full((n,), lora, dtype=torch.int32) for lora, n in groups.items()])
    return ids[torch.randperm(ids.numel(), generator=gen)].to(DEVICE)


def _weights(gen: torch.Generator) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """vLLM's stacked layout: A [max_loras, 1, rank, hidden], B [max_loras, 1, out, rank]."""
    a = [(torch.randn(MAX_LORAS, 1, RANK, HIDDEN, generator=gen) * HIDDEN ** -0.5).to(DEVICE, DTYPE)
         for _ in WIDTHS]
    b = [(torch.randn(MAX_LORAS, 1, n, RANK, generator=gen) * RANK ** -0.5).to(DEVICE, DTYPE) for n in WIDTHS]
    return a, b


def _poisoned_output(rows: int, mapping: torch.Tensor, add_inputs: bool, gen: torch.Generator) -> torch.Tensor:
    """NaN wherever the op must not read: everywhere without add_inputs; with add_inputs, rows that
    have no adapter or are CUDA-graph padding (those must come back bit-identical)."""
    y = torch.randn(rows, sum(WIDTHS), generator=gen).to(DEVICE, DTYPE)
    mapped = torch.zeros(rows, dtype=torch.bool, device=DEVICE)
    mapped[: mapping.numel()] = mapping >= 0
    y[~mapped if add_inputs else slice(None)] = float("nan")
    return y


def _check(y: torch.Tensor, y0: torch.Tensor, x: torch.Tensor, a, b, mapping: torch.Tensor, scale: float,
           add_inputs: bool) -> None:
    full = torch.full((x.shape[0],), -1, dtype=torch.int32, device=DEVICE)
    full[: mapping.numel()] = mapping  # padding rows: no adapter
    ref = expand_reference(shrink_reference(x, a, full, scale), b, y0, full, add_inputs=add_inputs)
    mapped = full >= 0
    # rows without an adapter and padding rows: bit for bit what was there (NaN included)
    assert torch.equal(y[~mapped].view(torch.int16), y0[~mapped].view(torch.int16))
    assert torch.isfinite(y[mapped]).all(), "every column of every adapter row is written"
    if mapped.any():
        torch.testing.assert_close(y[mapped].float(), ref[mapped].float(), rtol=2e-2, atol=2e-3)


# -- eligibility (no Triton) ------------------------------------------------------------------------

def _layer(dtype=DTYPE, slices=3, rank=RANK, widths=None, **over):
    widths = list(widths or WIDTHS[:slices])
    a = [torch.ones(MAX_LORAS, 1, rank, HIDDEN, dtype=dtype) for _ in widths]
    b = [torch.ones(MAX_LORAS, 1, n, rank, dtype=dtype) for n in widths]
    args = dict(y=torch.ones(6, sum(widths), dtype=dtype), x=torch.ones(6, HIDDEN, dtype=dtype), lora_a=a,
                lora_b=b, output_slices=tuple(widths))
    args.update(over)
    return args


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("slices", [1, 2, 3])
def test_eligible_layers(dtype, slices):
    assert gridtrim.ineligible_reason(**_layer(dtype, slices)) is None
    assert gridtrim.ineligible_reason(**_layer(dtype, slices, rank=64)) is None


def test_ineligible_layers_name_the_reason():
    base = _layer()
    cases = {
        "float32": _layer(torch.float32),
        "4 LoRA slices": _layer(widths=(16, 16, 16, 16)),
        "rank 128": _layer(rank=128),
        "one dtype": {**base, "lora_b": [w.bfloat16() for w in base["lora_b"]]},
        "A slices of different shapes": {**base, "lora_a": base["lora_a"][:2]
                                         + [torch.ones(MAX_LORAS, 1, RANK, HIDDEN + 8, dtype=DTYPE)]},
        "differ from output_slices": {**base, "output_slices": (16, 40, 16)},
        "the slices need": {**base, "y": torch.ones(6, 50, dtype=DTYPE)},
    }
    for needle, layer in cases.items():
        reason = gridtrim.ineligible_reason(**layer)
        assert reason is not None and needle in reason, (needle, reason)


def test_fallback_warns_once_per_reason(monkeypatch, caplog):
    monkeypatch.setattr(gridtrim, "_warned", set())
    layer = _layer(torch.float32)
    meta = VllmKernelMeta(MAX_LORAS, MAX_TOKENS)
    wl = RowTileWorklist.allocate(MAX_TOKENS, MAX_LORAS + 1, DEVICE)
    with caplog.at_level(logging.WARNING, logger="vllm.lorazor.gridtrim"):
        for _ in range(3):
            done = gridtrim.add_lora_linear(layer["y"], layer["x"], layer["lora_a"], layer["lora_b"], 1.0,
                                            layer["output_slices"], meta.meta_args(6), wl)
            assert done is False
    warnings = [r for r in caplog.records if r.name == "vllm.lorazor.gridtrim"]
    assert len(warnings) == 1 and "float32" in warnings[0].getMessage()
    assert "stock kernels" in warnings[0].getMessage()


# -- kernels through the vLLM contract (Triton interpreter on CPU) ---------------------------------

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="the Triton kernels need the triton package")


@needs_triton
@pytest.mark.parametrize("add_inputs", [True, False])
def test_successive_steps_match_reference(add_inputs):
    """One worklist and one set of metadata buffers serve successive steps, as in a server: a mixed
    batch, a batch with another adapter mix, and a step with no adapter row (a no-op). x has more
    rows than the step's tokens (CUDA-graph padding) and those rows stay untouched."""
    gen = torch.Generator().manual_seed(7 + add_inputs)
    a, b = _weights(gen)
    meta = VllmKernelMeta(MAX_LORAS, MAX_TOKENS)
    wl = RowTileWorklist.allocate(MAX_TOKENS, MAX_LORAS + 1, DEVICE)
    steps = [({-1: 5, 0: 3, 2: 19, 3: 1}, 32), ({1: 2, -1: 1, 3: 4}, 8), ({-1: 6}, 8)]
    for groups, rows in steps:
        mapping = _mapping(groups, gen)
        meta.prepare(mapping)
        gridtrim.refresh_worklist(wl, meta.meta_args(MAX_TOKENS))
        x = torch.randn(rows, HIDDEN, generator=gen).to(DEVICE, DTYPE)
        y0 = _poisoned_output(rows, mapping, add_inputs, gen)
        y = y0.clone()
        done = gridtrim.add_lora_linear(y, x, a, b, 0.5, WIDTHS, meta.meta_args(rows), wl, add_inputs=add_inputs,
                                        num_programs=PROGRAMS)
        assert done is True
        _check(y, y0, x, a, b, mapping, 0.5, add_inputs)
    assert int(wl.num_tiles) == 0  # the last step had no adapter row


@needs_triton
def test_launch_config_follows_the_output_layout():
    """The per-layer launch config is keyed by x's and y's strides: the same layer writing into a
    column window of a wider output (other row stride) gets its own config and stays exact, and
    the contiguous output keeps using its own."""
    gen = torch.Generator().manual_seed(5)
    a, b = _weights(gen)
    meta = VllmKernelMeta(MAX_LORAS, MAX_TOKENS)
    wl = RowTileWorklist.allocate(MAX_TOKENS, MAX_LORAS + 1, DEVICE)
    mapping = _mapping({0: 6, -1: 2, 2: 9}, gen)
    meta.prepare(mapping)
    gridtrim.refresh_worklist(wl, meta.meta_args(MAX_TOKENS))
    rows = mapping.numel()
    x = torch.randn(rows, HIDDEN, generator=gen).to(DEVICE, DTYPE)
    n = sum(WIDTHS)
    for pad in (24, 0, 24):  # a column window of a wider output, a contiguous one, the window again
        base = torch.randn(rows, n + pad, generator=gen).to(DEVICE, DTYPE)
        y0, y = base[:, pad // 3:pad // 3 + n], base.clone()[:, pad // 3:pad // 3 + n]
        assert gridtrim.add_lora_linear(y, x, a, b, 0.5, WIDTHS, meta.meta_args(rows), wl, num_programs=PROGRAMS)
        _check(y, y0, x, a, b, mapping, 0.5, True)
        assert torch.equal(base[:, :pad // 3], y.as_strided(base.shape, base.stride(), 0)[:, :pad // 3])
    # key: the ids of A's and B's tensors, "linear", dtypes, widths, x.stride(), y.stride(), ...
    ids = tuple(map(id, [*a, *b]))
    layouts = {k[len(ids) + 6] for k in gridtrim._eligibility if k[:len(ids)] == ids}
    assert layouts == {(n + 24, 1), (n, 1)}


def _one_step(seed: int) -> tuple:
    """(A, B, metadata, work list, mapping, x, y, shrink buffer) of one step: adapters 0 and 3 and
    rows without one, the metadata prepared and the work list refreshed from it."""
    gen = torch.Generator().manual_seed(seed)
    a, b = _weights(gen)
    meta = VllmKernelMeta(MAX_LORAS, MAX_TOKENS)
    wl = RowTileWorklist.allocate(MAX_TOKENS, MAX_LORAS + 1, DEVICE)
    mapping = _mapping({-1: 4, 0: 9, 3: 7}, gen)
    meta.prepare(mapping)
    gridtrim.refresh_worklist(wl, meta.meta_args(MAX_TOKENS))
    rows = mapping.numel()
    x = torch.randn(rows, HIDDEN, generator=gen).to(DEVICE, DTYPE)
    y = torch.randn(rows, sum(WIDTHS), generator=gen).to(DEVICE, DTYPE)
    buf = torch.randn(len(WIDTHS), rows, RANK, generator=gen).to(DEVICE)
    return a, b, meta, wl, mapping, x, y, buf


@needs_triton
@pytest.mark.parametrize("compiled_launch", ["ops", "inductor"])
def test_traced_path_runs_the_same_launches(monkeypatch, compiled_launch):
    """While torch.compile traces, add_lora_linear / shrink / expand go through the registered
    ``torch.ops.lorazor`` ops (``"ops"``) or call the implementations, whose kernel calls are plain
    ``kernel[grid](**kwargs)`` for Dynamo to record (``"inductor"``: no op, no prepared launch); in
    eager mode they call the implementations with prepared launches. Every path must write the same bits."""
    from lora_kernels.launch import PreparedLaunch

    a, b, meta, wl, mapping, x, y0, buf0 = _one_step(11)
    rows = mapping.numel()
    used, prepared = [], []
    spies = {name: (lambda *args, name=name, op=op: used.append(name) or op(*args)) for name, op in gridtrim._OPS.items()}
    monkeypatch.setattr(gridtrim, "_OPS", spies)
    real_call = PreparedLaunch.__call__
    monkeypatch.setattr(PreparedLaunch, "__call__", lambda self, *args: prepared.append(1) or real_call(self, *args))

    def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        y, buf, y_expand = y0.clone(), torch.full_like(buf0, float("nan")), y0.clone()
        assert gridtrim.add_lora_linear(y, x, a, b, 0.5, WIDTHS, meta.meta_args(rows), wl, num_programs=PROGRAMS,
                                        compiled_launch=compiled_launch)
        assert gridtrim.shrink(buf, x, tuple(a), 0.5, meta.meta_args(rows), wl, num_programs=PROGRAMS,
                               compiled_launch=compiled_launch)
        assert gridtrim.expand(y_expand, buf0, tuple(b), WIDTHS, meta.meta_args(rows), wl, num_programs=PROGRAMS,
                               compiled_launch=compiled_launch)
        return y, buf, y_expand

    eager = run()
    assert used == [] and len(prepared) == 4  # eager: no dispatcher; shrink + expand, shrink, expand
    prepared.clear()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    traced = run()
    if compiled_launch == "ops":
        assert used == [gridtrim.OP_NAME, gridtrim.SHRINK_OP, gridtrim.EXPAND_OP]
    else:
        assert used == [] and prepared == []

    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.int16 if t.element_size() == 2 else torch.int32)

    assert all(torch.equal(bits(e), bits(t)) for e, t in zip(eager, traced))
    _check(eager[0], y0, x, a, b, mapping, 0.5, True)


def test_unknown_compiled_launch_is_refused():
    a, b, meta, wl, mapping, x, y, _ = _one_step(3)
    with pytest.raises(ValueError, match="compiled_launch='triton'"):
        gridtrim.add_lora_linear(y, x, a, b, 0.5, WIDTHS, meta.meta_args(mapping.numel()), wl,
                                 compiled_launch="triton")


def test_as_rows_keeps_a_2d_tensor_itself():
    t = torch.arange(24.0).view(2, 3, 4)
    view = t[1]
    assert gridtrim.as_rows(view) is view  # 2-D: no new view node for a trace
    rows = gridtrim.as_rows(t)
    assert rows.shape == (6, 4) and torch.equal(rows[3], t[1, 0])


@needs_triton
def test_ops_pass_torch_opcheck():
    """``torch.library.opcheck`` on each registered op with real arguments: the schema declares
    every mutation (only ``y`` changes), the fake kernel agrees with the real one, and AOT dispatch
    with dynamic shapes (what vLLM's Inductor compilation runs) functionalizes the call."""
    a, b, meta, wl, mapping, x, y, buf = _one_step(5)
    m = LoRABatchMeta.from_vllm_meta_args(meta.meta_args(mapping.numel()))
    tables = (m.token_lora_mapping, m.token_indices_sorted, m.num_tokens_per_slot, m.slot_start_loc,
              m.slot_lora_ids, wl.tile_lora, wl.tile_tokens, wl.num_tiles, wl.positions, wl.block_m)
    cases = {gridtrim.OP_NAME: (y.clone(), x, list(a), list(b), *tables, 0.5, 0, True, PROGRAMS),
             gridtrim.SHRINK_OP: (buf.clone(), x, list(a), *tables, 0.5, PROGRAMS),
             gridtrim.EXPAND_OP: (y.clone(), buf, list(b), *tables, 0, True, PROGRAMS)}
    for name, args in cases.items():
        results = torch.library.opcheck(getattr(torch.ops.lorazor, name), args)
        assert set(results.values()) == {"SUCCESS"}, (name, results)


class _CompiledLoRALayer(torch.nn.Module):
    """A LoRA layer as vLLM's forward reaches GridTrim: stacked weights held by the module, the
    step's metadata and work list in static buffers outside it, add_lora_linear then the
    fully-sharded paths' shrink and expand."""

    def __init__(self, a: list[torch.Tensor], b: list[torch.Tensor], meta: VllmKernelMeta,
                 wl: RowTileWorklist, launch: str = "ops") -> None:
        super().__init__()
        self.a, self.b, self.meta, self.wl, self.launch = tuple(a), tuple(b), meta, wl, launch

    def forward(self, y: torch.Tensor, x: torch.Tensor, buf: torch.Tensor,
                y_expand: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        args = self.meta.meta_args(x.size(0))
        launch = dict(num_programs=PROGRAMS, compiled_launch=self.launch)
        gridtrim.add_lora_linear(y, x, self.a, self.b, 0.5, WIDTHS, args, self.wl, **launch)
        gridtrim.shrink(buf, x, self.a, 0.5, args, self.wl, **launch)
        gridtrim.expand(y_expand, buf.clone(), self.b, WIDTHS, args, self.wl, **launch)
        return y + 0, buf * 1, y_expand + 0  # compiled work around the opaque ops, as in a model


@needs_triton
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_forward_matches_reference(backend):
    """Under a real ``torch.compile(fullgraph=True)`` (vLLM compiles the forward with Inductor) the
    ops are traced without a graph break, functionalized and run: successive steps with other
    batch sizes and adapter mixes through the same compiled graph match the torch reference, and
    rows without an adapter keep their bits. Dynamo's guards are dropped as vLLM drops them
    (vLLM 0.33.0 ``compilation/wrapper.py:126-146``): a step's host state read while tracing would
    be replayed stale instead of recompiled."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(13)
    a, b = _weights(gen)
    meta = VllmKernelMeta(MAX_LORAS, MAX_TOKENS)
    wl = RowTileWorklist.allocate(MAX_TOKENS, MAX_LORAS + 1, DEVICE)
    layer = torch.compile(_CompiledLoRALayer(a, b, meta, wl), fullgraph=True, backend=backend, dynamic=True,
                          options={"guard_filter_fn": torch.compiler.skip_all_guards_unsafe})
    for groups, rows in [({-1: 5, 0: 3, 2: 19, 3: 1}, 32), ({1: 2, -1: 1, 3: 4}, 8), ({-1: 6, 2: 11}, 24)]:
        mapping = _mapping(groups, gen)
        meta.prepare(mapping)
        gridtrim.refresh_worklist(wl, meta.meta_args(MAX_TOKENS))
        x = torch.randn(rows, HIDDEN, generator=gen).to(DEVICE, DTYPE)
        y0 = _poisoned_output(rows, mapping, True, gen)
        buf = torch.full((len(WIDTHS), rows, RANK), float("nan"), device=DEVICE)
        y, buf_out, y_expand = layer(y0.clone(), x, buf, y0.clone())
        _check(y, y0, x, a, b, mapping, 0.5, True)
        full = torch.full((rows,), -1, dtype=torch.int32, device=DEVICE)
        full[: mapping.numel()] = mapping
        shrunk = shrink_reference(x, a, full, 0.5)
        torch.testing.assert_close(buf_out, shrunk, rtol=1e-3, atol=1e-4)
        _check(y_expand, y0, x, a, b, mapping, 0.5, True)  # expand of the shrink: add_lora_linear's result


class _KernelStandIn:
    """A work-list kernel's stand-in off CUDA (Dynamo does not trace Triton's interpreter): writes
    into its output argument a value that depends on every tensor it is given, and records its grid
    and other arguments in ``numbers``, so a traced call that passes other arguments than the eager
    one gives other bits or other records."""

    def __init__(self, kernel: object, out: str, numbers: list) -> None:
        self.arg_names, self.out, self.numbers = kernel.arg_names, out, numbers

    def __getitem__(self, grid: tuple[int, ...]):
        def run(**kwargs: object) -> None:
            total = torch.zeros(())
            for name in self.arg_names:
                value = kwargs[name]
                if isinstance(value, torch.Tensor):
                    if name != self.out:
                        total = total + value.float().sum() * 1e-3
                else:
                    self.numbers.append((name, value))
            self.numbers.append(("grid", grid))
            out = kwargs[self.out]
            # shrink writes its partials (an uninitialised buffer), expand adds into y
            out.fill_(total) if self.out == "part_ptr" else out.add_(total.to(out.dtype))

        return run


def test_inductor_launch_traces_in_one_graph(monkeypatch):
    """``compiled_launch="inductor"``: under ``torch.compile(fullgraph=True)`` the implementations,
    their launch configs and the plain kernel calls trace without a graph break, and each kernel
    call gets the arguments the eager path's prepared launch gets (the work-list kernels replaced
    by stand-ins that fold every argument into their output; on a GPU Dynamo records the real
    ones as user-defined Triton kernels, ``python -m benchmarks.kernels.bench_launch_host``)."""
    from lora_kernels import expand as expand_kernels
    from lora_kernels import shrink as shrink_kernels

    numbers: list = []
    monkeypatch.setattr(shrink_kernels, "_shrink_worklist_kernel",
                        _KernelStandIn(shrink_kernels._shrink_worklist_kernel, "part_ptr", numbers))
    monkeypatch.setattr(expand_kernels, "_expand_worklist_kernel",
                        _KernelStandIn(expand_kernels._expand_worklist_kernel, "y_ptr", numbers))
    torch._dynamo.reset()
    a, b, meta, wl, _, x, y0, buf = _one_step(17)
    eager = _CompiledLoRALayer(a, b, meta, wl, "inductor")
    layer = torch.compile(eager, fullgraph=True, backend="aot_eager", dynamic=True)
    expected = eager(y0.clone(), x, buf.clone(), y0.clone())
    eager_numbers = numbers.copy()
    numbers.clear()
    got = layer(y0.clone(), x, buf.clone(), y0.clone())
    assert all(torch.equal(e, g) for e, g in zip(expected, got))
    assert not torch.equal(expected[0], y0)  # the stand-ins wrote
    assert len(eager_numbers) > 8 and [(k, int(v) if not isinstance(v, tuple) else v) for k, v in numbers] \
        == [(k, int(v) if not isinstance(v, tuple) else v) for k, v in eager_numbers]


def _stub_vllm(monkeypatch) -> type:
    """A stand-in for ``vllm.lora.punica_wrapper.punica_gpu`` whose PunicaWrapperGPU keeps the
    parts the subclass relies on: the base metadata buffers (punica_base.py:138-154),
    lora_config/max_loras (punica_gpu.py:49-50), token_mapping_meta and prompt_mapping_meta
    (:57-73), and stock add_lora_linear/add_lora_logits (recorded here)."""

    class PunicaWrapperGPU:
        stock_calls: list = []

        def __init__(self, max_num_batched_tokens, max_batches, device, **kwargs):
            def stale(*shape: int) -> torch.Tensor:
                return torch.full(shape, 9999, dtype=torch.long, device=device)
            self._token_lora_indices, self._sampler_indices = stale(max_num_batched_tokens), stale(max_num_batched_tokens)
            self._sampler_indices_padded = stale(max_num_batched_tokens)
            self._embeddings_indices = stale(2, max_num_batched_tokens)
            self.indices_len = [None] * 4
            self.lora_config = kwargs["lora_config"]
            self.max_loras = self.lora_config.max_loras
            self.token_mapping_meta = VllmKernelMeta(self.max_loras, max_num_batched_tokens)
            self.prompt_mapping_meta = VllmKernelMeta(self.max_loras, max_num_batched_tokens)

        def add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, *, buffer=None,
                            **kwargs):
            self.stock_calls.append(kwargs)

        def add_lora_logits(self, y, x, lora_a_stacked, lora_b_stacked, scale, *, buffer=None, **kwargs):
            self.stock_calls.append({"logits": True, **kwargs})

    names = ("vllm", "vllm.lora", "vllm.lora.punica_wrapper", "vllm.lora.punica_wrapper.punica_gpu")
    for name in names:
        monkeypatch.setitem(sys.modules, name, ModuleType(name))
    sys.modules[names[-1]].PunicaWrapperGPU = PunicaWrapperGPU
    monkeypatch.delitem(sys.modules, "serve_bridge.vllm.punica_wrapper", raising=False)
    return PunicaWrapperGPU


def _wrapper(monkeypatch, specialize_active_lora: bool = False):
    """(punica_wrapper module, a GridTrimPunicaWrapper on the stubbed base, after _stub_vllm) with
    MAX_LORAS slots and PROGRAMS persistent programs; the module is dropped from sys.modules at
    teardown, so the next test imports it over its own stub."""
    punica_wrapper = importlib.import_module("serve_bridge.vllm.punica_wrapper")
    monkeypatch.delitem(sys.modules, "serve_bridge.vllm.punica_wrapper")
    cfg = SimpleNamespace(max_loras=MAX_LORAS, specialize_active_lora=specialize_active_lora)
    wrapper = punica_wrapper.GridTrimPunicaWrapper(MAX_TOKENS, 8, DEVICE, lora_config=cfg)
    wrapper.gridtrim_programs = PROGRAMS
    return punica_wrapper, wrapper


@needs_triton
def test_punica_wrapper_subclass(monkeypatch):
    base = _stub_vllm(monkeypatch)
    punica_wrapper, wrapper = _wrapper(monkeypatch)
    from serve_bridge.vllm import plugin

    assert punica_wrapper.QUALNAME == plugin.GRIDTRIM_WRAPPER == (
        f"{punica_wrapper.__name__}.{punica_wrapper.GridTrimPunicaWrapper.__qualname__}")
    assert isinstance(wrapper, base) and wrapper.gridtrim_worklist.capacity >= MAX_TOKENS // 16 + MAX_LORAS + 1
    gen = torch.Generator().manual_seed(3)
    a, b = _weights(gen)
    mapping = _mapping({0: 4, -1: 2, 1: 3}, gen)
    wrapper.update_metadata(*vllm_mapping(mapping), MAX_LORAS + 1, 1000)
    assert int(wrapper.gridtrim_worklist.num_tiles) == 2
    x = torch.randn(12, HIDDEN, generator=gen).to(DEVICE, DTYPE)  # 3 padding rows
    y0 = _poisoned_output(12, mapping, True, gen)
    y = y0.clone()
    assert wrapper.add_lora_linear(y, x, tuple(a), tuple(b), 1.0, WIDTHS) is None
    _check(y, y0, x, a, b, mapping, 1.0, True)
    assert base.stock_calls == []
    # an ineligible layer (fp32) goes to the stock method, with the caller's kwargs
    layer = _layer(torch.float32)
    wrapper.add_lora_linear(layer["y"], layer["x"], tuple(layer["lora_a"]), tuple(layer["lora_b"]), 1.0,
                            layer["output_slices"], add_inputs=False)
    assert base.stock_calls == [{"add_inputs": False}]


@needs_triton
def test_punica_wrapper_logits_use_the_sampler_mapping(monkeypatch):
    """add_lora_logits: one slice over the vocabulary, rows and ids from the sampler's mapping (not
    the token mapping), logits wider than the LoRA vocabulary, columns past it untouched."""
    base = _stub_vllm(monkeypatch)
    _, wrapper = _wrapper(monkeypatch, specialize_active_lora=True)
    gen = torch.Generator().manual_seed(11)
    vocab, padded = 70, 76
    a = (torch.randn(MAX_LORAS, 1, RANK, HIDDEN, generator=gen) * HIDDEN ** -0.5).to(DEVICE, DTYPE)
    b = (torch.randn(MAX_LORAS, 1, vocab, RANK, generator=gen) * RANK ** -0.5).to(DEVICE, DTYPE)
    tokens = _mapping({0: 9, 1: 5, -1: 4}, gen)
    sampled = _mapping({1: 2, -1: 1, 3: 2}, gen)
    for step in range(2):  # the same stacks on a second step reuse the layer's eligibility
        wrapper.update_metadata(*vllm_mapping(tokens, sampled), MAX_LORAS + 1, vocab)
        x = torch.randn(sampled.numel(), HIDDEN, generator=gen).to(DEVICE, DTYPE)
        y0 = torch.randn(sampled.numel(), padded, generator=gen).to(DEVICE, DTYPE)
        y0[sampled < 0] = float("nan")
        y = y0.clone()
        wrapper.add_lora_logits(y, x, a, b, 0.5)
        ref = expand_reference(shrink_reference(x, [a], sampled, 0.5), [b], y0[:, :vocab].clone(), sampled)
        rows = sampled >= 0
        assert torch.equal(y[~rows].view(torch.int16), y0[~rows].view(torch.int16))
        assert torch.equal(y[:, vocab:].view(torch.int16), y0[:, vocab:].view(torch.int16))
        torch.testing.assert_close(y[rows, :vocab].float(), ref[rows].float(), rtol=2e-2, atol=2e-3)
    assert base.stock_calls == []
    wrapper.add_lora_logits(y.float(), x, a, b, 1.0)  # fp32 logits: the stock method
    assert base.stock_calls == [{"logits": True}]
