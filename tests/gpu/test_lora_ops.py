"""The LoRA launch designs (work list, GridTrim, fused) against the torch reference, on the GPU.

Covers adapters 1…128, groups of 1…2048 rows, released (-1) rows, ranks 8/16/64, 1–3 slices,
bf16 and fp16, on the layer shapes of Llama-3.2-3B, Mistral-7B-v0.3 and SmolLM2-135M, each
design with its default knobs (the fused launch: ``FusedConfig()``). Each case checks the LoRA
update's relative error (< 1e-2), that rows without an adapter are left bit-for-bit untouched,
and (add_inputs=False, output poisoned with NaN) that every element the reference writes is
written. The serving path's LoRA linear (``serve_bridge.gridtrim.add_lora_linear``) is also checked
inside a torch.compile'd function with each ``LORAZOR_GRIDTRIM_LAUNCH`` value. About a minute on one
H200, most of it Triton compiles.
"""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

if not torch.cuda.is_available():  # before Triton loads: the CPU tests set up its interpreter first
    pytest.skip("needs an NVIDIA GPU (CUDA)", allow_module_level=True)

from benchmarks.kernels.lora_shapes import (MODELS, LoRAOp, OpTensors, mapping_from_groups, random_op, release,
                                           update_rel_err)
from lora_kernels.gridtrim import plan_gridtrim
from lora_kernels.layout import partials_buffer
from lora_kernels.linear import add_lora_linear, launch_linear, linear_config
from lora_kernels.metadata import LoRABatchMeta, build_metadata
from lora_kernels.reference import expand_reference, shrink_reference
from lora_kernels.worklist import RowTileWorklist
from serve_bridge import gridtrim

DEVICE = "cuda"
MAX_LORAS = 128
MAX_TOKENS = 2048
TOLERANCE = 1e-2
DESIGNS = ("worklist", "gridtrim", "fused")

pytestmark = pytest.mark.gpu


