"""The embedded arith task: determinism, disjoint splits, caps, self-consistent answers."""
from __future__ import annotations

from labeling.tasks import SplitSizes
from labeling.tasks.arith import ArithTask


def small(seed: int = 0, **sizes: int | None) -> ArithTask:
    return ArithTask(seed=seed, sizes=SplitSizes(**sizes), n_generate={"train": 300, "validation": 60, "test": 60})


def test_deterministic() -> None:
    a, b = small(), small()
    for split in ("train", "validation", "test"):
        assert a.load_split(split) == b.load_split(split)


def test_seed_changes_the_data() -> None:
    assert [e.question for e in small(0).load_split("train")] != [e.question for e in small(1).load_split("train")]


def test_validation_and_test_disjoint_from_train() -> None:
    task = small()
    train = {e.question for e in task.load_split("train")}
    val = task.load_split("validation")
    test = task.load_split("test")
    assert val and test
    assert not train & {e.question for e in val}
    assert not train & {e.question for e in test}


def test_caps() -> None:
    task = small(validation=7)
    assert len(task.load_split("validation")) == 7
    assert len(task.load_split("train")) == 300


def test_answers_are_consistent_and_scored() -> None:
    task = small()
    for ex in task.load_split("validation")[:20]:
        assert ex.meta["solution"].endswith(f"#### {ex.reference}")
        assert task.score(ex, ex.meta["solution"]) == 1
        assert task.score(ex, f"#### {int(ex.reference) + 1}") == 0
        assert ex.question in task.messages(ex)[0]["content"]
