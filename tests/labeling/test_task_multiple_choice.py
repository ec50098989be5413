"""MedQA-4 and ScienceQA (text-only) on tiny local fixtures in the hub row formats."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from labeling.tasks import TaskError
from labeling.tasks.medqa4 import MedQA4Task
from labeling.tasks.scienceqa import ScienceQATask


def medqa_row(i: int, gold: str = "C") -> dict:
    """A GBaker/MedQA-USMLE-4-options row."""
    options = {k: f"drug {k}{i}" for k in "ABCD"}
    return {"question": f"A {20 + i}-year-old patient presents with symptom {i}. Best treatment?",
            "answer": options[gold], "options": options, "meta_info": "step1", "answer_idx": gold}


@pytest.fixture
def medqa(tmp_path: Path, write_jsonl: Callable) -> str:
    write_jsonl(tmp_path / "medqa" / "train.jsonl", [medqa_row(i, "ABCD"[i % 4]) for i in range(10)])
    write_jsonl(tmp_path / "medqa" / "test.jsonl", [medqa_row(100 + i, "ABCD"[i % 4]) for i in range(4)])
    return str(tmp_path / "medqa")


def test_medqa_splits(medqa: str) -> None:
    task = MedQA4Task(source=medqa, val_size=3)
    train, val, test = (task.load_split(s) for s in ("train", "validation", "test"))
    assert (len(train), len(val), len(test)) == (7, 3, 4)
    assert not {e.question for e in train} & {e.question for e in val}
    assert [e.reference for e in test] == ["A", "B", "C", "D"]
    assert [e.question for e in MedQA4Task(source=medqa, val_size=3).load_split("validation")] == \
        [e.question for e in val]


def test_medqa_prompt_and_score(medqa: str) -> None:
    task = MedQA4Task(source=medqa, val_size=3)
    ex = task.load_split("test")[2]
    content = task.messages(ex)[0]["content"]
    assert ex.question in content
    assert "A. drug A102\nB. drug B102\nC. drug C102\nD. drug D102" in content
    assert "Answer: <letter>" in content
    assert task.score(ex, "It blocks the receptor.\nAnswer: C") == 1
    assert task.score(ex, "Answer: B") == 0
    assert task.score(ex, "I am not sure.") == 0
    assert task.max_new_tokens == 128


def test_medqa_options_as_list(tmp_path: Path, write_jsonl: Callable) -> None:
    r = medqa_row(0, "B") | {"options": ["w", "x", "y", "z"]}
    write_jsonl(tmp_path / "m" / "test.jsonl", [r])
    ex = MedQA4Task(source=str(tmp_path / "m")).load_split("test")[0]
    assert ex.meta["options"] == {"A": "w", "B": "x", "C": "y", "D": "z"}
    assert ex.reference == "B"


def test_medqa_bad_answer_idx_names_the_field(tmp_path: Path, write_jsonl: Callable) -> None:
    write_jsonl(tmp_path / "m" / "test.jsonl", [medqa_row(0) | {"answer_idx": "E"}])
    with pytest.raises(TaskError, match="answer_idx"):
        MedQA4Task(source=str(tmp_path / "m")).load_split("test")


def test_medqa_bad_options_names_the_field(tmp_path: Path, write_jsonl: Callable) -> None:
    write_jsonl(tmp_path / "m" / "test.jsonl", [medqa_row(0) | {"options": {"A": "x", "B": "y"}}])
    with pytest.raises(TaskError, match="options"):
        MedQA4Task(source=str(tmp_path / "m")).load_split("test")


def sqa_row(i: int, image: str | None = None, n_choices: int = 3, answer: int = 1, hint: str = "") -> dict:
    """A derek-thomas/ScienceQA row (``image`` is null for text-only questions)."""
    return {"image": image, "question": f"Which object is hardest? ({i})",
            "choices": [f"choice {j} of {i}" for j in range(n_choices)], "answer": answer, "hint": hint,
            "task": "closed choice", "grade": "grade4", "subject": "natural science", "topic": "physics",
            "category": "Materials", "skill": "Compare properties", "lecture": "...", "solution": "..."}


@pytest.fixture
def scienceqa(tmp_path: Path, write_jsonl: Callable) -> str:
    train = [sqa_row(i, image="img.png" if i % 3 == 0 else None) for i in range(8)]  # 0, 3, 6 have images
    test = [sqa_row(100, n_choices=2, answer=0, hint="Think about metals."), sqa_row(101, image="img.png"),
            sqa_row(102, n_choices=5, answer=4)]
    write_jsonl(tmp_path / "sqa" / "train.jsonl", train)
    write_jsonl(tmp_path / "sqa" / "test.jsonl", test)
    return str(tmp_path / "sqa")


def test_scienceqa_drops_image_rows_before_splitting(scienceqa: str) -> None:
    task = ScienceQATask(source=scienceqa, val_size=2)
    train, val, test = (task.load_split(s) for s in ("train", "validation", "test"))
    assert (len(train), len(val), len(test)) == (3, 2, 2)
    seen = {e.question for e in train} | {e.question for e in val}
    assert seen == {f"Which object is hardest? ({i})" for i in (1, 2, 4, 5, 7)}
    assert not {e.question for e in train} & {e.question for e in val}
    assert [e.reference for e in test] == ["A", "E"]


def test_scienceqa_prompt_and_score(scienceqa: str) -> None:
    task = ScienceQATask(source=scienceqa, val_size=2)
    two, five = task.load_split("test")
    content = task.messages(two)[0]["content"]
    assert content.startswith("Context: Think about metals.")
    assert "A. choice 0 of 100\nB. choice 1 of 100" in content
    assert "C." not in content
    assert not task.messages(five)[0]["content"].startswith("Context:")
    assert task.score(two, "Metals are hard. Answer: A") == 1
    assert task.score(two, "(C)") == 0  # not an option of a two-choice question
    assert task.score(five, "The answer is (E).") == 1
    assert task.score(five, "Answer: D") == 0
    assert task.max_new_tokens == 320


def test_scienceqa_all_image_rows_is_an_empty_split(tmp_path: Path, write_jsonl: Callable) -> None:
    write_jsonl(tmp_path / "s" / "test.jsonl", [sqa_row(i, image="img.png") for i in range(3)])
    with pytest.raises(TaskError, match="empty"):
        ScienceQATask(source=str(tmp_path / "s")).load_split("test")


def test_scienceqa_bad_answer_index_names_the_field(tmp_path: Path, write_jsonl: Callable) -> None:
    write_jsonl(tmp_path / "s" / "test.jsonl", [sqa_row(0, n_choices=2, answer=3)])
    with pytest.raises(TaskError, match="'answer'"):
        ScienceQATask(source=str(tmp_path / "s")).load_split("test")