def batches(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Token→adapter mappings, named by their shape."""
    sizes = torch.randint(1, 61, (33,), generator=gen).tolist()
    return {
        "1 row": mapping_from_groups({5: 1}, gen),
        "1 adapter x 2048": mapping_from_groups({0: 2048}, gen),
        "128 x 2, 25% released": release(mapping_from_groups({i: 2 for i in range(128)}, gen),
                                         0.25, gen),
        "mixed 1792 + 127 x 2": mapping_from_groups(
            {-1: 2, 0: 1792} | {i: 2 for i in range(1, 128)}, gen),
        "33 adapters x 1..60, 10% released": release(
            mapping_from_groups({3 * i + 1: n for i, n in enumerate(sizes)}, gen), 0.1, gen),
        "all released": mapping_from_groups({-1: 64}, gen),
    }


def cases(models: list[str]) -> list[tuple[str, LoRAOp, int, torch.dtype, bool, list[str]]]:
    """(model, op, rank, dtype, add_inputs, batch names) to run."""
    every = ["1 row", "1 adapter x 2048", "128 x 2, 25% released", "mixed 1792 + 127 x 2",
             "33 adapters x 1..60, 10% released", "all released"]
    out = []
    for model in models:
        ranks = (8, 16, 64) if model == "llama-3.2-3b" else (8,)
        for op in MODELS[model]:
            out += [(model, op, rank, torch.bfloat16, True, every) for rank in ranks]
        if model == "llama-3.2-3b":
            out += [(model, op, 16, torch.float16, True, every[2:4])
                    for op in MODELS[model] if op.name in ("qkv", "down")]
        if model == "smollm2-135m":
            out.append((model, MODELS[model][1], 8, torch.bfloat16, False, every))
    return out


def check(model: str, op: LoRAOp, rank: int, dtype: torch.dtype, add_inputs: bool,
          mapping: torch.Tensor, worklist: RowTileWorklist, gen: torch.Generator,
          designs: list[str]) -> dict[str, float]:
    """Relative update error of each design; NaN if an untouched-element check fails."""
    tensors = random_op(op, MAX_LORAS, rank, mapping.numel(), dtype, DEVICE, gen)
    mapping = mapping.to(DEVICE)
    meta = build_metadata(mapping, MAX_LORAS)
    worklist.update(meta)
    plan = plan_gridtrim(meta, mapping.numel(), meta.num_slots)
    y0 = tensors.y if add_inputs else torch.full_like(tensors.y, float("nan"))
    ref = expand_reference(shrink_reference(tensors.x, tensors.lora_a, mapping), tensors.lora_b,
                           y0, mapping, add_inputs=add_inputs)
    mapped = mapping >= 0
    errors = {}
    schedules = {"worklist": worklist, "gridtrim": plan, "fused": worklist}
    for name in designs:
        fused = name == "fused"
        partials = None if fused else partials_buffer(
            len(op.widths), mapping.numel(), rank, op.hidden, DEVICE).fill_(float("nan"))
        y = y0.clone()
        add_lora_linear(y, tensors.x, tensors.lora_a, tensors.lora_b, partials, meta,
                        schedules[name], add_inputs=add_inputs, fused=fused)
        untouched = torch.equal(y[~mapped].nan_to_num(7.0), y0[~mapped].nan_to_num(7.0))
        written = torch.equal(torch.isnan(y), torch.isnan(ref))
        if not (untouched and written):
            errors[name] = float("nan")
        elif not mapped.any():
            errors[name] = 0.0
        elif add_inputs:
            errors[name] = update_rel_err(y[mapped], ref[mapped], y0[mapped])
        else:
            errors[name] = update_rel_err(y[mapped], ref[mapped], torch.zeros_like(y[mapped]))
    return errors


@pytest.fixture(scope="module")
def inputs() -> Iterator[tuple[dict[str, torch.Tensor], RowTileWorklist, torch.Generator]]:
    """The batches (fixed seed), one work list reused by every case, and the device generator."""
    mappings = batches(torch.Generator().manual_seed(0))
    worklist = RowTileWorklist.allocate(MAX_TOKENS, MAX_LORAS + 1, DEVICE)
    yield mappings, worklist, torch.Generator(device=DEVICE).manual_seed(0)
    del worklist
    torch.cuda.empty_cache()  # the vLLM tests' engines run in other processes on the same GPU


CASES = [pytest.param(model, op, rank, dtype, add_inputs, name,
                      id=f"{model}-{op.name}-r{rank}-{str(dtype)[6:]}-{'add' if add_inputs else 'set'}-{name}")
         for model, op, rank, dtype, add_inputs, names in cases(list(MODELS)) for name in names]


@pytest.mark.parametrize("model, op, rank, dtype, add_inputs, batch", CASES)
def test_designs_match_the_reference(inputs, model, op, rank, dtype, add_inputs, batch):
    mappings, worklist, gen = inputs
    with torch.inference_mode():
        errors = check(model, op, rank, dtype, add_inputs, mappings[batch], worklist, gen, list(DESIGNS))
    bad = {d: e for d, e in errors.items() if not e < TOLERANCE}  # NaN: an untouched/written check failed
    assert not bad, f"relative update error ≥ {TOLERANCE} or wrong elements touched (NaN): {bad}"


def qkv_batch(op: LoRAOp, rank: int, tokens: int, seed: int,
              released: float) -> tuple[OpTensors, torch.Tensor, LoRABatchMeta, RowTileWorklist]:
    """Random bf16 tensors of ``op`` over :data:`MAX_LORAS` adapters, 32 adapters of 3 rows each with
    ``released`` of the rows released (-1), their metadata and a work list refreshed from it."""
    tensors = random_op(op, MAX_LORAS, rank, tokens, torch.bfloat16, DEVICE,
                        torch.Generator(device=DEVICE).manual_seed(seed))
    mapping = release(mapping_from_groups({i: 3 for i in range(32)}, torch.Generator().manual_seed(seed)), released,
                      torch.Generator().manual_seed(seed + 1)).to(DEVICE)
    meta = build_metadata(mapping, MAX_LORAS)
    worklist = RowTileWorklist.allocate(MAX_TOKENS, MAX_LORAS + 1, DEVICE)
    worklist.update(meta)
    return tensors, mapping, meta, worklist


def test_prepared_launches_reuse_the_compiled_kernels() -> None:
    """The work list's second launch of a specialization goes through the compiled kernel's runner
    (lora_kernels.launch) and writes what the JIT's first launch wrote; an input of another
    alignment is another specialization, launched by the JIT first, and matches the reference."""
    op, rank, tokens = MODELS["llama-3.2-3b"][0], 8, 96
    tensors, mapping, meta, worklist = qkv_batch(op, rank, tokens, 7, 0.2)
    ref = expand_reference(shrink_reference(tensors.x, tensors.lora_a, mapping), tensors.lora_b, tensors.y, mapping)
    config = linear_config(tensors.y, tensors.x, tensors.lora_a, tensors.lora_b)

    def run(x: torch.Tensor) -> torch.Tensor:
        y = tensors.y.clone()
        partials = partials_buffer(len(op.widths), tokens, rank, op.hidden, DEVICE)
        launch_linear(config, y, x, partials, meta, worklist)
        return y

    with torch.inference_mode():
        first = run(tensors.x)
        launches = (config.shrink.worklist_launch, config.expand.worklist_launch)
        assert [p.compiled_variants for p in launches] == [1, 1]
        second = run(tensors.x)
        assert torch.equal(first, second)
        assert [p.compiled_variants for p in launches] == [1, 1]
        shifted = torch.empty(tokens * op.hidden + 1, device=DEVICE, dtype=tensors.x.dtype)[1:].view(tokens, op.hidden)
        shifted.copy_(tensors.x)  # the same values, 2 bytes off a 16-byte boundary
        third = run(shifted)
        assert launches[0].compiled_variants == 2
    mapped = mapping >= 0
    for y in (first, third):
        assert update_rel_err(y[mapped], ref[mapped], tensors.y[mapped]) < TOLERANCE
        assert torch.equal(y[~mapped], tensors.y[~mapped])


@pytest.mark.parametrize("launch", gridtrim.COMPILED_LAUNCHES)
def test_compiled_launches_match_the_reference(launch: str) -> None:
    """Two LoRA linears on a forward's intermediate output (as a base layer's), in a torch.compile'd
    function (the token dimension dynamic, as vLLM marks it) with each ``compiled_launch``: the update
    within the tolerance of the torch reference, rows without an adapter untouched; the custom ops'
    launch bit-equal to eager (the same kernels, the same specialization). Inductor compiles the
    kernels itself, so its bit-equality to eager is printed, not required."""
    op = MODELS["llama-3.2-3b"][0]
    tensors, mapping, meta, worklist = qkv_batch(op, 8, 96, 11, 0.25)
    meta_args = meta.vllm_meta_args()
    once = expand_reference(shrink_reference(tensors.x, tensors.lora_a, mapping), tensors.lora_b, tensors.y, mapping)
    ref = expand_reference(shrink_reference(tensors.x, tensors.lora_a, mapping), tensors.lora_b, once, mapping)

    def two_linears(x: torch.Tensor, y0: torch.Tensor, how: str) -> torch.Tensor:
        y = y0 * 1
        for _ in range(2):
            gridtrim.add_lora_linear(y, x, tensors.lora_a, tensors.lora_b, 1.0, op.widths, meta_args, worklist,
                                     compiled_launch=how)
        return y

    with torch.inference_mode():
        eager = two_linears(tensors.x, tensors.y, launch)
        for t in (tensors.x, tensors.y, *meta_args[:2]):
            torch._dynamo.mark_dynamic(t, 0)
        compiled = torch.compile(two_linears, fullgraph=True)(tensors.x, tensors.y, launch)
    mapped = mapping >= 0
    differ = int((compiled != eager).sum())
    print(f"compiled_launch={launch}: {differ} of {compiled.numel()} elements differ from eager")
    assert update_rel_err(compiled[mapped], ref[mapped], tensors.y[mapped]) < TOLERANCE
    assert torch.equal(compiled[~mapped], tensors.y[~mapped])
    assert launch != "ops" or differ == 0
