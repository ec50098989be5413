"""The paper's GridTrim plan: row-bound buckets and the two-class expand."""
from __future__ import annotations

import pytest
import torch
from conftest import mapping_from_groups, vllm_style_metadata

from lora_kernels.gridtrim import MAX_LARGE_SLOTS, plan_gridtrim, row_bound
from lora_kernels.metadata import build_metadata


@pytest.mark.parametrize("max_rows, tokens, bound", [
    (2, 256, 16), (16, 256, 16), (17, 256, 32), (64, 256, 64), (65, 256, 128),
    (128, 256, 128), (129, 256, 256), (256, 256, 256), (1792, 2048, 2048), (1024, 2048, 1024),
    (3, 8, 8), (0, 256, 16), (40, 48, 48),
])
def test_row_bound_buckets(max_rows: int, tokens: int, bound: int) -> None:
    assert row_bound(max_rows, tokens) == bound


def test_decode_batch_is_one_class_at_16(gen: torch.Generator) -> None:
    mapping = mapping_from_groups({i: 2 for i in range(128)}, gen)
    meta, active = vllm_style_metadata(mapping, 128)
    plan = plan_gridtrim(meta, mapping.numel(), active)
    assert (plan.row_bound, plan.num_slots, plan.large_slots) == (16, 128, None)
    assert plan.all_slots.tolist() == list(range(128))


def test_mixed_batch_lists_the_large_group(gen: torch.Generator) -> None:
    groups = {-1: 2, 0: 1792} | {i: 2 for i in range(1, 128)}
    mapping = mapping_from_groups(groups, gen)
    meta, active = vllm_style_metadata(mapping, 128)
    plan = plan_gridtrim(meta, mapping.numel(), active)
    assert plan.row_bound == 2048 and plan.num_slots == 129
    assert plan.large_slots.tolist() == [1] + [-1] * (MAX_LARGE_SLOTS - 1)


def test_unmapped_rows_do_not_set_the_bound(gen: torch.Generator) -> None:
    mapping = mapping_from_groups({-1: 200, 0: 3, 1: 5}, gen)
    meta = build_metadata(mapping, 2)
    plan = plan_gridtrim(meta, mapping.numel(), meta.num_slots)
    assert plan.row_bound == 16 and plan.large_slots is None


def test_many_large_groups_fall_back_to_one_class(gen: torch.Generator) -> None:
    mapping = mapping_from_groups({i: 20 for i in range(MAX_LARGE_SLOTS + 1)}, gen)
    meta = build_metadata(mapping, MAX_LARGE_SLOTS + 1)
    plan = plan_gridtrim(meta, mapping.numel(), meta.num_slots)
    assert plan.row_bound == 32 and plan.large_slots is None


def test_a_plan_must_cover_every_used_slot(gen: torch.Generator) -> None:
    mapping = mapping_from_groups({0: 3, 5: 20}, gen)
    meta, active = vllm_style_metadata(mapping, 8)
    assert active == 2
    with pytest.raises(ValueError, match="num_slots=1 but slot 1 of the metadata holds 20 adapter tokens"):
        plan_gridtrim(meta, mapping.numel(), 1)
    with pytest.raises(ValueError, match="num_slots=10, expected 0..9"):
        plan_gridtrim(meta, mapping.numel(), 10)
    with pytest.raises(ValueError, match="maps 23 tokens but the batch has 16"):
        plan_gridtrim(meta, 16, active)
