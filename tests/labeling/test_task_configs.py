"""conf/task/*.yaml: every file names a registered task and extends its schema, so each option
is declared once (the task's ``Options`` dataclass) and checked by Hydra."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hydra.errors import ConfigCompositionException

from labeling.tasks import REGISTRY, build_task
from tests.calibrate.test_pipeline import compose_cfg

CONF = Path(__file__).resolve().parents[2] / "conf" / "task"
EXPECTED_LIMITS = {"arith": 48, "counter": 32, "gsm8k": 256, "spider": 256, "medqa4": 128, "scienceqa": 320}


def load(name: str) -> dict:
    return yaml.safe_load((CONF / f"{name}.yaml").read_text())


def test_one_config_per_registered_task() -> None:
    """Plus demo.yaml, a mix of registered tasks that extends the mix schema."""
    assert {p.stem for p in CONF.glob("*.yaml")} == set(REGISTRY) | {"demo"}
    assert load("demo")["defaults"] == ["base_mix", "_self_"]
    assert compose_cfg(["task=demo"]).task.name == "mix"


@pytest.mark.parametrize("name", sorted(EXPECTED_LIMITS))
def test_config_extends_its_task_schema(name: str) -> None:
    assert (CONF / f"{name}.yaml").read_text().startswith("#")
    assert load(name)["defaults"] == [f"base_{name}", "_self_"]
    cfg = compose_cfg([f"task={name}"]).task
    assert cfg.name == name and cfg.options.max_new_tokens == EXPECTED_LIMITS[name]
    task = build_task(cfg.name, sizes=dict(cfg.sizes), **cfg.options)
    assert type(task) is REGISTRY[name] and task.max_new_tokens == EXPECTED_LIMITS[name]
    # the schema's defaults are the class's, so build_task(name) alone is the paper setting
    assert build_task(name).__dict__.keys() >= dict(cfg.options).keys()
    assert {k: getattr(build_task(name), k) for k in cfg.options} == dict(cfg.options)


def test_options_are_typed_and_closed() -> None:
    assert compose_cfg(["task=gsm8k", "task.options.val_size=8"]).task.options.val_size == 8
    with pytest.raises(ConfigCompositionException, match="val_sise"):
        compose_cfg(["task=gsm8k", "task.options.val_sise=8"])
    with pytest.raises(ConfigCompositionException, match="val_size"):
        compose_cfg(["task=gsm8k", "task.options.val_size=many"])


def test_the_default_is_the_two_adapter_demo() -> None:
    """`python -m calibrate` with no arguments (make demo): task=demo adapter=demo, counter's
    validation large enough for a 2-point budget on an exact 95 % bound with no request broken."""
    cfg = compose_cfg([])
    assert cfg.task.name == "mix" and cfg.adapter.name == "demo"
    assert sorted(cfg.task.options.parts) == ["arith", "counter"]
    assert cfg.task.options.parts.counter.sizes.validation >= 149


def test_arith_config_builds_small_splits() -> None:
    cfg = compose_cfg(["task=arith"]).task
    assert dict(cfg.sizes) == {"train": 96, "validation": 48, "test": 48}
    task = build_task(cfg.name, sizes=dict(cfg.sizes), **cfg.options)
    assert len(task.load_split("validation")) == 48
    assert len(task.load_split("test")) == 48


def test_gsm8k_config_points_at_the_hub() -> None:
    assert compose_cfg(["task=gsm8k"]).task.options.source == "openai/gsm8k"
