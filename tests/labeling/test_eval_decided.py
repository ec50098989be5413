"""Answer-decided predicates against their evaluators, on random prefixes and continuations.

decided(prefix) must imply that every continuation scores as the prefix does (and is decided
too); the random texts are built from the pieces the extractors react to, so they hit the edges
(a number that a later digit extends, a ``#### N`` at the very end, a fence that closes in the
continuation, ...). Each test also checks that the predicate is not vacuous.
"""
from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from labeling.evaluators.letters import letter_decided, letter_match
from labeling.evaluators.numeric import MODES, numeric_decided, numeric_match
from labeling.evaluators.restated import restated_decided, restated_match
from labeling.evaluators.sql import extract_sql, sql_decided

NUMERIC_PIECES = ["#### ", "####", "#", " ", "\n", "4", "2", "7", "0", ".", ",", "-", "$", "The answer is ", "42",
                  "x", "so", "=", "+"]
LETTER_PIECES = ["Answer: ", "The answer is ", "answer", " is ", ":", "(", ")", "A", "B", "C", "D", "E", "a", "\n",
                 " ", ".", "*", "option", "correct ", "is"]
SQL_PIECES = ["```", "sql", "SQL", "`", "\n", " ", "SELECT ", "name", " FROM t", ";", "'", "a;b", "WHERE x = 1",
              "\n\n", "lite", "``"]


def texts(pieces: list[str], rng: random.Random, n: int, longest: int) -> list[str]:
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(0, longest))) for _ in range(n)]


def check(decided: Callable[[str], bool], score: Callable[[str], object], pieces: list[str], seed: int,
          n_prefix: int = 1500, n_cont: int = 25) -> tuple[int, int]:
    """Assert exactness and monotonicity; return (decided prefixes, undecided prefixes whose
    sampled continuations scored differently)."""
    rng = random.Random(seed)
    n_decided = n_split = 0
    for prefix in texts(pieces, rng, n_prefix, 12):
        conts = texts(pieces, rng, n_cont, 6)
        if decided(prefix):
            n_decided += 1
            base = score(prefix)
            for c in conts:
                assert score(prefix + c) == base, (prefix, c)
                assert decided(prefix + c), (prefix, c)
        else:
            n_split += len({score(prefix + c) for c in ["", *conts]}) > 1
    return n_decided, n_split


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("reference", ["42", "4", "-7", "1,000", "4.20"])
def test_numeric_decided_is_exact(mode: str, reference: str) -> None:
    n_decided, n_split = check(lambda p: numeric_decided(p, reference, mode),
                               lambda r: numeric_match(r, reference, mode), [*NUMERIC_PIECES, reference, f"#### {reference}"],
                               seed=MODES.index(mode) * 10 + len(reference))
    assert n_split > 0
    assert (n_decided > 0) == (mode != "flexible")


@pytest.mark.parametrize("prefix, decided", [
    ("#### 4", False),  # the next token may extend it: "#### 42"
    ("#### 4\n", True),
    ("#### 42 apples", True),
    ("#### 4.", False),
    ("#### 4,2", False),
    ("#### 4. So", True),
    ("####", False),
    ("#### ", False),
    ("she has 42\n", False),  # a #### line may still come
])
def test_numeric_decided_cases(prefix: str, decided: bool) -> None:
    assert numeric_decided(prefix, "42") is decided
    assert numeric_decided(prefix, "42", "flexible") is False


def test_numeric_decided_without_a_numeric_reference() -> None:
    assert numeric_decided("", "twelve", "flexible") and numeric_match("twelve 12", "twelve", "flexible") == 0


@pytest.mark.parametrize("reference", ["8", "0", "5"])
def test_restated_decided_is_exact(reference: str) -> None:
    pieces = NUMERIC_PIECES + [f"#### {reference}\n", f"The answer is {reference}.", "\n#### 3\n"]
    n_decided, n_split = check(lambda p: restated_decided(p, reference), lambda r: restated_match(r, reference),
                               pieces, seed=int(reference))
    assert n_decided > 0 and n_split > 0


def test_restated_is_decided_only_when_wrong() -> None:
    assert restated_decided("758\n#### 7\n", "8")
    assert not restated_decided("758\n#### 8\n", "8")  # the restatement still counts
    assert not restated_decided("758\n#### 8\nThe answer is 8.", "8")


@pytest.mark.parametrize("letters, reference", [("ABCD", "C"), ("ABCDE", "E"), ("ABCD", "E")])
def test_letter_decided_is_exact(letters: str, reference: str) -> None:
    n_decided, n_split = check(lambda p: letter_decided(p, reference, letters),
                               lambda r: letter_match(r, reference, letters), LETTER_PIECES, seed=ord(reference))
    if reference in letters:
        assert n_decided == 0 and n_split > 0
    else:
        assert n_decided > 0


def test_sql_decided_is_exact() -> None:
    pieces = SQL_PIECES + ["```sql\n", "```sql\nSELECT a FROM t;", "```\nSELECT 1```"]
    n_decided, n_split = check(sql_decided, extract_sql, pieces, seed=3)
    assert n_decided > 0 and n_split > 0


@pytest.mark.parametrize("prefix, decided", [
    ("```sql\nSELECT a FROM t", False),
    ("```sql\nSELECT a FROM t\n", False),  # `$` also matches before a final newline: still open
    ("```sql\nSELECT a FROM t```", True),
    ("```sql\nSELECT a FROM t;", True),
    ("```sql\nSELECT 'a;b", False),  # a ; inside a literal ends nothing
    ("```\nSELECT a FROM t```", False),  # a later ```sql block would win
    ("SELECT a FROM t;", False),
    ("```sql", False),
])
def test_sql_decided_cases(prefix: str, decided: bool) -> None:
    assert sql_decided(prefix) is decided


def test_tasks_decide_with_their_evaluator() -> None:
    from labeling.tasks import build_task

    mix = build_task("mix", parts={"arith": {}, "counter": {}})
    examples = mix.load_split("validation")[:2]
    assert {mix.part(ex).name for ex in examples} == {"arith", "counter"}
    for ex in examples:
        wrong = str((int(ex.reference) + 1) % 10)
        part = mix.part(ex)
        assert mix.decided(ex, f"#### {wrong}\n") and part.decided(ex, f"#### {wrong}\n")
        # arith's strict answer decides either way; counter's right answer still needs its sentence
        assert mix.decided(ex, f"#### {ex.reference}\n") is (part.name == "arith")
        assert not mix.decided(ex, f"#### {ex.reference}")
