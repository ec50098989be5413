"""A KV cache for batched decoding that appends in place and moves only the rows that change.

Semantics: :func:`row_cache` returns a transformers ``Cache`` that holds, per layer, exactly what
``DynamicCache`` holds (keys and values ``[rows, heads, length, head_dim]``, the new states appended
along the length) and hands the model the same values. It stores them in buffers with spare rows and
spare length, so a decode step writes its one new position in place, and :func:`select_rows` (keep
rows ``index``, in that order, repeats allowed) copies only the rows whose position changes. Both
copies are what ``DynamicCache`` pays in full at every step (concatenation) and every gather: on one
CPU thread, a quarter to a third of the hf engine's time on the demo's forked batches (2026-12-03).
:func:`stable_order` gives the hf engine a row order that changes few positions.
"""
from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
from transformers.cache_utils import Cache, DynamicLayer

SPARE = 64  # positions kept free after each (re)allocation: a whole short response without a copy


class _SpareLayer(DynamicLayer):
    """A ``DynamicLayer`` whose ``keys``/``values`` are views of buffers with spare rows and length;
    the first buffers have room for ``length_hint`` positions."""

    def __init__(self, length_hint: int = 0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.length_hint = length_hint

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._k = self._v = None
        self._rows = self._n = 0

    def _view(self) -> None:
        self.keys, self.values = self._k[:self._rows, :, :self._n], self._v[:self._rows, :, :self._n]

    def _grow(self, rows: int, length: int, like: torch.Tensor) -> None:
        """Buffers for at least ``rows`` × ``length`` (heads, head size, dtype and device of ``like``),
        keeping what is stored."""
        if self._k is not None and rows <= self._k.shape[0] and length <= self._k.shape[2]:
            return
        shape = (2 * max(rows, self._rows), like.shape[1], max(length + SPARE, self.length_hint), like.shape[3])
        k, v = like.new_empty(shape), like.new_empty(shape)
        if self._k is not None:
            k[:self._rows, :, :self._n] = self.keys
            v[:self._rows, :, :self._n] = self.values
        self._k, self._v = k, v

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, m = self._n, self._n + key_states.shape[-2]
        self._grow(key_states.shape[0], m, key_states)
        self._k[:key_states.shape[0], :, n:m] = key_states
        self._v[:value_states.shape[0], :, n:m] = value_states
        self._rows, self._n = key_states.shape[0], m
        self._view()
        return self.keys, self.values

    def select_rows(self, index: torch.Tensor) -> None:
        if not self.is_initialized or self._k is None:
            return
        self._grow(len(index), self._n, self._k)
        moved = (index != torch.arange(len(index), device=index.device)).nonzero().flatten()
        if moved.numel():
            src = index[moved]
            self._k[moved, :, :self._n] = self._k[src, :, :self._n]
            self._v[moved, :, :self._n] = self._v[src, :, :self._n]
        self._rows = len(index)
        self._view()


def row_cache(length_hint: int = 0) -> Cache:
    """An empty cache of :class:`_SpareLayer` layers, one appended per model layer on first use, each
    allocating room for ``length_hint`` positions at first (the most a batch can reach)."""
    return Cache(layer_class_to_replicate=partial(_SpareLayer, length_hint=length_hint))


def select_rows(cache: Cache, index: torch.Tensor) -> None:
    """Keep rows ``index`` (in that order, repeats allowed) of every layer of ``cache``, in place."""
    for layer in cache.layers:
        layer.select_rows(index)


def stable_order(n: int, keep: Sequence[int]) -> list[int]:
    """The positions of ``keep`` (ascending row positions of a batch of ``n`` rows) in a new batch of
    ``len(keep)`` rows that moves fewest rows: kept rows stay where they are, and the kept rows beyond
    the new end fill the positions of the rows that left. ``out[i]`` is the old position of new row i."""
    m, kept = len(keep), set(keep)
    out = list(range(m))
    holes = [i for i in range(m) if i not in kept]
    movers = [j for j in keep if j >= m]
    for hole, j in zip(holes, movers):
        out[hole] = j
    return out
