"""The config schema: one dataclass per config group, registered in Hydra's ConfigStore.

Each YAML file in conf/ extends its group's schema through its defaults list (``base_<option>``),
so Hydra checks every key and type while composing (an unknown key, or ``engine.batch_size=x``,
is a config error) and a key the YAML does not set takes the dataclass's default. The option
dataclasses live next to the code they configure: each task's ``Options`` (labeling/tasks),
:class:`~labeling.engines.hf.HFOptions`, :class:`~labeling.engines.vllm.options.VLLMOptions`,
:class:`~labeling.engines.auto.AutoOptions`, :class:`~labeling.backbone.BackboneSpec`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from calibrate.resolvers import register_resolvers
from labeling.backbone import BackboneSpec
from labeling.engines.auto import AutoOptions
from labeling.engines.hf import HFOptions
from labeling.engines.vllm.options import VLLMOptions
from labeling.tasks import REGISTRY, SplitSizes
from labeling.tasks.mix import MixOptions, MixTask


@dataclass
class TaskConfig:
    """name: a registered task; options: its ``Options`` dataclass; sizes: split caps."""

    name: str = MISSING
    options: Any = MISSING
    sizes: SplitSizes = field(default_factory=SplitSizes)


@dataclass
class AdapterConfig:
    """name: the adapter set's name (in the run directory's name); adapters: {name, path} each, and
    ``task`` (the part of a mixed task it serves) where the task mixes several."""

    name: str = MISSING
    adapters: list[dict[str, str]] = field(default_factory=list)


@dataclass
class LabelingConfig:
    """points: release points T; task_points: task name → the release points of that task's
    requests instead (the run's task, or a part of a mix task; other names are ignored);
    shard_requests: requests per resumable shard, or ``auto``
    (:attr:`calibrate.context.Context.shard_requests`)."""

    points: list[int] = field(default_factory=lambda: [0, 1, 2, 3, 7, 15, 31, 63])
    task_points: dict[str, list[int]] = field(default_factory=dict)
    shard_requests: str = "auto"


@dataclass
class PredictorConfig:
    """One linear head per adapter (predictors/heads.py) with L2 weight ``lam``."""

    name: str = "linear"
    lam: float = 0.1


@dataclass
class SweepConfig:
    """The exact one-pass sweep (predictors/sweep.py): τ quantiles per head, τ at target training
    skip levels, profiled ks, and the confidence of each candidate's loss upper bound."""

    n_tau: int = 32
    skip_levels: list[float] = field(default_factory=lambda: [
        0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5,
        0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0])
    ks: list[int] = field(default_factory=lambda: [0, 1, 2, 4, 8, 16, 32, 64, 128])
    confidence: float = 0.95


@dataclass
class ExportConfig:
    """rule: budget (``budget``: the allowed validation accuracy loss in points, on its upper bound)
    | P25 | P50 | P75; policy: learned | profiled."""

    rule: str = "budget"
    budget: float = 2.0
    policy: str = "learned"
    table_format: str = "csv"


@dataclass
class Config:
    """The composed config. stages: to run, in order; agreement: add the agreement stage;
    preview: print the cost preview (labeling's first shard measured) and stop."""

    task: TaskConfig = MISSING
    backbone: BackboneSpec = MISSING
    adapter: AdapterConfig = MISSING
    engine: Any = MISSING
    labeling: LabelingConfig = MISSING
    predictor: PredictorConfig = MISSING
    sweep: SweepConfig = MISSING
    export: ExportConfig = MISSING
    stages: list[str] = field(default_factory=lambda: ["data", "labels", "heads", "sweep", "export", "test"])
    seed: int = 0
    agreement: bool = False
    preview: bool = False


ENGINES = {"auto": AutoOptions, "hf": HFOptions, "vllm": VLLMOptions}


def register() -> None:
    """Store every schema (idempotent) and the ``lorazor_data`` resolver; call before composing."""
    register_resolvers()
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for name, cls in REGISTRY.items():
        cs.store(group="task", name=f"base_{name}", node=TaskConfig(name=name, options=cls.Options()))
    cs.store(group="task", name=f"base_{MixTask.name}", node=TaskConfig(name=MixTask.name, options=MixOptions()))
    for name, options in ENGINES.items():
        cs.store(group="engine", name=f"base_{name}", node=options)
    for group, node in (("backbone", BackboneSpec), ("adapter", AdapterConfig), ("labeling", LabelingConfig),
                        ("predictor", PredictorConfig), ("sweep", SweepConfig), ("export", ExportConfig)):
        cs.store(group=group, name="base", node=node)
