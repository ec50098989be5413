"""Answer-then-restatement matching: ``#### N`` followed by a final line ``The answer is N.``

Q = 1 iff the response's strict ``#### N`` answer equals the reference as a number **and**
the response ends with that ``#### N`` line followed by exactly ``The answer is <reference>.``
(blank lines aside), nothing after it. The second condition makes the restatement part of
the task: a continuation that writes a different sentence or number, or keeps going past the
restatement (repeating it, too), scores 0.
"""
from __future__ import annotations

from labeling.evaluators.numeric import numeric_match

RESTATEMENT = "The answer is {answer}."


def restatement(answer: str) -> str:
    """The required final line for ``answer``."""
    return RESTATEMENT.format(answer=answer)


def restated_match(response: str, reference: str) -> int:
    """1 iff the response's first ``#### N`` is the reference and it ends with exactly two
    non-empty lines: that ``#### N`` line, then the restatement."""
    lines = [line.strip() for line in response.strip().splitlines() if line.strip()]
    if len(lines) < 2 or lines[-1] != restatement(reference) or not lines[-2].startswith("####"):
        return 0
    return numeric_match(response, reference, mode="strict") * numeric_match(lines[-2], reference, mode="strict")
