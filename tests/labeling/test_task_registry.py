"""Task registry and the user-facing errors of split loading."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from labeling.tasks import REGISTRY, SplitSizes, Task, TaskError, build_task
from labeling.tasks.gsm8k import GSM8KTask
from serve_bridge.values import OptionError


def test_registry_holds_all_paper_tasks() -> None:
    assert set(REGISTRY) == {"arith", "counter", "gsm8k", "spider", "medqa4", "scienceqa"}
    for name, cls in REGISTRY.items():
        assert cls.name == name


@pytest.mark.parametrize("name", sorted({"arith", "counter", "gsm8k", "spider", "medqa4", "scienceqa"}))
def test_every_registered_task_satisfies_the_protocol(name: str) -> None:
    task = build_task(name)
    assert isinstance(task, Task)
    assert task.max_new_tokens == {"arith": 48, "counter": 32, "gsm8k": 256, "spider": 256, "medqa4": 128, "scienceqa": 320}[name]


def test_unknown_task_lists_known_tasks() -> None:
    with pytest.raises(TaskError) as err:
        build_task("gsm9k")
    msg = str(err.value)
    assert "gsm9k" in msg
    for name in REGISTRY:
        assert name in msg
    assert "conf/task/gsm9k.yaml" in msg


def test_build_task_passes_sizes_and_options(gsm8k_subset: Path) -> None:
    task = build_task("gsm8k", sizes={"test": 5}, source=str(gsm8k_subset), val_size=8)
    assert isinstance(task, GSM8KTask)
    assert task.sizes == SplitSizes(test=5)
    assert len(task.load_split("test")) == 5


def test_missing_local_dataset_path(tmp_path: Path) -> None:
    task = GSM8KTask(source=str(tmp_path / "nowhere"))
    with pytest.raises(TaskError, match="does not exist") as err:
        task.load_split("train")
    assert str(tmp_path / "nowhere") in str(err.value)


def test_local_directory_without_split_file(tmp_path: Path, write_jsonl: Callable) -> None:
    write_jsonl(tmp_path / "test.jsonl", [{"question": "q", "answer": "#### 1"}])
    with pytest.raises(TaskError, match=r"train\.jsonl"):
        GSM8KTask(source=str(tmp_path)).load_split("train")


def test_size_cap_zero_is_refused_as_an_empty_split() -> None:
    with pytest.raises(OptionError, match="test=0: .*0 leaves it empty"):
        SplitSizes(test=0)


def test_validation_carve_eating_all_of_train_is_an_empty_split(gsm8k_subset: Path) -> None:
    # the default val_size (500) exceeds the 64-row subset: our train split is empty
    with pytest.raises(TaskError, match="empty"):
        GSM8KTask(source=str(gsm8k_subset)).load_split("train")


def test_empty_jsonl_file_is_an_empty_split(tmp_path: Path) -> None:
    (tmp_path / "train.jsonl").write_text("")
    with pytest.raises(TaskError, match="empty"):
        GSM8KTask(source=str(tmp_path), val_size=0).load_split("train")


def test_unknown_split_is_rejected(gsm8k_subset: Path) -> None:
    with pytest.raises(ValueError, match="validation"):
        GSM8KTask(source=str(gsm8k_subset)).load_split("dev")
