"""GSM8K from the shipped subset: split counts, deterministic validation carve, scoring."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from labeling.tasks.gsm8k import GSM8KTask


def test_shipped_subset_files(gsm8k_subset: Path) -> None:
    assert len((gsm8k_subset / "train.jsonl").read_text().splitlines()) == 64
    assert len((gsm8k_subset / "test.jsonl").read_text().splitlines()) == 32
    assert (gsm8k_subset / "LICENSE").read_text().startswith("MIT License")
    assert "gsm8k" in (gsm8k_subset / "README.md").read_text().lower()


@pytest.fixture(scope="module")
def splits(gsm8k_subset: Path) -> dict[str, list]:
    task = GSM8KTask(source=str(gsm8k_subset), val_size=16, seed=1234)
    return {s: task.load_split(s) for s in ("train", "validation", "test")}


def test_split_counts(splits: dict[str, list]) -> None:
    assert {s: len(v) for s, v in splits.items()} == {"train": 48, "validation": 16, "test": 32}


def test_validation_carved_from_train(splits: dict[str, list], gsm8k_subset: Path) -> None:
    train_q = {e.question for e in splits["train"]}
    val_q = {e.question for e in splits["validation"]}
    file_q = {json.loads(line)["question"] for line in (gsm8k_subset / "train.jsonl").read_text().splitlines()}
    assert not train_q & val_q
    assert train_q | val_q == file_q
    assert not val_q & {e.question for e in splits["test"]}


def test_carve_is_deterministic_and_seeded(splits: dict[str, list], gsm8k_subset: Path) -> None:
    again = GSM8KTask(source=str(gsm8k_subset), val_size=16, seed=1234).load_split("validation")
    assert [e.question for e in again] == [e.question for e in splits["validation"]]
    other = GSM8KTask(source=str(gsm8k_subset), val_size=16, seed=99).load_split("validation")
    assert {e.question for e in other} != {e.question for e in splits["validation"]}


def test_official_test_kept_in_order(splits: dict[str, list], gsm8k_subset: Path) -> None:
    first = json.loads((gsm8k_subset / "test.jsonl").read_text().splitlines()[0])
    ex = splits["test"][0]
    assert ex.question == first["question"]
    assert ex.reference == first["answer"].split("####")[-1].strip()
    assert len({e.uid for e in splits["test"]}) == 32


def test_gold_solution_scores_1_and_wrong_scores_0(splits: dict[str, list], gsm8k_subset: Path) -> None:
    task = GSM8KTask(source=str(gsm8k_subset))
    for ex in splits["test"][:8]:
        assert task.score(ex, ex.meta["solution"]) == 1
        assert task.score(ex, f"#### {ex.reference}1") == 0
    assert "<<" not in splits["test"][0].meta["solution"]
