"""Prefix-cache keys for forced releases: blocks computed after a release are cached apart (DESIGN §4).

vLLM 0.26.0 hashes each full KV block of a request with its tokens, its parent block's hash and
extra keys (``v1/core/kv_cache_utils.py:691-743``, ``request_block_hasher``; paths inside the
``vllm`` package). The extra keys hold the LoRA name (``:517-529``, ``generate_block_hash_extra_keys``
at :558-590). A block computed after its request's release has the adapter's name in its hash,
though the adapter was not applied to it, and a later request with the same adapter and tokens
would reuse it. DESIGN §4 allows prefix caching under StepTrim only if released blocks are keyed
correctly.

That is possible where the scheduler knows the release position when it hashes: a *forced*
release, carried in ``SamplingParams.extra_args`` (:func:`serve_bridge.runtime.request_args`;
the engine core keeps the params on its ``Request``, ``v1/request.py:84``). The calibration
engine's OFF branches are such requests: prompt + ON prefix, forced release at position r. With
:func:`install`, a block whose token range reaches position r or beyond gets the extra key
``("lorazor-released", r)``:

- Blocks wholly before r hash as they would without release, so an OFF branch reuses the blocks
  its ON request computed with the adapter.
- Blocks from the one holding r on hash apart, per r. The chain of parent hashes then separates
  every later block too.

Releases that the runtime decides while decoding (profiled k, learned heads) are unknown to the
scheduler. Prefix caching therefore stays refused in serving, and in calibration passes that
carry a release policy (:class:`serve_bridge.calibration.CalibrationRuntime`).

:func:`install` wraps the module function in place (the hasher looks it up by name on every
block), and the copy ``v1/core/block_pool.py`` imported by name (:21; it rebuilds the keys for KV
cache events, :326, :407, :524). vLLM's engine core calls the plugin's ``register`` in its own
process (``v1/engine/core.py:110-112``) before it builds the hasher (:220), so the wrapper is in
place where blocks are hashed.
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
