"""The fork rule, shared by both calibration engines.

After forward t of a request's ON response (full LoRA, or a release policy's), OFF_t — the
response continued from there without the adapter, i.e. released with profiled k = t — is
forked iff the request has an adapter, forward t's decision did not release it, token t is not
the response's last, and the caller's ``fork(result, t, s_t)`` asks for it. ``fork`` is called
in increasing t per request, only where the first three hold, with ``result`` holding what is
known after forward t (scores and h_t up to t). The hf engine applies the rule while decoding
(forking KV-cache rows); the vLLM engine replays it on the finished ON result and then runs the
OFF branches by prefix replay.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from serve_bridge.steptrim import NO_SLOT

# fork(result_so_far, t, s_t or None) -> True to fork OFF_t after forward t;
# result_so_far is the request's labeling.engines.hf.GenResult as known after forward t.
ForkFn = Callable[[Any, int, "float | None"], bool]


def forks_at(fork: ForkFn, result: Any, t: int, score: float | None, released: bool, last: bool) -> bool:
    """Whether OFF_t is forked after forward t (module docstring); ``fork`` is called only when
    the request has an adapter, is not ``released`` and forward t's token is not its ``last``."""
    return result.slot != NO_SLOT and not released and not last and bool(fork(result, t, score))
