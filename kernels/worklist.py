"""Device-built list of useful row tiles for the persistent launch (our design).

A row tile is `block_m` consecutive tokens of one slot's group. The list holds only tiles of
slots with an adapter and at least one token, so a kernel that walks it launches no idle work:
item i of a kernel is (tile i // inner, sub-item i % inner), where `inner` enumerates slices and
hidden chunks (shrink) or output column chunks (expand). Each tile is stored resolved (adapter
id, first position in `token_indices_sorted`, row count), so a kernel reaches its token indices
in two dependent loads.

`RowTileWorklist.update` is a few torch ops on the metadata's device, with no host sync and
static buffers, so it can be captured in the same CUDA graph as the step: one graph per batch
size serves every adapter mix. Kernels read `num_tiles` on device; their grid is fixed.
`host_tiles` is the same list built on the host with numpy, for a caller that already holds the
metadata there and uploads it (serve_bridge.punica_meta); its buffers are then views of one block
(`RowTileWorklist.in_block`), rewritten by one copy.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.metadata import LoRABatchMeta

PROGRAMS_PER_SM = 8  # fastest of 2/4/8 on the H200 (benchmarks/kernels/RESULTS.md)


@dataclass(frozen=True)
class RowTileWorklist:
    """Static buffers: for i < num_tiles[0], tile i is the tokens
    `token_indices_sorted[tile_first[i] : tile_first[i] + tile_rows[i]]` (1 ≤ tile_rows ≤
    block_m), all mapped to adapter `tile_lora[i]`. Entries past `num_tiles` are garbage."""

    block_m: int
    tile_lora: torch.Tensor
    tile_first: torch.Tensor
    tile_rows: torch.Tensor
    num_tiles: torch.Tensor
    positions: torch.Tensor

    @classmethod
    def allocate(cls, max_tokens: int, max_slots: int, device: torch.device | str,
                 block_m: int = 16) -> RowTileWorklist:
        """Buffers for any batch of ≤ `max_tokens` tokens over ≤ `max_slots` slots.

        A group of c tokens has ceil(c / block_m) ≤ floor(c / block_m) + 1 tiles, so
        `max_tokens // block_m + max_slots` entries always suffice.
        """
        capacity = cls.capacity_for(max_tokens, max_slots, block_m)
        block = torch.zeros(cls.block_size(capacity), dtype=torch.int32, device=device)
        return cls.in_block(block, capacity, block_m)

    @staticmethod
    def capacity_for(max_tokens: int, max_slots: int, block_m: int = 16) -> int:
        """Tile entries that any batch of ≤ `max_tokens` tokens over ≤ `max_slots` slots needs."""
        return max_tokens // block_m + max_slots

    @classmethod
    def in_block(cls, block: torch.Tensor, capacity: int, block_m: int = 16) -> RowTileWorklist:
        """Buffers that are views of `block` (int32, `block_size(capacity)` entries, laid out as
        `host_tiles` writes them: tile_lora, tile_first, tile_rows, then num_tiles)."""
        assert block.dtype == torch.int32 and block.numel() == cls.block_size(capacity)
        tile_lora, tile_first, tile_rows, num_tiles = block.split([capacity, capacity, capacity, 1])
        return cls(block_m=block_m, tile_lora=tile_lora, tile_first=tile_first, tile_rows=tile_rows,
                   num_tiles=num_tiles, positions=torch.arange(capacity, dtype=torch.int64, device=block.device))

    @staticmethod
    def block_size(capacity: int) -> int:
        """Entries of an `in_block` block for `capacity` tiles."""
        return 3 * capacity + 1

    @property
    def capacity(self) -> int:
        """Number of tile entries the buffers hold."""
        return self.positions.numel()

    def update(self, meta: LoRABatchMeta) -> None:
        """Rewrite the list in place for `meta` (device ops only, CUDA-graph capturable).

        Tiles are ordered by slot, then by row offset within the slot.
        """
        counts = meta.num_tokens_per_slot.to(torch.int64)
        active = meta.slot_lora_ids >= 0
        tiles = torch.where(active, (counts + self.block_m - 1) // self.block_m, 0)
        ends = torch.cumsum(tiles, 0)
        slot = torch.searchsorted(ends, self.positions, right=True).clamp_(max=ends.numel() - 1)
        row0 = (self.positions - (ends[slot] - tiles[slot])) * self.block_m
        self.tile_lora.copy_(meta.slot_lora_ids[slot])
        self.tile_first.copy_(meta.slot_start_loc[slot] + row0)
        self.tile_rows.copy_(torch.clamp(counts[slot] - row0, max=self.block_m))
        self.num_tiles.copy_(ends[-1:])


def host_tiles(num_tokens_per_slot: np.ndarray, slot_lora_ids: np.ndarray, slot_start_loc: np.ndarray,
               block_m: int, out: np.ndarray) -> int:
    """`RowTileWorklist.update` on the host: write the list for this metadata (numpy arrays, as in
    `LoRABatchMeta`) into `out`, an int32 array laid out as `RowTileWorklist.in_block`'s block.
    Tiles are ordered by slot, then by row offset; entries past the count keep old values (garbage,
    as on the device). Returns the number of tiles."""
    capacity = (out.size - 1) // 3
    counts = num_tokens_per_slot.astype(np.int64)
    tiles = np.where(slot_lora_ids >= 0, -(-counts // block_m), 0)
    total = int(tiles.sum())
    assert total <= capacity, f"{total} tiles exceed the list's {capacity} entries"
    slot = np.repeat(np.arange(tiles.size), tiles)
    row0 = (np.arange(total) - (np.cumsum(tiles) - tiles)[slot]) * block_m
    out[:total] = slot_lora_ids[slot]
    out[capacity:capacity + total] = slot_start_loc[slot] + row0
    out[2 * capacity:2 * capacity + total] = np.minimum(counts[slot] - row0, block_m)
    out[3 * capacity] = total
    return total


def persistent_programs(device: torch.device | str, programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """Grid size of the persistent kernels: a multiple of the SM count, independent of the batch.

    Off CUDA (the Triton interpreter) it is `programs_per_sm`, enough to exercise the striding.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return programs_per_sm
    return torch.cuda.get_device_properties(device).multi_processor_count * programs_per_sm
