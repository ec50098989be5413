"""Answer-letter extraction and match for multiple choice (MedQA-4: A–D, ScienceQA: A–E).

Extraction looks at two tiers of patterns; within a tier the **last** match in the response
wins, and tier 1 wins over tier 2 wherever they occur:

1. an answer statement: ``Answer: C``, ``answer is C``, ``The correct answer is (C)``,
   ``correct option: **C**`` (``answer`` / ``option`` / ``choice`` followed by ``is`` or ``:``);
2. a bare mark: ``(C)`` anywhere, or ``C.`` / ``C)`` / ``C:`` at the start of a line, or a
   line that is only the letter.

Tiering keeps a stated answer from being overridden by options the model discusses after
it ("The answer is C. (A) is wrong because …"). Only uppercase letters from the task's
letter set count, so the article "a" is never read as option A, and ``(E)`` is ignored for a
four-option task. The match is exact: 1 iff the extracted letter equals the reference.
Prompts list the options with :func:`format_choices` (``A. text`` lines), the same letters
the extractor reads back.

Since the last statement wins, a continuation can always state another letter: a prefix is
decided (:func:`letter_decided`) only when the reference is no letter of the set (every
response scores 0).
"""
from __future__ import annotations

import re
from functools import lru_cache

MEDQA_LETTERS = "ABCD"
SCIENCEQA_LETTERS = "ABCDE"


def format_choices(choices: dict[str, str]) -> str:
    """One ``L. text`` line per option, in the mapping's order."""
    return "\n".join(f"{k}. {v}" for k, v in choices.items())


@lru_cache(maxsize=None)
def _patterns(letters: str) -> tuple[re.Pattern[str], re.Pattern[str]]:
    cls = "[" + re.escape(letters) + "]"
    end = r"(?![A-Za-z0-9])"
    # keywords case-insensitive, the letter itself uppercase only
    stated = re.compile(
        r"\b(?i:answer|option|choice)\b[^\S\n]*(?:(?i:is)\b|:)[^\S\n]*:?[^\S\n]*[*_(\[]*[^\S\n]*"
        + f"({cls}){end}"
    )
    bare = re.compile(
        rf"\(({cls})\)|^[^\S\n]*[*_]*({cls})[*_]*(?:[.):]|[^\S\n]*$)",
        re.MULTILINE,
    )
    return stated, bare


def extract_letter(response: str, letters: str = MEDQA_LETTERS) -> str | None:
    """The answer letter of ``response`` (one of ``letters``), or None."""
    stated, bare = _patterns(letters)
    found = [m.group(1) for m in stated.finditer(response)]
    if found:
        return found[-1]
    marks = [m.group(1) or m.group(2) for m in bare.finditer(response)]
    return marks[-1] if marks else None


def letter_match(response: str, reference: str, letters: str = MEDQA_LETTERS) -> int:
    """1 iff the extracted letter equals ``reference`` (case- and space-insensitive reference)."""
    got = extract_letter(response, letters)
    return int(got is not None and got == reference.strip().upper())


def letter_decided(prefix: str, reference: str, letters: str = MEDQA_LETTERS) -> bool:
    """True only if every continuation of ``prefix`` gets the same :func:`letter_match` score:
    a reference outside ``letters`` (always 0); otherwise a later answer statement can change it."""
    return reference.strip().upper() not in set(letters)
