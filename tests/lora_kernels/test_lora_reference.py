"""The torch references match a per-token loop of the documented semantics."""
from __future__ import annotations

import pytest
import torch
from conftest import mapping_from_groups

from lora_kernels.layout import as_3d, num_splits, partials_buffer
from lora_kernels.reference import expand_reference, shrink_reference


def _weights(gen: torch.Generator, loras: int, rank: int, k: int, widths: list[int],
             dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    a = [torch.randn(loras, 1, rank, k, generator=gen).to(dtype) for _ in widths]
    b = [torch.randn(loras, n, rank, generator=gen).to(dtype) for n in widths]
    return a, b


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_shrink_and_expand_follow_per_token_loop(gen: torch.Generator, dtype: torch.dtype) -> None:
    widths, rank, k, offset = [12, 4, 4], 8, 24, 3
    a, b = _weights(gen, 5, rank, k, widths, dtype)
    mapping = mapping_from_groups({-1: 3, 0: 2, 4: 5}, gen)
    x = torch.randn(mapping.numel(), k, generator=gen).to(dtype)
    y = torch.randn(mapping.numel(), offset + sum(widths) + 2, generator=gen).to(dtype)
    inter = shrink_reference(x, a, mapping, scale=0.5)
    for add_inputs in (True, False):
        out = expand_reference(inter, b, y, mapping, offset_start=offset, add_inputs=add_inputs)
        for m, lora in enumerate(mapping.tolist()):
            if lora < 0:
                assert torch.equal(inter[:, m], torch.zeros_like(inter[:, m]))
                assert torch.equal(out[m], y[m])
                continue
            col = offset
            for s, n in enumerate(widths):
                h = 0.5 * (x[m].float() @ a[s][lora, 0].float().T)
                torch.testing.assert_close(inter[s, m], h)
                # vLLM's rounding: the product rounded to y's dtype, then the sum rounded again
                want = (h.to(dtype).float() @ b[s][lora].float().T).to(dtype)
                if add_inputs:
                    want = (want.float() + y[m, col:col + n].float()).to(dtype)
                assert torch.equal(out[m, col:col + n], want)
                col += n
            assert torch.equal(out[m, :offset], y[m, :offset])
            assert torch.equal(out[m, col:], y[m, col:])


def test_layout_helpers() -> None:
    w = torch.zeros(3, 1, 8, 40)
    assert as_3d(w).shape == (3, 8, 40) and as_3d(as_3d(w)).shape == (3, 8, 40)
    with pytest.raises(ValueError, match="dim 1 must be 1"):
        as_3d(torch.zeros(3, 2, 8, 40))
    assert [num_splits(k) for k in (576, 1024, 1025, 3072, 14336)] == [1, 1, 2, 3, 14]
    assert partials_buffer(3, 10, 8, 3072, "cpu").shape == (3, 3, 10, 8)
