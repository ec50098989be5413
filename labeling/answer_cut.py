"""Where a response ends: at the token that decides its score.

Every calibration response (ON, OFF_t, the test stage's) ends at the first of: a stop token,
``max_new_tokens``, or the first token after which its task says the score is decided
(:meth:`labeling.tasks.base.Task.decided`: no continuation can change it). Lengths, release
points and skip fractions count the forwards up to there, as a server that stops at the task's
answer (lm-eval's ``until``) runs them; nothing generated later can change a label or a price.

With early stop (``labeling.early_stop=true``, the default) the engines stop a row at that token;
without it they generate to the end and :func:`cut_result` cuts the result afterwards, so both
give the same results (``tests/calibrate/test_early_stop.py``). A response prefix is judged on
its decoded text only where that text is a prefix of every longer decode: not while it ends in
an incomplete UTF-8 character (decoded as U+FFFD, which the next token may complete).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

# The rule above, named in the labeling fingerprint (a new rule recomputes cached stages).
RESPONSE_END = "answer-decided/1"

# stop(text): True only if every continuation of the response prefix ``text`` gets the same score.
StopFn = Callable[[str], bool]
Decode = Callable[[list[int]], str]


def decided_at(tokens: list[int], stop: StopFn, decode: Decode) -> bool:
    """Whether the response prefix ``tokens`` is decided (its text complete and ``stop`` true)."""
    text = decode(tokens)
    return not text.endswith("\ufffd") and stop(text)


def decided_length(tokens: Sequence[int], stop: StopFn | None, decode: Decode, start: int = 1) -> int | None:
    """The smallest n ≥ ``start`` whose prefix ``tokens[:n]`` is decided (:func:`decided_at`), or
    None. ``stop`` is monotone (a decided prefix stays decided), so an undecided whole is enough to
    say None."""
    tokens = list(tokens)
    if stop is None or not tokens or not stop(decode(tokens)):
        return None
    return next((n for n in range(max(1, start), len(tokens) + 1) if decided_at(tokens[:n], stop, decode)), None)


class AnswerWatch:
    """Where a response that continues ``prefix`` is decided, watched as its tokens arrive: called
    with the continuation so far (each call extending the last), it returns the smallest n whose
    ``prefix + continuation[:n]`` is decided (:func:`decided_at`), else None. ``prefix`` itself must
    be undecided; each length is judged once."""

    def __init__(self, prefix: Sequence[int], stop: StopFn, decode: Decode) -> None:
        self.prefix, self.stop, self.decode = list(prefix), stop, decode
        self.checked = 0

    def __call__(self, continuation: Sequence[int]) -> int | None:
        n = decided_length(self.prefix + list(continuation), self.stop, self.decode,
                           start=len(self.prefix) + self.checked + 1)
        self.checked = len(continuation)
        return None if n is None else n - len(self.prefix)


def cut_result(res: Any, stop: StopFn | None, decode: Decode) -> None:
    """Cut a :class:`labeling.engines.hf.GenResult` in place where its responses are decided: the
    ON tokens, scores and h_t at its decided length L, the release if it came later, the branches
    forked at t ≥ L−1 (their OFF response is the cut ON one), and each branch at its own length."""
    n = decided_length(res.tokens, stop, decode)
    if n is not None:
        res.tokens = res.tokens[:n]
        res.scores = res.scores[:n]
        res.hidden = {t: h for t, h in res.hidden.items() if t < n}
        if res.release is not None and res.release >= n:
            res.release = None
        res.branches = {t: b for t, b in res.branches.items() if t < n - 1}
    for t, b in res.branches.items():
        m = decided_length(b, stop, decode, start=t + 2)
        if m is not None:
            res.branches[t] = b[:m]
