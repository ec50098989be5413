"""Device-built list of useful row tiles for the persistent launch (our design).

A row tile is `block_m` consecutive tokens of one slot's group. The list holds only tiles of
slots with an adapter and at least one token, so a kernel that walks it launches no idle work:
item i of a kernel is (tile i // inner, sub-item i % inner), where `inner` enumerates slices and
hidden chunks (shrink) or output column chunks (expand). Each tile is stored resolved: its
adapter id and its token indices themselves (padded with -1), so a kernel has everything it needs
to start streaming weights and activations after one round of independent loads, not a chain of
two (record, then `token_indices_sorted`).

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

from lora_kernels.metadata import LoRABatchMeta

PROGRAMS_PER_SM = 16  # fastest of 2..24 on the H200 (benchmarks/results/2026-11-30-kernels.md, 2026-11-30)


@dataclass(frozen=True)
class RowTileWorklist:
    """Static buffers: for i < num_tiles[0], tile i is the tokens `tile_tokens[i, :r]` (1 ≤ r ≤
    block_m; the rest of the row is -1), consecutive entries of `token_indices_sorted`, all mapped
    to adapter `tile_lora[i]`. Entries past `num_tiles` are garbage."""

    block_m: int
    tile_lora: torch.Tensor
    tile_tokens: torch.Tensor
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
        block = torch.zeros(cls.block_size(capacity, block_m), dtype=torch.int32, device=device)
        return cls.in_block(block, capacity, block_m)

    @staticmethod
    def capacity_for(max_tokens: int, max_slots: int, block_m: int = 16) -> int:
        """Tile entries that any batch of ≤ `max_tokens` tokens over ≤ `max_slots` slots needs."""
        return max_tokens // block_m + max_slots

    @classmethod
    def in_block(cls, block: torch.Tensor, capacity: int, block_m: int = 16) -> RowTileWorklist:
        """Buffers that are views of `block` (int32, `block_size(capacity, block_m)` entries, laid
        out as `host_tiles` writes them: tile_lora, tile_tokens row by row, then num_tiles)."""
        if block.dtype != torch.int32 or block.dim() != 1:
            raise TypeError(f"RowTileWorklist.in_block: block must be a 1-D int32 tensor, got {block.dtype} "
                            f"of shape {tuple(block.shape)}")
        if block_m < 1 or capacity < 0 or block.numel() != cls.block_size(capacity, block_m):
            raise ValueError(f"RowTileWorklist.in_block: block has {block.numel()} entries, capacity={capacity} "
                             f"tiles of block_m={block_m} need {cls.block_size(capacity, block_m)}")
        tile_lora, tile_tokens, num_tiles = block.split([capacity, capacity * block_m, 1])
        return cls(block_m=block_m, tile_lora=tile_lora, tile_tokens=tile_tokens.view(capacity, block_m),
                   num_tiles=num_tiles, positions=torch.arange(capacity, dtype=torch.int64, device=block.device))

    @staticmethod
    def block_size(capacity: int, block_m: int = 16) -> int:
        """Entries of an `in_block` block for `capacity` tiles of `block_m` tokens."""
        return capacity * (1 + block_m) + 1

    @property
    def capacity(self) -> int:
        """Number of tile entries the buffers hold."""
        return self.positions.numel()

    def check(self, meta: LoRABatchMeta, num_tokens: int | None = None) -> None:
        """Raise ValueError/TypeError unless `meta` is well formed (`LoRABatchMeta.check`), on this
        list's device, and the list has room for every tile its tokens and slots can need
        (`capacity_for`); `num_tokens`: the batch's rows. Shapes only: no device sync."""
        meta.check(num_tokens)
        if meta.slot_lora_ids.device != self.tile_lora.device:
            raise ValueError(f"RowTileWorklist on {self.tile_lora.device}, metadata on {meta.slot_lora_ids.device}")
        needed = self.capacity_for(meta.token_lora_mapping.numel(), meta.num_slots, self.block_m)
        if self.capacity < needed:
            raise ValueError(f"RowTileWorklist holds {self.capacity} tiles but a batch of "
                             f"{meta.token_lora_mapping.numel()} tokens over {meta.num_slots} slots can need {needed}: "
                             f"allocate it with RowTileWorklist.allocate(max_tokens, max_slots)")

    def update(self, meta: LoRABatchMeta) -> None:
        """Rewrite the list in place for `meta` (device ops only, CUDA-graph capturable), after
        `check`ing that it fits. Tiles are ordered by slot, then by row offset within the slot.
        """
        self.check(meta)
        counts = meta.num_tokens_per_slot.to(torch.int64)
        active = meta.slot_lora_ids >= 0
        tiles = torch.where(active, (counts + self.block_m - 1) // self.block_m, 0)
        ends = torch.cumsum(tiles, 0)
        slot = torch.searchsorted(ends, self.positions, right=True).clamp_(max=ends.numel() - 1)
        row0 = (self.positions - (ends[slot] - tiles[slot])) * self.block_m
        self.tile_lora.copy_(meta.slot_lora_ids[slot])
        lanes = torch.arange(self.block_m, device=row0.device)
        order = meta.token_indices_sorted
        if order.numel() == 0:
            self.tile_tokens.fill_(-1)
        else:
            at = (meta.slot_start_loc[slot] + row0)[:, None] + lanes
            tokens = order[at.clamp_(0, order.numel() - 1)]
            self.tile_tokens.copy_(torch.where(lanes < (counts[slot] - row0)[:, None], tokens, -1))
        self.num_tiles.copy_(ends[-1:])


def host_tiles(num_tokens_per_slot: np.ndarray, slot_lora_ids: np.ndarray, slot_start_loc: np.ndarray,
               token_indices_sorted: np.ndarray, block_m: int, out: np.ndarray) -> int:
    """`RowTileWorklist.update` on the host: write the list for this metadata (numpy arrays, as in
    `LoRABatchMeta`) into `out`, an int32 array laid out as `RowTileWorklist.in_block`'s block.
    Tiles are ordered by slot, then by row offset; entries past the count keep old values (garbage,
    as on the device). Returns the number of tiles."""
    capacity = (out.size - 1) // (1 + block_m)
    if out.dtype != np.int32 or out.size != RowTileWorklist.block_size(capacity, block_m):
        raise ValueError(f"host_tiles: out must be an int32 block of block_size(capacity, {block_m}) entries, got "
                         f"{out.dtype} [{out.size}]")
    if not num_tokens_per_slot.size == slot_lora_ids.size == slot_start_loc.size - 1:
        raise ValueError(f"host_tiles: {slot_lora_ids.size} slot ids, {num_tokens_per_slot.size} counts and "
                         f"{slot_start_loc.size} start offsets (expected S, S, S+1)")
    counts = num_tokens_per_slot.astype(np.int64)
    tiles = np.where(slot_lora_ids >= 0, -(-counts // block_m), 0)
    total = int(tiles.sum())
    if total > capacity:
        raise ValueError(f"host_tiles: the batch needs {total} tiles but out holds {capacity}")
    slot = np.repeat(np.arange(tiles.size), tiles)
    row0 = (np.arange(total) - (np.cumsum(tiles) - tiles)[slot]) * block_m
    out[:total] = slot_lora_ids[slot]
    lanes = np.arange(block_m)
    at = (slot_start_loc[slot] + row0)[:, None] + lanes
    valid = lanes < (counts[slot] - row0)[:, None]
    tokens = out[capacity:capacity * (1 + block_m)].reshape(capacity, block_m)
    tokens[:total] = np.where(valid, token_indices_sorted[np.where(valid, at, 0)], -1)
    out[-1] = total
    return total


def persistent_programs(device: torch.device | str, programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """Grid size of the persistent kernels: a multiple of the SM count, independent of the batch.

    Off CUDA (the Triton interpreter) it is `programs_per_sm`, enough to exercise the striding.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return programs_per_sm
    return torch.cuda.get_device_properties(device).multi_processor_count * programs_per_sm
