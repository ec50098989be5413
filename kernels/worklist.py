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
"""
from __future__ import annotations

from dataclasses import dataclass

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
        capacity = max_tokens // block_m + max_slots

        def buffer() -> torch.Tensor:
            return torch.zeros(capacity, dtype=torch.int32, device=device)

        return cls(block_m=block_m, tile_lora=buffer(), tile_first=buffer(), tile_rows=buffer(),
                   num_tiles=torch.zeros(1, dtype=torch.int32, device=device),
                   positions=torch.arange(capacity, dtype=torch.int64, device=device))

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


def persistent_programs(device: torch.device | str, programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """Grid size of the persistent kernels: a multiple of the SM count, independent of the batch.

    Off CUDA (the Triton interpreter) it is `programs_per_sm`, enough to exercise the striding.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return programs_per_sm
    return torch.cuda.get_device_properties(device).multi_processor_count * programs_per_sm
