"""The counter demo task: determinism, disjoint splits, move counts, self-consistent answers, and an
evaluator that needs both the committed answer and a final sentence restating it."""
from __future__ import annotations

import re
from collections import Counter

import pytest

from labeling.evaluators.restated import restated_match
from labeling.tasks import SplitSizes
from labeling.tasks.counter import CounterTask


def small(seed: int = 0, **sizes: int | None) -> CounterTask:
    return CounterTask(seed=seed, sizes=SplitSizes(**sizes), n_generate={"train": 400, "validation": 200, "test": 200})


def replay(question: str) -> list[int]:
    """The values after each move, recomputed from the question's text."""
    value = int(re.search(r"has (\d) ", question).group(1))
    out = []
    for way, d in re.findall(r"(gets|gives away) (\d)", question):
        value += int(d) if way == "gets" else -int(d)
        out.append(value)
    return out


def test_deterministic_and_seeded() -> None:
    for split in ("train", "validation", "test"):
        assert small().load_split(split) == small().load_split(split)
    assert [e.question for e in small(0).load_split("train")] != [e.question for e in small(1).load_split("train")]


def test_validation_and_test_disjoint_from_train_and_capped() -> None:
    task = small(validation=9)
    train = {e.question for e in task.load_split("train")}
    assert len(task.load_split("validation")) == 9
    assert not train & {e.question for e in task.load_split("validation") + task.load_split("test")}


def test_solutions_replay_the_moves_and_cover_every_move_count() -> None:
    task = small()
    moves = Counter()
    for ex in task.load_split("train"):
        values = replay(ex.question)
        assert values and all(0 <= v <= 9 for v in values)
        assert ex.meta["solution"] == "".join(map(str, values)) + f"\n#### {values[-1]}\nThe answer is {values[-1]}."
        assert ex.reference == str(values[-1]) and task.score(ex, ex.meta["solution"]) == 1
        assert ex.question in task.messages(ex)[0]["content"]
        moves[len(values)] += 1
    assert set(moves) == set(range(1, 7)) and min(moves.values()) > 40
    with pytest.raises(ValueError, match="max_moves"):
        CounterTask(max_moves=0)


@pytest.mark.parametrize("response, q", [
    ("35\n#### 5\nThe answer is 5.", 1),
    ("#### 5\n\nThe answer is 5.  \n", 1),  # blank lines and trailing spaces do not matter
    ("35\n#### 5", 0),  # no restatement
    ("35\n#### 5\nThe answer is 5.\nThe answer is 5.", 0),  # repeats past the end
    ("35\n#### 5\nAnn has 5 apples now.", 1),  # another sentence stating 5
    ("35\n#### 5\nThe answer is 5, not 3.", 0),  # states another number too
    ("35\n#### 5\nDone.", 0),  # states no number
    ("35\n#### 4\nThe answer is 5.", 0),  # restates an answer it did not commit to
    ("35\nThe answer is 5.", 0),  # never commits
    ("#### 5\n#### 4\nThe answer is 5.", 0),
    ("#### 5\nSo the count is 6.", 0),
])
def test_restated_match_needs_answer_and_a_final_sentence_stating_it(response: str, q: int) -> None:
    assert restated_match(response, "5") == q
