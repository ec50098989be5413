"""The config dataclasses check their values when built: from Python, through
``OmegaConf.to_object`` on a composed config, and through check_config (one line naming the key)
and the CLI (that line on stderr, exit code 2)."""
from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from calibrate.config import Config, ExportConfig, LabelingConfig, check_config
from calibrate.errors import ConfigError
from labeling.backbone import BackboneSpec
from labeling.engines.hf import HFOptions
from labeling.engines.vllm.options import VLLMOptions
from labeling.tasks import SplitSizes, TaskError, build_task
from serve_bridge.values import OptionError
from tests.calibrate.test_pipeline import TINY, cli, compose_cfg


@pytest.mark.parametrize("build, fragment", [
    (lambda: HFOptions(batch_size=0), "batch_size=0: use a positive integer"),
    (lambda: VLLMOptions(gpu_memory_utilization=0.0), "gpu_memory_utilization=0.0"),
    (lambda: VLLMOptions(dtype="fp8"), "dtype='fp8': use one of"),
    (lambda: BackboneSpec(name="x"), "hf_id=None"),
    (lambda: BackboneSpec(name="x", hf_id="h", dtype="int8"), "dtype='int8'"),
    (lambda: SplitSizes(train=0), "train=0"),
    (lambda: build_task("gsm8k", val_size=-1), "val_size=-1: use a non-negative integer"),
    (lambda: build_task("spider", timeout_s=0), "timeout_s=0"),
    (lambda: build_task("counter", max_moves=13), "max_moves=13"),
    (lambda: LabelingConfig(points=[]), "points=[]"),
    (lambda: ExportConfig(rule="median"), "rule='median'"),
    (lambda: ExportConfig(budget=-1.0), "budget=-1.0: use a non-negative number"),
])
def test_options_check_their_values_when_built(build: Callable[[], object], fragment: str) -> None:
    with pytest.raises(OptionError, match=re.escape(fragment)):
        build()


def test_to_object_runs_the_checks() -> None:
    """Hydra's composition checks types only; OmegaConf.to_object builds the dataclasses, so their
    __post_init__ runs, on the node and on the whole config."""
    cfg = compose_cfg([*TINY, "export.budget=-1"])
    assert cfg.export.budget == -1  # composed without complaint
    with pytest.raises(OptionError, match="budget=-1.0"):
        OmegaConf.to_object(cfg.export)
    with pytest.raises(OptionError, match="budget=-1.0"):
        OmegaConf.to_object(cfg)


def test_check_config_builds_every_group() -> None:
    config = check_config(compose_cfg(TINY))
    assert isinstance(config, Config) and isinstance(config.engine.progress, bool)
    assert config.task.options.max_new_tokens == 40 and config.task.sizes.train == 6
    demo = check_config(compose_cfg(["task=demo", "adapter=demo"]))
    assert sorted(demo.task.options.parts) == ["arith", "counter"]


@pytest.mark.parametrize("override, error, line", [
    ("export.budget=-1", ConfigError, "export.budget=-1.0: use a non-negative number."),
    ("engine=hf;engine.batch_size=0", ConfigError, "engine.batch_size=0: use a positive integer."),
    ("engine=hf;engine.cpu_matmul=fp8", ConfigError, "engine.cpu_matmul='fp8': use one of ['auto', 'float32', 'bfloat16']."),
    ("task.name=nope", TaskError, "unknown task 'nope'"),
])
def test_check_config_names_the_key_in_one_line(override: str, error: type, line: str) -> None:
    with pytest.raises(error) as info:
        check_config(compose_cfg([*TINY, *override.split(";")]))
    assert str(info.value).startswith(line) and "\n" not in str(info.value)


def test_cli_reports_a_bad_value_in_one_line(tmp_path: Path) -> None:
    proc = cli(tmp_path / "run", *TINY, "labeling.points=[0,-1]")
    _, err = proc.communicate(timeout=300)
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 2, err
    assert lines == ["error: labeling.points=[0, -1]: use a non-empty list of non-negative integers."], err
