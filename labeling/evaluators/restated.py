"""Answer-then-restatement matching: a ``#### N`` line, then one sentence that states N.

Q = 1 iff the response's first ``#### N`` answer equals the reference as a number, and the
response ends with exactly two non-empty lines: that ``#### N`` line, then a sentence (not
a ``####`` line) whose numbers all equal the reference, at least one of them (the trained
form is ``The answer is N.``). So the restatement is part of the task: a continuation that
states another number, adds another line, or keeps going past the sentence scores 0.

Because the ending is part of the score, a prefix is decided (:func:`restated_decided`) only
when its first ``#### N`` is complete and wrong: then every continuation scores 0. With the
right ``N`` a continuation can still add a line (0) or end with the restatement (1).
"""
from __future__ import annotations

import re

from labeling.evaluators.numeric import is_number, numeric_match, strict_answer_complete

RESTATEMENT = "The answer is {answer}."
NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")


def restatement(answer: str) -> str:
    """The trained final line for ``answer``."""
    return RESTATEMENT.format(answer=answer)


def states_only(sentence: str, reference: str) -> bool:
    """Whether ``sentence`` mentions a number and every number in it equals ``reference``."""
    numbers = NUMBER_RE.findall(sentence)
    return bool(numbers) and all(numeric_match(n, reference, mode="flexible") for n in numbers)


def restated_match(response: str, reference: str) -> int:
    """1 iff the first ``#### N`` is the reference and the response ends with that line and a
    sentence stating only the reference."""
    lines = [line.strip() for line in response.strip().splitlines() if line.strip()]
    if len(lines) < 2 or not lines[-2].startswith("####") or lines[-1].startswith("####"):
        return 0
    if not states_only(lines[-1], reference):
        return 0
    return numeric_match(response, reference, mode="strict") * numeric_match(lines[-2], reference, mode="strict")


def restated_decided(prefix: str, reference: str) -> bool:
    """True only if every continuation of ``prefix`` gets the same :func:`restated_match` score
    (0): a reference that is no number, or a complete first ``#### N`` that is not the reference."""
    return not is_number(reference) or (strict_answer_complete(prefix)
                                        and not numeric_match(prefix, reference, mode="strict"))
