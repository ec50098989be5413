"""Device-side row-tile work list: exactly the useful tiles, in static buffers."""
from __future__ import annotations

import pytest
import torch
from conftest import mapping_from_groups, vllm_style_metadata

from lora_kernels.metadata import LoRABatchMeta, build_metadata
from lora_kernels.worklist import PROGRAMS_PER_SM, RowTileWorklist, host_tiles, persistent_programs


def _expected_tiles(meta: LoRABatchMeta, block_m: int) -> list[tuple[int, list[int]]]:
    """(adapter, token indices) of every useful tile, slot by slot."""
    tiles = []
    order = meta.token_indices_sorted.tolist()
    for slot in range(meta.num_slots):
        lora, count = int(meta.slot_lora_ids[slot]), int(meta.num_tokens_per_slot[slot])
        if lora < 0:
            continue
        for row0 in range(0, count, block_m):
            first = int(meta.slot_start_loc[slot]) + row0
            tiles.append((lora, order[first:first + min(block_m, count - row0)]))
    return tiles


def _listed(wl: RowTileWorklist) -> list[tuple[int, list[int]]]:
    """The list's tiles; also checks that each tile's tokens are a prefix padded with -1."""
    n = int(wl.num_tiles)
    tiles = []
    for lora, tokens in zip(wl.tile_lora[:n].tolist(), wl.tile_tokens[:n].tolist()):
        rows = sum(t >= 0 for t in tokens)
        assert rows >= 1 and tokens[rows:] == [-1] * (len(tokens) - rows), tokens
        tiles.append((lora, tokens[:rows]))
    return tiles


@pytest.mark.parametrize("block_m", [1, 16, 64])
def test_lists_only_useful_tiles(gen: torch.Generator, block_m: int) -> None:
    mapping = mapping_from_groups({-1: 50, 0: 1, 3: 16, 4: 17, 9: 130}, gen)
    meta = build_metadata(mapping, max_loras=10)
    wl = RowTileWorklist.allocate(mapping.numel(), meta.num_slots, "cpu", block_m)
    wl.update(meta)
    assert _listed(wl) == _expected_tiles(meta, block_m)


def test_vllm_layout_and_reuse_of_buffers(gen: torch.Generator) -> None:
    wl = RowTileWorklist.allocate(512, 33, "cpu")
    buffers = (wl.tile_lora, wl.tile_tokens, wl.num_tiles)
    ptrs = tuple(b.data_ptr() for b in buffers)
    for _ in range(30):
        m = int(torch.randint(1, 513, (1,), generator=gen))
        mapping = torch.randint(-1, 32, (m,), generator=gen, dtype=torch.int32)
        meta, _ = vllm_style_metadata(mapping, 32)
        wl.update(meta)
        assert _listed(wl) == _expected_tiles(meta, 16)
        assert tuple(b.data_ptr() for b in buffers) == ptrs


def test_capacity_covers_worst_case() -> None:
    # 33 groups of 17 rows: 2 tiles each, the most tiles 561 tokens over 33 slots can need.
    mapping = torch.arange(33, dtype=torch.int32).repeat_interleave(17)
    meta = build_metadata(mapping, 33)
    wl = RowTileWorklist.allocate(mapping.numel(), meta.num_slots, "cpu")
    wl.update(meta)
    assert int(wl.num_tiles) == 66 <= wl.capacity


def test_no_adapter_rows_give_an_empty_list() -> None:
    meta = build_metadata(torch.full((40,), -1, dtype=torch.int32), 4)
    wl = RowTileWorklist.allocate(40, meta.num_slots, "cpu")
    wl.update(meta)
    assert int(wl.num_tiles) == 0


def test_persistent_grid_off_cuda() -> None:
    assert persistent_programs("cpu") == PROGRAMS_PER_SM
    assert persistent_programs("cpu", 3) == 3


@pytest.mark.parametrize("block_m", [1, 16])
def test_host_tiles_write_the_device_list(gen: torch.Generator, block_m: int) -> None:
    capacity = RowTileWorklist.capacity_for(512, 33, block_m)
    block = torch.full((RowTileWorklist.block_size(capacity, block_m),), -7, dtype=torch.int32)  # poisoned
    host = RowTileWorklist.in_block(block, capacity, block_m)
    device = RowTileWorklist.allocate(512, 33, "cpu", block_m)
    for _ in range(20):
        m = int(torch.randint(1, 513, (1,), generator=gen))
        mapping = torch.randint(-1, 32, (m,), generator=gen, dtype=torch.int32)
        meta, _ = vllm_style_metadata(mapping, 32)
        device.update(meta)
        n = host_tiles(meta.num_tokens_per_slot.numpy(), meta.slot_lora_ids.numpy(), meta.slot_start_loc.numpy(),
                       meta.token_indices_sorted.numpy(), block_m, block.numpy())
        assert n == int(host.num_tiles) == int(device.num_tiles)
        assert _listed(host) == _listed(device) == _expected_tiles(meta, block_m)


def test_a_list_too_small_for_the_batch_is_refused_before_any_work(gen: torch.Generator) -> None:
    mapping = mapping_from_groups({0: 40, 1: 40, 2: 40}, gen)
    meta = build_metadata(mapping, 3)
    wl = RowTileWorklist.allocate(32, meta.num_slots, "cpu")  # sized for 32 tokens, the batch has 120
    before = wl.tile_lora.clone()
    with pytest.raises(ValueError, match="RowTileWorklist holds 6 tiles but a batch of 120 tokens"):
        wl.update(meta)
    assert torch.equal(wl.tile_lora, before)
    with pytest.raises(TypeError, match="num_tokens_per_slot must be int32"):
        RowTileWorklist.allocate(120, meta.num_slots, "cpu").update(
            LoRABatchMeta(meta.token_lora_mapping, meta.token_indices_sorted, meta.num_tokens_per_slot.long(),
                          meta.slot_start_loc, meta.slot_lora_ids))
