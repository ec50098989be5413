"""Release-position masking of a token→LoRA mapping, and the kernel group count."""
from __future__ import annotations

import numpy as np
import pytest

from serve_bridge.runtime import NEVER, RequestState, lora_group_count, mask_released
from serve_bridge.steptrim import NO_SLOT


def test_decode_rows_mask_only_released_requests():
    # three decode rows at positions 10, 20, 30; request 1 released at position 20.
    tokens, sampled = mask_released(np.array([3, 4, 5]), np.array([3, 4, 5]), np.array([10, 20, 30]),
                                    np.array([1, 1, 1]), np.array([NEVER, 20, 31]))
    assert tokens.tolist() == [3, 0, 5] and sampled.tolist() == [3, 0, 5]


def test_chunk_straddling_release_position_is_split_there():
    # one request scheduling positions 6..11 (a recompute chunk), released from position 9 on.
    tokens, sampled = mask_released(np.full(6, 7), np.array([7]), np.array([6]), np.array([6]), np.array([9]))
    assert tokens.tolist() == [7, 7, 7, 0, 0, 0] and sampled.tolist() == [0]


def test_mixed_batch_prefill_chunk_and_decodes():
    lora = np.array([1] * 4 + [2] + [3] * 3)
    tokens, sampled = mask_released(lora, np.array([1, 2, 3]), np.array([0, 50, 8]), np.array([4, 1, 3]),
                                    np.array([NEVER, 40, 10]))
    assert tokens.tolist() == [1, 1, 1, 1, 0, 3, 3, 0]
    assert sampled.tolist() == [1, 0, 0]
    assert lora.tolist() == [1] * 4 + [2] + [3] * 3  # the input is not modified


def test_size_mismatch_is_an_error():
    with pytest.raises(ValueError, match="do not match the schedule"):
        mask_released(np.array([1, 1]), np.array([1]), np.array([0]), np.array([3]), np.array([NEVER]))


@pytest.mark.parametrize("release", [0, 1, 3, None])
def test_forward_t_runs_with_adapter_iff_t_le_r(release):
    """Walk one request through prefill and decodes: the forward's sampled position has
    the adapter exactly at t ≤ r (docs/design.md §2), and every earlier position keeps it."""
    P, L = 5, 7
    st = RequestState(adapter="a", slot=0, num_prompt_tokens=P, release=release)
    for t in range(L):
        c, n = (0, P) if t == 0 else (P + t - 1, 1)
        tokens, sampled = mask_released(np.full(n, 9), np.array([9]), np.array([c]), np.array([n]),
                                        np.array([st.release_position]))
        with_adapter = release is None or t <= release
        assert sampled.tolist() == [9 if with_adapter else 0]
        assert tokens.tolist() == [9 if (release is None or c + q < P + release) else 0 for q in range(n)]
    # a full recompute after generating L tokens masks exactly the positions decoded after release
    tokens, _ = mask_released(np.full(P + L - 1, 9), np.array([9]), np.array([0]), np.array([P + L - 1]),
                              np.array([st.release_position]))
    expected = P + L - 1 if release is None else P + release
    assert int((tokens == 9).sum()) == expected


def test_release_position_of_state():
    assert RequestState("a", 0, 12).release_position == NEVER
    assert RequestState("a", 0, 12, release=0).release_position == 12
    assert RequestState(None, NO_SLOT, 12, release=4).release_position == 16


def test_group_count_includes_no_adapter_group():
    assert lora_group_count(np.array([1, 1, 2, 2])) == 2
    assert lora_group_count(np.array([1, 0, 2, 0])) == 3  # released rows are a group of their own
    assert lora_group_count(np.array([0, 0])) == 0  # no adapter at all: no LoRA kernels
    assert lora_group_count(np.array([], dtype=np.int64)) == 0
