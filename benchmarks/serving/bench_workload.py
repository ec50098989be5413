"""The serving benchmarks' request set (pure and seeded): the paper's workload of 2048 requests with
prompts of 100–300 tokens and 20–100 output tokens, spread uniformly over the adapters or 80% of
requests on 20% of them (skewed), each adapter's profiled release point k chosen so that its
release skips about half of its decode forwards (:func:`choose_k`), and open-loop Poisson arrival
times (:func:`arrival_times`).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from benchmarks.serving.synthetic import LLAMA32_3B
from serve_bridge.steptrim import skip_fraction

N_REQUESTS = 2048


PROMPT_LEN = (100, 300)  # inclusive


OUTPUT_LEN = (20, 100)  # inclusive


TARGET_SKIP = 0.5


HOT_ADAPTERS, HOT_TRAFFIC = 0.2, 0.8  # --skewed: 80% of requests on 20% of the adapters


@dataclass(frozen=True)
class Workload:
    """One request set and its profiled release schedule.

    adapter[i], prompt[i], max_tokens[i]: request i's adapter index (0 … N−1), prompt token
    ids and output length. k[a]: adapter a's profiled release point. planned_skip: the skip
    fraction of decode forwards that k implies for these output lengths.
    """

    n_adapters: int
    skewed: bool
    adapter: list[int]
    prompt: list[list[int]]
    max_tokens: list[int]
    k: list[int]
    planned_skip: float

    def releases(self) -> list[int]:
        """Each request's release point r (its adapter's k)."""
        return [self.k[a] for a in self.adapter]


def hot_adapter_count(n_adapters: int) -> int:
    """Adapters in the hot set of skewed traffic: 20% of them, at least one, never all."""
    return min(max(1, round(HOT_ADAPTERS * n_adapters)), max(1, n_adapters - 1))


def assign_adapters(n_requests: int, n_adapters: int, skewed: bool, rng: np.random.Generator) -> list[int]:
    """Adapter index per request: uniform, or 80% of requests uniformly on the hot set
    (adapters 0 … hot−1) and the rest uniformly on the others."""
    if n_adapters < 1:
        raise ValueError(f"need at least one adapter, got {n_adapters}")
    if not skewed or n_adapters == 1:
        return rng.integers(0, n_adapters, n_requests).tolist()
    hot = hot_adapter_count(n_adapters)
    on_hot = rng.random(n_requests) < HOT_TRAFFIC
    return np.where(on_hot, rng.integers(0, hot, n_requests), rng.integers(hot, n_adapters, n_requests)).tolist()


def choose_k(lengths: Sequence[int], target: float = TARGET_SKIP) -> int:
    """The release point k whose skip fraction over these output lengths is nearest the
    target (the smaller k on a tie). Empty lengths → 0.

    The skip fraction does not grow with k, so a bisection finds the smallest k at or below
    the target; the answer is it or the k before it."""
    if not lengths:
        return 0

    def skip(k: int) -> float:
        return skip_fraction(lengths, [k] * len(lengths))

    lo, hi = 0, max(0, max(lengths) - 1)  # skip(hi) = 0
    while lo < hi:
        mid = (lo + hi) // 2
        if skip(mid) <= target:
            hi = mid
        else:
            lo = mid + 1
    if lo > 0 and abs(skip(lo - 1) - target) <= abs(skip(lo) - target):
        return lo - 1
    return lo


def profiled_ks(adapter: Sequence[int], lengths: Sequence[int], n_adapters: int,
                target: float = TARGET_SKIP) -> list[int]:
    """Per adapter, :func:`choose_k` over its own requests' output lengths (an adapter without
    requests gets the k of all lengths)."""
    by_adapter: list[list[int]] = [[] for _ in range(n_adapters)]
    for a, n in zip(adapter, lengths):
        by_adapter[a].append(n)
    fallback = choose_k(lengths, target)
    return [choose_k(ls, target) if ls else fallback for ls in by_adapter]


def make_workload(n_adapters: int, n_requests: int = N_REQUESTS, *, skewed: bool = False, seed: int = 0,
                  prompt_len: tuple[int, int] = PROMPT_LEN, output_len: tuple[int, int] = OUTPUT_LEN,
                  vocab_size: int = LLAMA32_3B["vocab_size"], target_skip: float = TARGET_SKIP) -> Workload:
    """The seeded request set. Prompts and output lengths depend on the seed only (not on the
    adapter count or traffic), so runs with different N serve the same requests."""
    rng = np.random.default_rng([seed, 0])
    plens = rng.integers(prompt_len[0], prompt_len[1] + 1, n_requests)
    lengths = rng.integers(output_len[0], output_len[1] + 1, n_requests).tolist()
    tokens = rng.integers(3, vocab_size, int(plens.sum())).tolist()
    starts = np.concatenate([[0], np.cumsum(plens)[:-1]]).tolist()
    prompts = [tokens[s:s + int(p)] for s, p in zip(starts, plens)]
    adapter = assign_adapters(n_requests, n_adapters, skewed, np.random.default_rng([seed, 1, int(skewed)]))
    ks = profiled_ks(adapter, lengths, n_adapters, target_skip)
    planned = skip_fraction(lengths, [ks[a] for a in adapter])
    return Workload(n_adapters, skewed, adapter, prompts, lengths, ks, planned)


def arrival_times(n_requests: int, rate: float, seed: int = 0) -> list[float]:
    """Open-loop Poisson arrivals: seconds after the start at which each request arrives, in order.

    Gaps are exponential with mean 1/rate (seeded, independent of the workload's draws); the
    first request arrives at 0."""
    if not rate > 0:
        raise ValueError(f"arrival rate must be > 0 requests/s, got {rate}")
    if n_requests <= 0:
        return []
    gaps = np.random.default_rng([seed, 2]).exponential(1.0 / rate, n_requests)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


def workload_for(n: int, n_requests: int, skewed: bool, seed: int, cfg: dict[str, Any] = LLAMA32_3B) -> Workload:
    """The bench's workload for this model (prompt token ids drawn below its vocabulary size)."""
    return make_workload(n, n_requests, skewed=skewed, seed=seed, vocab_size=cfg["vocab_size"])
