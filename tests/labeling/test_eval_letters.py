"""Answer-letter extraction and match (MedQA-4: A–D, ScienceQA: A–E)."""
from __future__ import annotations

import pytest

from labeling.evaluators.letters import extract_letter, format_choices, letter_match


@pytest.mark.parametrize("response, letters, expected", [
    ("Answer: C", "ABCD", "C"),
    ("Answer:C", "ABCD", "C"),
    ("ANSWER IS B", "ABCD", "B"),
    ("The correct answer is (B).", "ABCD", "B"),
    ("the correct answer is: **D**", "ABCD", "D"),
    ("(A) is tempting, but (D)", "ABCD", "D"),  # last explicit mark wins
    ("B. Because the vignette shows...", "ABCD", "B"),
    ("I think\nC", "ABCD", "C"),
    ("Answer: A. Then again, answer: D", "ABCD", "D"),  # last stated answer wins
    ("The answer is C. (A) is wrong because...", "ABCD", "C"),  # stated answer beats a later bare mark
    ("Answer: E", "ABCD", None),  # E is not an option of a 4-option task
    ("Answer: E", "ABCDE", "E"),
    ("(E)", "ABCDE", "E"),
    ("the answer is a fracture", "ABCD", None),  # the article is not option A
    ("A patient like this needs rest", "ABCD", None),
    ("Answer: A1", "ABCD", None),
    ("no idea", "ABCD", None),
    ("", "ABCD", None),
])
def test_extract_letter(response: str, letters: str, expected: str | None) -> None:
    assert extract_letter(response, letters) == expected


def test_letter_match() -> None:
    assert letter_match("Reasoning...\nAnswer: B", "B") == 1
    assert letter_match("Reasoning...\nAnswer: B", " b ") == 1  # reference normalized
    assert letter_match("Reasoning...\nAnswer: B", "C") == 0
    assert letter_match("no letter at all", "A") == 0


def test_format_choices_round_trips_through_the_extractor() -> None:
    text = format_choices({"A": "red", "B": "blue"})
    assert text == "A. red\nB. blue"
    assert extract_letter("B. blue", "AB") == "B"
