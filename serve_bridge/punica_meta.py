"""GridTrim's per-step punica metadata, built on the host with numpy and uploaded in two copies.

:class:`HostPunicaMetadata` computes what vLLM's ``PunicaWrapperGPU.update_metadata`` computes once
per step (the token → slot mapping, the sampler's indices, the kernels' ``LoRAKernelMeta`` for
tokens and for the sampler) and both GridTrim work lists, from the step's mapping, without device
ops or host syncs, and uploads them with two non-blocking copies from pinned memory (one int64
block, one int32 block). At construction it rebinds vLLM's buffers and the work lists to views of
those blocks, before any CUDA graph captures their addresses, so vLLM's stock kernels and ours
read the same tensors. The values are vLLM's (``tests/serve_bridge/test_punica_meta.py`` restates
vLLM's functions), except that whole buffers are written and a step without adapter rows also
writes ``token_lora_mapping`` and an identity order, which nothing reads
(docs/vllm_integration.md §5).
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from lora_kernels.worklist import RowTileWorklist, host_tiles


_UNKNOWN = -2  # a lookup-table entry for an adapter id > 0 without a slot
_MAX_TABLE = 1 << 20  # adapter ids up to this use a lookup table, larger ones a binary search


def slot_lookup(lora_index_to_id: Sequence[int | None]) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """The inverse of ``lora_index_to_id`` (slot → adapter id or None), as ``convert_mapping`` builds
    it, for :func:`slot_indices`: a table indexed by id (-1 at 0, the slot of each
    id, ``_UNKNOWN`` elsewhere) when the ids are small, else (ids, their slots) sorted by id."""
    slots = np.array([i for i, x in enumerate(lora_index_to_id) if x is not None], dtype=np.int64)
    ids = np.array([lora_index_to_id[i] for i in slots], dtype=np.int64)
    if ids.size == 0 or ids.max() <= _MAX_TABLE:
        table = np.full(int(ids.max(initial=0)) + 2, _UNKNOWN, dtype=np.int64)
        table[0] = -1
        table[ids] = slots
        return table
    order = np.argsort(ids, kind="stable")
    return ids[order], slots[order]


def slot_indices(ids: np.ndarray, lookup: np.ndarray | tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """``convert_mapping``'s per-token lookup with a :func:`slot_lookup`: an
    adapter id > 0 becomes its slot, any other id -1. An id > 0 without a slot raises KeyError, as
    vLLM's dict lookup does."""
    if isinstance(lookup, np.ndarray):
        # ids ≤ 0 clip to entry 0 (-1); ids past the table to its last entry, which no slot holds
        out = lookup.take(np.maximum(ids, 0), mode="clip")
        if (out == _UNKNOWN).any():
            raise KeyError(int(ids[out == _UNKNOWN][0]))
        return out
    out = np.full(ids.shape, -1, dtype=np.int64)
    wanted = ids > 0
    known, slots = lookup
    asked = ids[wanted]
    at = np.minimum(np.searchsorted(known, asked), known.size - 1)
    hit = known[at] == asked
    if not hit.all():
        raise KeyError(int(asked[~hit][0]))
    out[wanted] = slots[at]
    return out


class _KernelMetaBlock:
    """One ``LoRAKernelMeta``'s device buffers as views of a slice of the int32 block, its host
    twins in the pinned block, and its work list after them."""

    def __init__(self, meta: Any, device_block: torch.Tensor, host_block: np.ndarray, block_m: int) -> None:
        sizes = self.sizes(meta, block_m)
        self.block_m, self.captured = block_m, list(meta.captured_lora_counts)
        (meta.token_lora_mapping, meta.token_indices_sorted_by_lora_ids, meta.active_lora_ids,
         meta.num_tokens_per_lora, meta.lora_token_start_loc, tiles) = device_block.split(sizes)
        self.worklist = RowTileWorklist.in_block(tiles, RowTileWorklist.capacity_for(sizes[0], sizes[2], block_m),
                                                 block_m)
        (self.mapping, self.order, self.active, self.counts, self.starts,
         self.tiles) = np.split(host_block, np.cumsum(sizes)[:-1])
        self.no_lora_flag = meta.no_lora_flag_cpu.numpy()
        self.num_active = meta.num_active_loras_cpu.numpy()

    @staticmethod
    def sizes(meta: Any, block_m: int) -> list[int]:
        """Entries of each part of the block: mapping and order [T], slot ids and counts [S], start
        offsets [S+1], then the work list (T tokens, S slots: ``LoRAKernelMeta.make``'s sizes)."""
        t, s = meta.token_lora_mapping.numel(), meta.active_lora_ids.numel()
        return [t, t, s, s, s + 1, RowTileWorklist.block_size(RowTileWorklist.capacity_for(t, s, block_m), block_m)]

    def write(self, indices: np.ndarray) -> None:
        """``prepare_tensors(indices)`` (slot index per token, -1 = none) into the host block, and the
        work list for it (``lora_kernels.worklist.host_tiles``)."""
        n = indices.size
        self.active.fill(-1)
        self.counts.fill(0)
        self.starts.fill(0)
        self.mapping[:n] = indices
        no_lora = not (indices != -1).any()
        self.no_lora_flag[0] = no_lora
        if no_lora:
            self.order[:n] = np.arange(n)
            self.num_active[0] = 0
        else:
            # A stable sort by slot, as torch.sort(stable=True); int16 (slots < 2^15) takes numpy's radix sort.
            self.order[:n] = np.argsort(indices.astype(np.int16), kind="stable")
            per_slot = np.bincount(indices + 1)
            present = np.flatnonzero(per_slot)  # torch.unique(sorted=True, return_counts=True)
            u = present.size
            self.active[:u] = present - 1
            self.counts[:u] = per_slot[present]
            self.starts[1:1 + u] = np.cumsum(per_slot[present])
            at = bisect.bisect_left(self.captured, u)  # rounded up to a captured count, as vLLM does
            self.num_active[0] = self.captured[at] if self.captured and at < len(self.captured) else u
        host_tiles(self.counts, self.active, self.starts, self.order, self.block_m, self.tiles)


