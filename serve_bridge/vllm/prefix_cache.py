"""Prefix-cache keys for released requests: blocks computed after a release are cached apart.

vLLM keys a KV block by its tokens, its parent's hash and extra keys holding the LoRA name; a block
that reaches a request's release position p (the first position whose KV runs without the
adapter) holds neither the adapter's KV nor the backbone's. :func:`install` adds
``(RELEASED_KEY, p)`` to the extra keys of every block that reaches p, so blocks wholly before p
are shared with the adapter's other requests as stock vLLM shares them, and blocks from p on hash
apart, per p (and the parent-hash chain separates every later block). p comes from the request's
forced release (``SamplingParams.extra_args``, known when the request is created) and from what the
release-aware scheduler knows (:func:`mark_release`: a profiled k at admission, a learned decision
with the step output that precedes the hashing of the first block it reaches;
docs/vllm_integration.md §7). :func:`count_hits` counts the scheduler's prefix-cache hits, and
those on blocks that reach the hitting request's release position.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from serve_bridge.runtime import NEVER, request_args

RELEASED_KEY = "lorazor-released"
RELEASE_ATTR = "lorazor_release_position"  # set on vLLM's Request by mark_release


def forced_release(request: Any) -> int | None:
    """The request's forced release position, from its ``SamplingParams.extra_args``. None if it has
    none, or if its arguments are malformed: the runtime then ignores them too, with a warning, and
    never releases the request."""
    params = getattr(request, "sampling_params", None)
    try:
        return request_args(getattr(params, "extra_args", None))[1]
    except ValueError:
        return None


def mark_release(request: Any, position: int) -> None:
    """Record on vLLM's ``request`` that its positions ≥ ``position`` run without the adapter."""
    setattr(request, RELEASE_ATTR, int(position))


def release_position(request: Any) -> int:
    """The request's first position without adapter, as known now (:data:`NEVER` if none)."""
    forced = forced_release(request)
    marked = getattr(request, RELEASE_ATTR, NEVER)
    return marked if forced is None else min(forced, marked)


def released_keys(extra_keys: tuple[Any, ...] | None, request: Any,
                  end_token_idx: int) -> tuple[Any, ...] | None:
    """``extra_keys`` of the block of ``request`` that ends before token ``end_token_idx``,
    plus ``(RELEASED_KEY, p)`` if the request is released at position p and the block reaches p."""
    p = release_position(request)
    if end_token_idx <= p:
        return extra_keys
    return (*(extra_keys or ()), (RELEASED_KEY, p))


def install() -> None:
    """Key vLLM's block hashes by release position (module doc). Idempotent."""
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


@dataclass
class HitStats:
    """Prefix-cache lookups of the scheduler in this process.

    lookups: requests looked up (admissions, resumptions); hit_tokens / hit_blocks: tokens and
    full blocks they found cached; released_hit_blocks: hit blocks that reach the looking-up
    request's own release position (a preempted request finding the blocks it computed itself
    after its release; any other request never hashes to them).
    """

    lookups: int = 0
    hit_tokens: int = 0
    hit_blocks: int = 0
    released_hit_blocks: int = 0


HITS: HitStats | None = None  # set by the first count_hits in this process


def count_hits(manager: Any, block_size: int) -> None:
    """Count ``manager``'s prefix-cache hits into :data:`HITS`: wraps ``manager.get_computed_blocks``
    (``v1/core/kv_cache_manager.py:266``, 0.33.0: it returns the cached blocks and the number of
    cached tokens first) on this instance."""
    global HITS
    if HITS is None:
        HITS = HitStats()
    stats = HITS
    original = manager.get_computed_blocks

    def get_computed_blocks(request: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(request, *args, **kwargs)
        stats.lookups += 1
        tokens = int(result[1])
        if tokens:
            blocks = tokens // block_size
            stats.hit_tokens += tokens
            stats.hit_blocks += blocks
            p = release_position(request)
            if p < tokens:
                stats.released_hit_blocks += blocks - p // block_size
        return result

    manager.get_computed_blocks = get_computed_blocks


def hit_stats() -> dict[str, int] | None:
    """:data:`HITS` as plain data: the counters of the scheduler in this process, None where no
    release-aware scheduler with prefix caching runs in it (a tensor-parallel worker process)."""
    return None if HITS is None else asdict(HITS)
