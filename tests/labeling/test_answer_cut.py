"""Where a response ends (labeling/answer_cut.py): the first decided prefix, never inside a
character that the next token may complete, and a GenResult cut consistently."""
from __future__ import annotations

from functools import partial

import torch

from labeling.answer_cut import AnswerWatch, cut_result, decided_at, decided_length
from labeling.engines.hf import GenResult
from labeling.evaluators.numeric import numeric_decided


def decode(tokens: list[int]) -> str:
    """Byte-level tokens, decoded as a byte-level BPE tokenizer does (lossy at a cut character)."""
    return bytes(tokens).decode("utf-8", errors="replace")


def encode(text: str) -> list[int]:
    return list(text.encode())


STOP = partial(numeric_decided, reference="42")


def test_decided_length_is_the_first_decided_prefix() -> None:
    tokens = encode("so 40 + 2\n#### 42\nThe answer is 42.")
    n = decided_length(tokens, STOP, decode)
    assert decode(tokens[:n]) == "so 40 + 2\n#### 42\n"
    assert decided_length(encode("#### 42"), STOP, decode) is None  # a digit may still follow
    assert decided_length(tokens, None, decode) is None


def test_an_incomplete_character_decides_nothing() -> None:
    tokens = encode("#### 42é")  # é is two bytes: after the first, the text ends in U+FFFD
    assert decode(tokens[:-1]).endswith("\ufffd") and STOP(decode(tokens[:-1]))
    assert not decided_at(tokens[:-1], STOP, decode)
    assert decided_length(tokens, STOP, decode) == len(tokens)


def test_cut_result_cuts_tokens_scores_hidden_release_and_branches() -> None:
    on = encode("#### 42\nmore text")
    n = len(encode("#### 42\n"))
    wrong = on[:3] + encode("# 7\nand on")
    res = GenResult(uid="u", slot=0, tokens=on, release=n + 2, scores=[0.5] * len(on),
                    hidden={t: torch.zeros(2) for t in (0, n - 1, n)},
                    branches={2: wrong, n - 1: on[:n] + encode("xyz"), n + 1: on[:n + 2] + encode("z")})
    cut_result(res, STOP, decode)
    assert res.tokens == on[:n] and len(res.scores) == n and sorted(res.hidden) == [0, n - 1]
    assert res.release is None  # it came after the response's end
    assert set(res.branches) == {2}  # forks at t ≥ n − 1 are the cut ON response itself
    assert decode(res.branches[2]) == "#### 7\n"
    before = (list(res.tokens), dict(res.branches))
    cut_result(res, STOP, decode)  # idempotent
    assert (res.tokens, res.branches) == before


def test_answer_watch_finds_the_decided_length_as_tokens_arrive() -> None:
    """Fed a growing continuation (one or several tokens at a time), the watch returns the first
    length whose prefix + continuation is decided, the one decided_length finds on the whole."""
    import random

    rng = random.Random(3)
    prefix = encode("40 + 2 = ")
    for text in ("42\n#### 42 and so on", "#### 4\u00e92\n#### 7", "#### 41, more", "no answer at all"):
        tokens = encode(text)
        whole = decided_length(prefix + tokens, STOP, decode, start=len(prefix) + 1)
        watch, got, seen = AnswerWatch(prefix, STOP, decode), None, 0
        while got is None and seen < len(tokens):
            seen = min(len(tokens), seen + rng.randint(1, 3))
            got = watch(tokens[:seen])
        assert got == (None if whole is None else whole - len(prefix)), text
        assert got is None or got <= seen
