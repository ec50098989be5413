"""The overlap benchmark's batches are what their labels say (the benchmark itself needs a GPU)."""
import re

import torch

from benchmarks.kernels import bench_overlap
from benchmarks.kernels.bench_lora_ops import MAX_LORAS, MAX_TOKENS


def test_label_counts_groups_by_size():
    assert bench_overlap.label("mixed", {-1: 2, 0: 1792} | {i: 2 for i in range(1, 128)}) == \
        "mixed 2048 rows, 1792 + 127 x 2"
    assert bench_overlap.label("decode", {i: 2 for i in range(32)}) == "decode 64 rows, 32 x 2"


def test_batches_match_their_labels():
    batches = bench_overlap.batches(torch.Generator().manual_seed(0))
    assert len(batches) == 5
    for name, mapping in batches.items():
        rows = int(re.search(r"(\d+) rows", name).group(1))
        assert mapping.numel() == rows <= MAX_TOKENS
        ids, counts = torch.unique(mapping[mapping >= 0], return_counts=True)
        assert int(ids.max()) < MAX_LORAS
        want = []
        for term in name.split(", ", 1)[1].split(" + "):
            n, _, size = term.partition(" x ")
            want += [int(size)] * int(n) if size else [int(n)]
        assert sorted(counts.tolist()) == sorted(want)
