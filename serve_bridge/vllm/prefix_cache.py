"""Prefix-cache keys for forced releases: blocks computed after a release are cached apart.

vLLM keys a KV block by its tokens, its parent's hash and extra keys holding the LoRA name; a block
computed after its request's release would be reused as if computed with the adapter. For a
request with a forced release at position r (``SamplingParams.extra_args``), :func:`install` adds
``(RELEASED_KEY, r)`` to the extra keys of every block that reaches r, so blocks before r are shared
with the adapter's other requests and blocks from r on hash apart. Releases decided while decoding
are unknown to the scheduler: prefix caching stays refused for them (docs/vllm_integration.md §7).
"""
from __future__ import annotations

from typing import Any

from serve_bridge.runtime import request_args

RELEASED_KEY = "lorazor-released"


def forced_release(request: Any) -> int | None:
    """The request's forced release position, from its ``SamplingParams.extra_args``. None if it has
    none, or if its arguments are malformed: the runtime then ignores them too, with a warning, and
    never releases the request."""
    params = getattr(request, "sampling_params", None)
    try:
        return request_args(getattr(params, "extra_args", None))[1]
    except ValueError:
        return None


def released_keys(extra_keys: tuple[Any, ...] | None, request: Any,
                  end_token_idx: int) -> tuple[Any, ...] | None:
    """``extra_keys`` of the block of ``request`` that ends before token ``end_token_idx``,
    plus ``(RELEASED_KEY, r)`` if the request is released at r and the block reaches r."""
    r = forced_release(request)
    if r is None or end_token_idx <= r:
        return extra_keys
    return (*(extra_keys or ()), (RELEASED_KEY, r))


def install() -> None:
    """Key vLLM's block hashes by forced release position (module doc). Idempotent."""
    from vllm.v1.core import block_pool, kv_cache_utils

    original = kv_cache_utils.generate_block_hash_extra_keys
    if getattr(original, "lorazor_keyed", False):
        return

    def generate_block_hash_extra_keys(request: Any, start_token_idx: int, end_token_idx: int,
                                       start_mm_idx: int) -> tuple[tuple[Any, ...] | None, int]:
        keys, next_mm_idx = original(request, start_token_idx, end_token_idx, start_mm_idx)
        return released_keys(keys, request, end_token_idx), next_mm_idx

    generate_block_hash_extra_keys.lorazor_keyed = True  # type: ignore[attr-defined]
    kv_cache_utils.generate_block_hash_extra_keys = generate_block_hash_extra_keys
    block_pool.generate_block_hash_extra_keys = generate_block_hash_extra_keys


def installed() -> bool:
    """Whether :func:`install` ran in this process (vLLM importable)."""
    from vllm.v1.core import kv_cache_utils

    return bool(getattr(kv_cache_utils.generate_block_hash_extra_keys, "lorazor_keyed", False))
