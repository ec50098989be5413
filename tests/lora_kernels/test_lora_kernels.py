"""Triton shrink/expand, all three launch designs, against the torch reference.

The designs: GridTrim and the work list (shrink → partials → expand, two launches), and the
fused work-list launch (shrink in registers, then expand, one launch; no partials).

Runs on the GPU when there is one, else in Triton's interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py before Triton is imported). The interpreter multiplies bf16 tiles as raw uint16 bits
(triton/runtime/interpreter.py, `create_dot`), so on CPU only fp16 is checked; bf16 is covered
by tests/gpu/test_lora_ops.py on the GPU.

Inputs are fresh random draws; every output is poisoned first (NaN) wherever the kernels must
not or need not write, so each element is either checked against the reference or checked
untouched.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import mapping_from_groups, vllm_style_metadata

pytest.importorskip("triton", reason="the Triton kernels need the triton package")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

from lora_kernels.expand import lora_expand  # noqa: E402
from lora_kernels.fused import FusedConfig  # noqa: E402
from lora_kernels.gridtrim import plan_gridtrim  # noqa: E402
from lora_kernels.layout import partials_buffer  # noqa: E402
from lora_kernels.linear import add_lora_linear  # noqa: E402
from lora_kernels.metadata import LoRABatchMeta, build_metadata  # noqa: E402
from lora_kernels.reference import expand_reference, shrink_reference  # noqa: E402
from lora_kernels.shrink import lora_shrink  # noqa: E402
from lora_kernels.worklist import RowTileWorklist  # noqa: E402

DTYPES = [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
PROGRAMS = 3  # a persistent grid smaller than the work, so programs stride over items
# Small tiles so that items span several column chunks (some straddling a slice's end) and the
# shrink loop several hidden steps with a masked tail.
FUSED = FusedConfig(block_n=16, col_chunks=3, block_k=128)


def _schedule(kind: str, meta: LoRABatchMeta, num_tokens: int, num_slots: int):
    if kind in ("worklist", "fused"):
        wl = RowTileWorklist.allocate(num_tokens, meta.num_slots, DEVICE)
        wl.update(meta)
        return wl
    return plan_gridtrim(meta, num_tokens, num_slots)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    finite = torch.isfinite(ref)
    return float((out[finite].float() - ref[finite].float()).norm() / ref[finite].float().norm())


CASES = {
    # name: (groups, slice widths, rank, hidden, k_chunk, offset_start, add_inputs, vllm layout)
    "decode_3_slices": ({-1: 6} | {i: 2 for i in range(12)}, [48, 16, 16], 8, 320, 128, 0,
                        True, True),
    "large_groups_2_slices": ({-1: 5, 0: 37, 1: 17, 2: 16, 3: 1}, [40, 40], 24, 200, 128, 0,
                              False, False),
    "17_large_groups": ({i: 17 for i in range(17)}, [32], 8, 64, 1024, 0, True, True),
    "rank64_offset": ({-1: 3, 2: 5, 5: 20}, [96], 64, 130, 64, 7, False, False),
    "no_adapter_rows": ({-1: 9}, [16, 16], 16, 64, 1024, 0, True, False),
    "uneven_3_slices_offset": ({-1: 2, 0: 20, 4: 3}, [40, 24, 9], 16, 96, 64, 5, True, False),
}


@pytest.mark.parametrize("kind", ["worklist", "gridtrim", "fused"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_shrink_expand_match_reference(case: str, kind: str, dtype: torch.dtype,
                                       gen: torch.Generator) -> None:
    groups, widths, rank, hidden, k_chunk, offset, add_inputs, vllm_layout = CASES[case]
    max_loras = max(groups) + 2
    mapping = mapping_from_groups(groups, gen)
    m = mapping.numel()
    if vllm_layout:
        meta, num_slots = vllm_style_metadata(mapping, max_loras)
    else:
        meta, num_slots = build_metadata(mapping, max_loras), max_loras + 1
    meta = LoRABatchMeta(*(t.to(DEVICE) for t in meta.vllm_meta_args()))
    mapping = mapping.to(DEVICE)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)

    x = rand(m, hidden)
    lora_a = [rand(max_loras, 1, rank, hidden, scale=hidden ** -0.5) for _ in widths]
    lora_b = [rand(max_loras, 1, n, rank, scale=rank ** -0.5) for n in widths]
    width = offset + sum(widths) + 3
    y0 = rand(m, width) if add_inputs else torch.full((m, width), float("nan"), device=DEVICE,
                                                      dtype=dtype)
    if add_inputs:  # columns outside the slices must stay untouched: poison them
        y0[:, :offset] = float("nan")
        y0[:, offset + sum(widths):] = float("nan")
    schedule = _schedule(kind, meta, m, num_slots)
    inter = shrink_reference(x, lora_a, mapping, scale=0.5)
    mapped = mapping >= 0
    y = y0.clone()
    if kind == "fused":
        add_lora_linear(y, x, lora_a, lora_b, None, meta, schedule, scale=0.5,
                        offset_start=offset, add_inputs=add_inputs, fused=FUSED,
                        num_programs=PROGRAMS)
    else:
        partials = partials_buffer(len(widths), m, rank, hidden, DEVICE, k_chunk)
        partials.fill_(float("nan"))
        # The work list's shrink with batched dots over 2 hidden groups, GridTrim's with one.
        lora_shrink(x, lora_a, partials, meta, schedule, scale=0.5, k_chunk=k_chunk,
                    k_groups=2 if kind == "worklist" else 1, num_programs=PROGRAMS)
        assert torch.isnan(partials[:, :, ~mapped]).all(), "rows without adapter: not written"
        if mapped.any():
            assert _rel_err(partials.sum(0)[:, mapped], inter[:, mapped]) < 1e-3
        lora_expand(partials, lora_b, y, meta, schedule, offset_start=offset,
                    add_inputs=add_inputs, block_n=16, chunk_tiles=2, num_programs=PROGRAMS)
    ref = expand_reference(inter, lora_b, y0, mapping, offset_start=offset, add_inputs=add_inputs)
    assert torch.equal(torch.isnan(y), torch.isnan(ref)), "written/untouched elements differ"
    torch.testing.assert_close(y[~mapped], y0[~mapped], rtol=0, atol=0, equal_nan=True)
    if mapped.any():
        assert _rel_err(y, ref) < 1e-2


@pytest.mark.parametrize("fused", [False, True])
def test_one_worklist_and_grid_serve_successive_batches(gen: torch.Generator,
                                                        fused: bool) -> None:
    """The persistent launches read the batch only from device buffers: the same buffers and
    grid (as a replayed CUDA graph would use) give right answers for different batches."""
    m, max_loras, hidden, rank, width = 48, 8, 96, 8, 40
    wl = RowTileWorklist.allocate(m, max_loras + 1, DEVICE)
    lora_a = [(torch.randn(max_loras, rank, hidden, generator=gen) / 10).to(DEVICE, torch.float16)]
    lora_b = [(torch.randn(max_loras, width, rank, generator=gen) / 3).to(DEVICE, torch.float16)]
    x = torch.randn(m, hidden, generator=gen).to(DEVICE, torch.float16)
    partials = None if fused else partials_buffer(1, m, rank, hidden, DEVICE)
    for groups in ({i: 6 for i in range(8)}, {-1: 40, 3: 8}, {0: 1, 1: 47}):
        mapping = mapping_from_groups(groups, gen).to(DEVICE)
        meta = build_metadata(mapping, max_loras)
        wl.update(meta)
        y = torch.zeros(m, width, device=DEVICE, dtype=torch.float16)
        add_lora_linear(y, x, lora_a, lora_b, partials, meta, wl, num_programs=PROGRAMS,
                        fused=FUSED if fused else False)
        ref = expand_reference(shrink_reference(x, lora_a, mapping), lora_b,
                               torch.zeros_like(y), mapping)
        assert _rel_err(y, ref) < 1e-2


def test_rejects_mismatched_inputs() -> None:
    meta = build_metadata(torch.zeros(4, dtype=torch.int32, device=DEVICE), 1)
    wl = RowTileWorklist.allocate(4, 2, DEVICE)
    x = torch.zeros(4, 32, device=DEVICE, dtype=torch.float16)
    a = [torch.zeros(1, 8, 32, device=DEVICE, dtype=torch.bfloat16)]
    with pytest.raises(ValueError, match="same dtype"):
        lora_shrink(x, a, partials_buffer(1, 4, 8, 32, DEVICE), meta, wl)
    a = [torch.zeros(1, 8, 32, device=DEVICE, dtype=torch.float16)]
    with pytest.raises(ValueError, match="partials"):
        lora_shrink(x, a, partials_buffer(2, 4, 8, 32, DEVICE), meta, wl)
    b = [torch.zeros(1, 64, 8, device=DEVICE, dtype=torch.float16)]
    with pytest.raises(ValueError, match="columns"):
        lora_expand(partials_buffer(1, 4, 8, 32, DEVICE), b, torch.zeros(4, 60, device=DEVICE,
                    dtype=torch.float16), meta, wl)
    y = torch.zeros(4, 64, device=DEVICE, dtype=torch.float16)
    with pytest.raises(ValueError, match="RowTileWorklist"):
        add_lora_linear(y, x, a, b, None, meta, plan_gridtrim(meta, 4, 2), fused=True)
    with pytest.raises(ValueError, match="B slices"):
        add_lora_linear(y, x, a, [torch.zeros(1, 64, 16, device=DEVICE, dtype=torch.float16)],
                        None, meta, wl, fused=True)
    with pytest.raises(ValueError, match="partials"):
        add_lora_linear(y, x, a, b, None, meta, wl)
    with pytest.raises(ValueError, match="k_groups"):
        lora_shrink(x, a, partials_buffer(1, 4, 8, 32, DEVICE), meta, wl, k_chunk=32, k_groups=4)


def test_kernels_compile_for_sm90() -> None:
    """GPU codegen of every launch, ahead of time on this machine (see sm90_compile.py)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("sm90_compile.py")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("cubin") == 16  # 12 LoRA launches, 4 StepTrim
