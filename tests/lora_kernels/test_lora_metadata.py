"""Token→slot metadata: the sync-free builder honours vLLM's contract."""
from __future__ import annotations

import pytest
import torch
from conftest import mapping_from_groups, vllm_style_metadata

from lora_kernels.metadata import LoRABatchMeta, build_metadata


def _check_contract(meta: LoRABatchMeta, mapping: torch.Tensor) -> None:
    """Every slot's range of sorted indices holds exactly the tokens of its adapter, in order."""
    m = mapping.numel()
    assert sorted(meta.token_indices_sorted.tolist()) == list(range(m))
    assert meta.slot_start_loc[0] == 0
    assert torch.equal(meta.slot_start_loc[1:], torch.cumsum(meta.num_tokens_per_slot, 0).int())
    seen: set[int] = set()
    for slot in range(meta.num_slots):
        start, n = int(meta.slot_start_loc[slot]), int(meta.num_tokens_per_slot[slot])
        tokens = meta.token_indices_sorted[start:start + n].tolist()
        assert tokens == sorted(tokens), "groups keep token order (stable sort)"
        lora = int(meta.slot_lora_ids[slot])
        if n:
            assert set(mapping[tokens].tolist()) == {lora}
        if lora >= 0 and n:
            assert lora not in seen
            seen.add(lora)
    assert seen == set(mapping[mapping >= 0].tolist())


def test_builder_groups_tokens_by_adapter(gen: torch.Generator) -> None:
    mapping = mapping_from_groups({-1: 9, 0: 3, 2: 17, 5: 1, 6: 40}, gen)
    meta = build_metadata(mapping, max_loras=8)
    _check_contract(meta, mapping)
    assert meta.slot_lora_ids.tolist() == list(range(-1, 8))
    assert meta.num_tokens_per_slot.tolist() == [9, 3, 0, 17, 0, 0, 1, 40, 0]
    assert all(t.dtype == torch.int32 for t in (meta.token_lora_mapping, meta.token_indices_sorted,
                                                meta.num_tokens_per_slot, meta.slot_start_loc))


def test_builder_random_mappings(gen: torch.Generator) -> None:
    for _ in range(20):
        loras = int(torch.randint(1, 20, (1,), generator=gen))
        m = int(torch.randint(1, 300, (1,), generator=gen))
        mapping = torch.randint(-1, loras, (m,), generator=gen, dtype=torch.int32)
        _check_contract(build_metadata(mapping, loras), mapping)


def test_builder_all_unmapped_and_single_adapter(gen: torch.Generator) -> None:
    none = torch.full((7,), -1, dtype=torch.int32)
    meta = build_metadata(none, 4)
    assert meta.num_tokens_per_slot.tolist() == [7, 0, 0, 0, 0]
    one = torch.full((5,), 3, dtype=torch.int32)
    meta = build_metadata(one, 4)
    assert meta.num_tokens_per_slot.tolist() == [0, 0, 0, 0, 5]
    assert meta.token_indices_sorted.tolist() == [0, 1, 2, 3, 4]


def test_vllm_layout_satisfies_contract(gen: torch.Generator) -> None:
    mapping = mapping_from_groups({-1: 4, 1: 2, 7: 20}, gen)
    meta, active = vllm_style_metadata(mapping, max_loras=8)
    assert active == 3 and meta.slot_lora_ids.tolist()[:4] == [-1, 1, 7, -1]
    _check_contract(meta, mapping)


def test_from_vllm_meta_args_keeps_order_and_storage() -> None:
    """from_vllm_meta_args takes vLLM's first five tensors in order, sharing storage, and
    vllm_meta_args gives them back in that order."""
    args = [torch.arange(i + 1, dtype=torch.int32) for i in range(5)]
    args += [torch.tensor([False]), torch.tensor([3])]
    meta = LoRABatchMeta.from_vllm_meta_args(args)
    fields = (meta.token_lora_mapping, meta.token_indices_sorted, meta.num_tokens_per_slot,
              meta.slot_start_loc, meta.slot_lora_ids)
    assert all(f.data_ptr() == a.data_ptr() for f, a in zip(fields, args))
    back = meta.vllm_meta_args()
    assert len(back) == 5 and all(t is a for t, a in zip(back, args))


def test_builder_owns_its_tensors_and_checks_the_mapping() -> None:
    mapping = torch.tensor([2, -1, 0, 2], dtype=torch.int32)
    meta = build_metadata(mapping, 3)
    mapping[:] = 1  # the caller reuses its buffer
    assert meta.token_lora_mapping.tolist() == [2, -1, 0, 2]
    assert meta.num_tokens_per_slot.tolist() == [1, 1, 0, 2]
    with pytest.raises(TypeError, match="integer tensor"):
        build_metadata(mapping.float(), 3)
    with pytest.raises(ValueError, match="1-D"):
        build_metadata(mapping[None], 3)
    with pytest.raises(ValueError, match="max_loras"):
        build_metadata(mapping, -1)
