"""Numeric extractors (lm-eval GSM8K strict / flexible) and numeric_match."""
from __future__ import annotations

from collections.abc import Callable

import pytest

from labeling.evaluators.numeric import extract_answer, extract_flexible, extract_strict, numeric_match


@pytest.mark.parametrize("extract, response, expected", [
    (extract_strict, "so 3 + 4 = 7\n#### 7", "7"),
    (extract_strict, "#### 1,234", "1,234"),
    (extract_strict, "#### -5", "-5"),
    (extract_strict, "#### 3.5 then #### 9", "3.5"),  # strict takes the first match
    (extract_strict, "the answer is 7", None),
    (extract_strict, "####7", None),  # strict needs the space
    (extract_flexible, "3 + 4 = 7, so she has 7 apples", "7"),
    (extract_flexible, "It costs $1,200.", "$1,200."),
    (extract_flexible, "first 12 then -7", "-7"),
    (extract_flexible, "no digits here", None),
    (extract_flexible, "", None),
])
def test_strict_and_flexible_extractors(extract: Callable[[str], str | None], response: str,
                                        expected: str | None) -> None:
    assert extract(response) == expected


@pytest.mark.parametrize("response, reference, mode, expected", [
    ("#### 1,234", "1234", "strict", 1),
    ("She pays $1,200.", "1200", "flexible", 1),
    ("#### -5", "-5", "strict_then_flexible", 1),
    ("#### 5", "-5", "strict_then_flexible", 0),
    ("total 10.0", "10", "flexible", 1),
    ("The answer is 42", "42", "strict", 0),  # strict has no fallback
    ("The answer is 42", "42", "strict_then_flexible", 1),  # fallback to the last number
    ("#### 8 ... later I think 9", "8", "strict_then_flexible", 1),  # strict wins when present
    ("I don't know", "3", "strict_then_flexible", 0),
    ("#### 12", "12 apples", "strict", 0),  # a non-numeric reference never matches
])
def test_numeric_match(response: str, reference: str, mode: str, expected: int) -> None:
    assert numeric_match(response, reference, mode) == expected  # type: ignore[arg-type]


def test_unknown_mode_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="strict_then_flexible"):
        extract_answer("#### 1", "loose")  # type: ignore[arg-type]
