"""conf/task/*.yaml: every file names a registered task and only options its class accepts."""
from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import yaml

from labeling.tasks import REGISTRY, SplitSizes, build_task

CONF = Path(__file__).resolve().parents[2] / "conf" / "task"
EXPECTED_LIMITS = {"arith": 48, "gsm8k": 256, "spider": 256, "medqa4": 128, "scienceqa": 320}


def load(name: str) -> dict:
    return yaml.safe_load((CONF / f"{name}.yaml").read_text())


def test_one_config_per_registered_task() -> None:
    assert {p.stem for p in CONF.glob("*.yaml")} == set(REGISTRY)


@pytest.mark.parametrize("name", sorted(EXPECTED_LIMITS))
def test_config_matches_its_task_class(name: str) -> None:
    cfg = load(name)
    assert (CONF / f"{name}.yaml").read_text().startswith("#")
    assert cfg["name"] == name
    assert set(cfg) == {"name", "options", "sizes"}
    assert cfg["options"]["max_new_tokens"] == EXPECTED_LIMITS[name]
    inspect.signature(REGISTRY[name]).bind(**cfg["options"], sizes=SplitSizes(**cfg["sizes"]))
    # the class defaults agree with the config, so build_task(name) alone is the paper setting
    defaults = {k: p.default for k, p in inspect.signature(REGISTRY[name]).parameters.items()}
    assert {k: v for k, v in cfg["options"].items() if defaults[k] != v} == {}


def test_arith_demo_config_builds_small_splits() -> None:
    cfg = load("arith")
    assert cfg["sizes"] == {"train": 96, "validation": 48, "test": 48}
    task = build_task(cfg["name"], sizes=cfg["sizes"], **cfg["options"])
    assert len(task.load_split("validation")) == 48
    assert len(task.load_split("test")) == 48


def test_gsm8k_config_points_at_the_hub() -> None:
    assert load("gsm8k")["options"]["source"] == "openai/gsm8k"
