"""The hf engine's KV cache (labeling/engines/kv_cache.py) against transformers' DynamicCache, on
fresh random states: the same keys and values after any sequence of appends and row selections."""
from __future__ import annotations

import random

import pytest
import torch
from transformers import DynamicCache

from labeling.engines.kv_cache import row_cache, select_rows, stable_order


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_appends_and_row_selections_equal_dynamic_cache(seed):
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    ours, ref = row_cache(length_hint=rng.choice([0, 40])), DynamicCache()
    rows, moved_rows = 5, 0
    for step in range(40):
        n = 9 if step == 0 else rng.choice([1, 1, 1, 7])  # a prefill, then mostly one position each
        for layer in range(2):
            k, v = torch.randn(rows, 3, n, 4, generator=g), torch.randn(rows, 3, n, 4, generator=g)
            got, want = ours.update(k, v, layer), ref.update(k.clone(), v.clone(), layer)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), step
        keep = sorted(rng.sample(range(rows), rng.randint(1, rows)))
        index = stable_order(rows, keep) + [rng.choice(keep) for _ in range(rng.randint(0, 4))]
        moved_rows += sum(i != j for i, j in enumerate(index))
        select_rows(ours, torch.tensor(index))
        for layer in ref.layers:
            layer.keys, layer.values = layer.keys[index], layer.values[index]
        rows = len(index)
    assert moved_rows > 0 and ours.get_seq_length() == ref.get_seq_length() > 40


@pytest.mark.parametrize("seed", range(5))
def test_stable_order_keeps_rows_in_place_and_fills_gaps_from_the_end(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 30)
    keep = sorted(rng.sample(range(n), rng.randint(0, n)))
    order = stable_order(n, keep)
    assert sorted(order) == keep  # every kept row once
    m = len(keep)
    assert all(order[i] == i for i in keep if i < m)  # a kept row inside the new batch does not move
    assert sum(order[i] != i for i in range(m)) == sum(j >= m for j in keep)  # only rows past the end move
