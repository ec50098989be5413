"""serve_bridge.punica_meta against a restatement of what vLLM 0.26.0's and 0.33.0's
``PunicaWrapperGPU.update_metadata`` write: ``convert_mapping`` (``lora/punica_wrapper/
utils.py:54-160`` in 0.26, :53-140 in 0.33, here) into the base buffers (``punica_base.py:168-202``) and
``LoRAKernelMeta.prepare_tensors`` (``lora/ops/triton_ops/lora_kernel_metadata.py:109-168``,
test_gridtrim's ``VllmKernelMeta``) for the token and the sampler mappings, on fresh random
mappings, over buffers that start stale."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lora_kernels.metadata import LoRABatchMeta
from lora_kernels.worklist import RowTileWorklist
from serve_bridge.punica_meta import HostPunicaMetadata
from tests.serve_bridge.test_gridtrim import DEVICE, VllmKernelMeta

T, SLOTS, VOCAB = 256, 8, 1000  # max_num_batched_tokens, lora_config.max_loras, vocabulary


def wrapper(captured: list[int], vllm: str = "0.26.0") -> SimpleNamespace:
    """PunicaWrapperGPU's metadata attributes (punica_base.py:138-154, punica_gpu.py:55-73), stale;
    ``_embeddings_indices`` is [2, T] in vLLM 0.26 and [T] in 0.33 (punica_base.py:142)."""
    def buf(*shape: int) -> torch.Tensor:
        return torch.full(shape, 9999, dtype=torch.long, device=DEVICE)
    embeddings = buf(2, T) if vllm == "0.26.0" else buf(T)
    return SimpleNamespace(_token_lora_indices=buf(T), _sampler_indices=buf(T), _sampler_indices_padded=buf(T),
                           _embeddings_indices=embeddings, indices_len=[None] * 4,
                           token_mapping_meta=VllmKernelMeta(SLOTS, T, captured),
                           prompt_mapping_meta=VllmKernelMeta(SLOTS, T, captured))


def convert_mapping(index_mapping, prompt_mapping, lora_index_to_id, max_loras, vocab_size, vllm="0.26.0"):
    """vLLM's convert_mapping, restated: 0.26's (utils.py:54-160) with extra_vocab_size = 0, whose
    embeddings indices are [extra-vocabulary row, LoRA row] with -1 replaced; 0.33's
    (utils.py:53-140), whose embeddings indices are the LoRA row alone (utils.py:123)."""
    slot = {lora_id: i for i, lora_id in enumerate(lora_index_to_id) if lora_id is not None}
    lora = torch.tensor([slot[x] if x > 0 else -1 for x in index_mapping], dtype=torch.long)
    emb = torch.tensor([slot[x] if x > 0 else 0 for x in index_mapping], dtype=torch.long)
    sampler = torch.tensor([slot[x] if x > 0 else -1 for x in prompt_mapping], dtype=torch.long)
    if vllm == "0.26.0":
        embeddings = torch.stack([emb * 0, emb * vocab_size])
        embeddings = torch.where(embeddings == -1, max_loras - 1, embeddings)
    else:
        embeddings = emb * vocab_size
    padded = torch.where(sampler == -1, max_loras - 1, sampler)
    padded = torch.arange(len(padded)) + padded * len(padded)
    return lora, sampler, padded, embeddings


def assert_kernel_meta(meta: VllmKernelMeta, mapping: torch.Tensor, captured: list[int],
                       worklist: RowTileWorklist) -> None:
    """``meta`` holds what vLLM's prepare_tensors(mapping) leaves (the restatement's buffers), and
    ``worklist`` what RowTileWorklist.update builds from it."""
    want, n = VllmKernelMeta(SLOTS, T, captured), mapping.numel()
    want.prepare(mapping.to(DEVICE, torch.int32))
    assert bool(meta.no_lora_flag_cpu[0]) == bool(want.no_lora_flag_cpu[0])
    assert int(meta.num_active_loras_cpu[0]) == int(want.num_active_loras_cpu[0])
    for name in ("active_lora_ids", "num_tokens_per_lora", "lora_token_start_loc"):
        assert torch.equal(getattr(meta, name), getattr(want, name)), name
    if not want.no_lora_flag_cpu[0]:  # vLLM leaves these two stale on a step without adapter rows
        for name in ("token_lora_mapping", "token_indices_sorted_by_lora_ids"):
            assert torch.equal(getattr(meta, name)[:n], getattr(want, name)[:n]), name
    ref = RowTileWorklist.allocate(T, SLOTS + 1, DEVICE, worklist.block_m)
    ref.update(LoRABatchMeta.from_vllm_meta_args(want.meta_args(n)))
    k = int(ref.num_tiles)
    assert int(worklist.num_tiles) == k
    for name in ("tile_lora", "tile_tokens"):
        assert torch.equal(getattr(worklist, name)[:k], getattr(ref, name)[:k]), name


def random_step(gen: np.random.Generator, lora_index_to_id: list[int | None], n: int, m: int,
                no_adapter: float) -> tuple[tuple[int, ...], tuple[int, ...]]:
    ids = [x for x in lora_index_to_id if x is not None]
    def draw(k: int) -> tuple[int, ...]:
        picks = gen.choice(ids, size=k)
        return tuple(int(x) for x in np.where(gen.random(k) < no_adapter, 0, picks))
    return draw(n), draw(m)


@pytest.mark.parametrize("vllm", ["0.26.0", "0.33.0"])
@pytest.mark.parametrize("captured, max_id", [([], 10**6), ([1, 2, 4, 8, 9], 10**6), ([], 10**12)])
def test_update_writes_what_vllm_writes(captured, max_id, vllm):
    """Ids up to 10**6 take the lookup table, larger ones the binary search."""
    gen = np.random.default_rng(0)
    w = wrapper(captured, vllm)
    host = HostPunicaMetadata(w)
    token_list, prompt_list = host.worklists
    # adapter ids are arbitrary positive ints; two slots are empty
    lora_index_to_id = [int(x) for x in gen.choice(max_id, size=SLOTS, replace=False) + 1]
    lora_index_to_id[2] = lora_index_to_id[5] = None
    for n, m, no_adapter in [(T, 64, 0.3), (37, 37, 0.0), (200, 5, 0.9), (T, T, 1.0), (1, 1, 0.0), (150, 40, 0.5)]:
        index_mapping, prompt_mapping = random_step(gen, lora_index_to_id, n, m, no_adapter)
        host.update(index_mapping, prompt_mapping, lora_index_to_id, SLOTS + 1, VOCAB)
        lora, sampler, padded, embeddings = convert_mapping(index_mapping, prompt_mapping, lora_index_to_id,
                                                            SLOTS + 1, VOCAB, vllm)
        assert w.indices_len == [n, m, m, n]
        assert torch.equal(w._token_lora_indices[:n].cpu(), lora)
        assert torch.equal(w._sampler_indices[:m].cpu(), sampler)
        assert torch.equal(w._sampler_indices_padded[:m].cpu(), padded)
        assert torch.equal(w._embeddings_indices[..., :n].cpu(), embeddings)
        assert_kernel_meta(w.token_mapping_meta, lora, captured, token_list)
        assert_kernel_meta(w.prompt_mapping_meta, sampler, captured, prompt_list)


def test_buffers_keep_their_storage_across_steps():
    """CUDA graphs capture the buffers' addresses once: every step must write the same storage."""
    gen = np.random.default_rng(1)
    w = wrapper([])
    host = HostPunicaMetadata(w)
    lora_index_to_id = list(range(1, SLOTS + 1))
    fields = lambda: [w._token_lora_indices, w._embeddings_indices, w.token_mapping_meta.token_lora_mapping,  # noqa: E731
                      w.prompt_mapping_meta.lora_token_start_loc, host.worklists[0].tile_tokens]
    ptrs = [t.data_ptr() for t in fields()]
    for n in (T, 3, 100):
        host.update(*random_step(gen, lora_index_to_id, n, 4, 0.2), lora_index_to_id, SLOTS + 1, VOCAB)
        assert [t.data_ptr() for t in fields()] == ptrs
        assert w.token_mapping_meta.token_lora_mapping[:n].max() < SLOTS


@pytest.mark.parametrize("unknown, slots", [(77, [1, 2, None]), (2, [1, None, 3]), (77, [1, 2**40, None]),
                                            (5, [1, 2**40, None])])
def test_an_id_without_a_slot_is_a_key_error_as_in_vllm(unknown, slots):
    host = HostPunicaMetadata(wrapper([]))
    with pytest.raises(KeyError, match=str(unknown)):
        host.update((1, unknown, 0), (1,), slots, 4, VOCAB)