class HostPunicaMetadata:
    """The metadata of a ``PunicaWrapperGPU`` (``wrapper``), rebuilt per step on the host.

    ``worklists`` are the token and sampler work lists (views of the uploaded block) that GridTrim's
    kernels walk. Call :meth:`update` where vLLM calls ``update_metadata``.
    """

    def __init__(self, wrapper: Any, block_m: int = 16) -> None:
        device = wrapper._token_lora_indices.device
        t = wrapper._token_lora_indices.numel()  # max_num_batched_tokens
        pin = device.type == "cuda"
        self._long_device = torch.empty(5 * t, dtype=torch.int64, device=device)
        self._long_host = torch.zeros(5 * t, dtype=torch.int64, pin_memory=pin)
        # vLLM 0.26 allocates _embeddings_indices as [2, T] (an extra-vocabulary row, then the
        # LoRA row), vLLM 0.33 as [T] (the LoRA row alone): keep the layout vLLM allocated.
        shape = tuple(wrapper._embeddings_indices.shape)
        (wrapper._token_lora_indices, wrapper._sampler_indices, wrapper._sampler_indices_padded,
         embeddings) = self._long_device.split([t, t, t, 2 * t])
        rows = shape[0] if len(shape) == 2 else 1
        wrapper._embeddings_indices = embeddings[:rows * t].view(shape)
        # the host twins of those four buffers, views of the pinned block
        self._token_indices, self._sampler_indices, self._sampler_padded, host_embeddings = \
            np.split(self._long_host.numpy(), [t, 2 * t, 3 * t])
        self._embeddings = host_embeddings[:rows * t].reshape(rows, t)
        metas = (wrapper.token_mapping_meta, wrapper.prompt_mapping_meta)
        sizes = [sum(_KernelMetaBlock.sizes(m, block_m)) for m in metas]
        self._int_device = torch.empty(sum(sizes), dtype=torch.int32, device=device)
        self._int_host = torch.zeros(sum(sizes), dtype=torch.int32, pin_memory=pin)
        host_blocks = np.split(self._int_host.numpy(), np.cumsum(sizes)[:-1])
        self._blocks = [_KernelMetaBlock(m, d, h, block_m)
                        for m, d, h in zip(metas, self._int_device.split(sizes), host_blocks)]
        self.worklists = tuple(b.worklist for b in self._blocks)
        self._wrapper = wrapper
        self._uploaded = torch.cuda.Event() if pin else None
        self._lookup: tuple[tuple[int | None, ...], np.ndarray | tuple[np.ndarray, np.ndarray]] | None = None

    def update(self, index_mapping: Sequence[int], prompt_mapping: Sequence[int],
               lora_index_to_id: Sequence[int | None], max_loras: int, vocab_size: int) -> None:
        """What ``update_metadata(mapping, lora_index_to_id, max_loras, vocab_size)`` writes
        (``max_loras`` is the slot count + 1),
        for ``mapping.index_mapping`` / ``mapping.prompt_mapping``. The copies are queued on the
        current stream; the host blocks are reused only once the previous copy has run."""
        capacity, slots = self._token_indices.size, self._blocks[0].active.size
        if len(index_mapping) > capacity or len(prompt_mapping) > capacity:
            raise ValueError(f"HostPunicaMetadata.update: index_mapping ({len(index_mapping)}) and prompt_mapping "
                             f"({len(prompt_mapping)}) must fit the wrapper's {capacity} token rows")
        if len(lora_index_to_id) >= slots:
            raise ValueError(f"HostPunicaMetadata.update: lora_index_to_id has {len(lora_index_to_id)} slots; the "
                             f"kernel metadata holds at most {slots - 1} adapters")
        if self._uploaded is not None:
            self._uploaded.synchronize()
        key = tuple(lora_index_to_id)
        if self._lookup is None or self._lookup[0] != key:
            self._lookup = (key, slot_lookup(key))
        lookup = self._lookup[1]
        tokens = slot_indices(np.fromiter(index_mapping, np.int64, len(index_mapping)), lookup)
        sampler = slot_indices(np.fromiter(prompt_mapping, np.int64, len(prompt_mapping)), lookup)
        n, m = tokens.size, sampler.size
        self._token_indices[:n] = tokens
        self._sampler_indices[:m] = sampler
        self._sampler_padded[:m] = np.arange(m) + np.where(sampler == -1, max_loras - 1, sampler) * m
        # _embeddings_indices' last row is the slot × vocabulary size, slot 0 for tokens without an
        # adapter; vLLM 0.26's first row is the slot × extra vocabulary size, 0 since 0.26 dropped
        # extra vocabularies. Neither can be -1, so 0.26's -1 replacement changes nothing.
        self._embeddings[:-1, :n] = 0
        self._embeddings[-1, :n] = np.maximum(tokens, 0) * vocab_size
        self._wrapper.indices_len[:] = [n, m, m, n]
        self._blocks[0].write(tokens)
        self._blocks[1].write(sampler)
        self._long_device.copy_(self._long_host, non_blocking=True)
        self._int_device.copy_(self._int_host, non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record()
