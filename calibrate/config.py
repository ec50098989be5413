"""The config schema: one dataclass per config group, registered in Hydra's ConfigStore.

Each YAML file in conf/ extends its group's schema through its defaults list (``base_<option>``),
so Hydra checks every key and type while composing (an unknown key, or ``engine.batch_size=x``,
is a config error) and a key the YAML does not set takes the dataclass's default. The option
dataclasses live next to the code they configure: each task's ``Options`` (labeling/tasks),
:class:`~labeling.engines.hf.HFOptions`, :class:`~labeling.engines.vllm.options.VLLMOptions`,
:class:`~labeling.engines.auto.AutoOptions`, :class:`~labeling.backbone.BackboneSpec`.

Every dataclass checks its values when it is built (``__post_init__``, :mod:`labeling.options`);
:func:`check_config` builds the composed config and so runs every check, before any work.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from calibrate.errors import ConfigError
from calibrate.resolvers import register_resolvers
from labeling.backbone import BackboneSpec
from labeling.engines.auto import AutoOptions
from labeling.engines.hf import HFOptions
from labeling.engines.vllm.options import VLLMOptions
from labeling.options import CheckedOptions
from labeling.tasks import REGISTRY, SplitSizes, task_class
from labeling.tasks.mix import MixOptions, MixTask
from predictors.frontier import POLICIES, parse_rule, resolve_rule
from serve_bridge.steptrim import MAX_LAG
from serve_bridge.values import OptionError, check_value


@dataclass
class TaskConfig:
    """name: a registered task; options: its ``Options`` dataclass; sizes: split caps."""

    name: str = MISSING
    options: Any = MISSING
    sizes: SplitSizes = field(default_factory=SplitSizes)

    def __post_init__(self) -> None:
        expected = MixOptions if self.name == MixTask.name else task_class(self.name).Options
        if not isinstance(self.options, expected):
            raise OptionError("name", self.name, f"the options are {type(self.options).__name__}'s; choose the "
                              f"task with task={self.name}, which brings its own options")


@dataclass
class AdapterConfig:
    """name: the adapter set's name (in the run directory's name); adapters: {name, path} each, and
    ``task`` (the part of a mixed task it serves) where the task mixes several; at least one, names
    unique."""

    name: str = MISSING
    adapters: list[dict[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.adapters:
            raise OptionError("adapters", self.adapters, "list at least one {name, path} (see conf/adapter/custom.yaml)")
        for i, entry in enumerate(self.adapters):
            if not {"name", "path"} <= set(entry) <= {"name", "path", "task"}:
                raise OptionError(f"adapters[{i}]", entry, "use {name: <serving name>, path: <peft directory>} "
                                  "with an optional task: <part of a mix task>")
            for key in ("name", "path"):
                check_value(f"adapters[{i}].{key}", entry[key], "text")
        names = [entry["name"] for entry in self.adapters]
        if len(set(names)) != len(names):
            raise OptionError("adapters", names, "give each adapter its own name")


@dataclass
class LabelingConfig(CheckedOptions):
    """points: release points T; task_points: task name → the release points of that task's
    requests instead (the run's task, or a part of a mix task; other names are ignored);
    shard_requests: requests per resumable shard, or ``auto``
    (:attr:`calibrate.context.Context.shard_requests`); early_stop: the engines stop a response
    where its answer is decided instead of cutting it there afterwards (:mod:`labeling.answer_cut`;
    the same results, in every generating stage)."""

    rules = {"points": "points", "shard_requests": "auto_or_positive_int", "early_stop": (True, False)}

    points: list[int] = field(default_factory=lambda: [0, 1, 2, 3, 7, 15, 31, 63])
    task_points: dict[str, list[int]] = field(default_factory=dict)
    shard_requests: str = "auto"
    early_stop: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        for task, points in self.task_points.items():
            check_value(f"task_points.{task}", points, "points")


@dataclass
class PredictorConfig(CheckedOptions):
    """One linear head per adapter (predictors/heads.py) with L2 weight ``lam``."""

    rules = {"lam": "positive_number"}

    name: str = "linear"
    lam: float = 0.1


@dataclass
class SweepConfig(CheckedOptions):
    """The exact one-pass sweep (predictors/sweep.py): τ quantiles per head, τ at target training
    skip levels, profiled ks, the confidence of each candidate's loss upper bound, and the learned
    policies' decision lag: a decision on forward t releases from forward t + 1 + decision_lag on
    (1, the default, lets vLLM's default async scheduling serve the bundle without waiting for
    decisions; 0 releases a forward earlier and makes an async server wait; docs/design.md §2)."""

    rules = {"n_tau": "positive_int", "ks": "points", "confidence": "probability", "skip_levels": "fractions",
             "decision_lag": "non_negative_int"}

    n_tau: int = 32
    skip_levels: list[float] = field(default_factory=lambda: [
        0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5,
        0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0])
    ks: list[int] = field(default_factory=lambda: [0, 1, 2, 4, 8, 16, 32, 64, 128])
    confidence: float = 0.95
    decision_lag: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.decision_lag > MAX_LAG:
            raise OptionError("decision_lag", self.decision_lag, f"use 0 or 1 (at most {MAX_LAG})")


@dataclass
class ExportConfig(CheckedOptions):
    """rule: budget (``budget``: the allowed validation accuracy loss in points, on its upper bound)
    | P<percent> (P25, P50, P75...); policy: learned | profiled."""

    rules = {"budget": "non_negative_number", "policy": POLICIES, "table_format": ("csv",)}

    rule: str = "budget"
    budget: float = 2.0
    policy: str = "learned"
    table_format: str = "csv"

    def __post_init__(self) -> None:
        super().__post_init__()
        try:
            parse_rule(resolve_rule(self.rule, self.budget))  # as the export stage reads them
        except ValueError as err:
            key, value = ("budget", self.budget) if self.rule == "budget" else ("rule", self.rule)
            raise OptionError(key, value, "use P<percent> with 0 < percent ≤ 100 (e.g. P50) or budget "
                              "(the largest skip within export.budget points)") from err


@dataclass
class Config:
    """The composed config. stages: to run, in order; agreement: add the agreement stage;
    preview: print the cost preview (measured on labeling's first shards) and stop."""

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

    def __post_init__(self) -> None:
        if not self.stages:
            raise OptionError("stages", self.stages, "name at least one stage")
        if not isinstance(self.engine, ENGINES.get(self.engine.name, ())):
            raise OptionError("engine", self.engine.name, "use engine=auto (the default), engine=hf (transformers + "
                              "peft) or engine=vllm (GPU)")


ENGINES = {"auto": AutoOptions, "hf": HFOptions, "vllm": VLLMOptions}
# The nodes below the root, leaves first: check_config builds them in this order, so an error names its node.
NODES = ("task.options", "task.sizes", "task", "backbone", "adapter", "engine", "labeling", "predictor", "sweep",
         "export")


def check_config(cfg: DictConfig) -> Config:
    """``cfg`` as its dataclasses, every value checked (their ``__post_init__``); a ConfigError whose
    one line names the key (``export.budget=-1: …``) on the first bad value, a TaskError for an
    unknown task."""
    for path in NODES:
        _build(cfg, path)
    return _build(cfg, "")


def _build(cfg: DictConfig, path: str) -> Any:
    """The node at ``path`` ("" = the root) as its dataclass, which has every key the node has
    (``+key=value`` can add one the schema lacks)."""
    node = OmegaConf.select(cfg, path) if path else cfg
    if not isinstance(node, DictConfig):  # e.g. task.options=5
        raise ConfigError(f"{path}={node!r}: {path} is a group of keys; set one with {path}.<key>=<value>.")
    try:
        built = OmegaConf.to_object(node)
    except OptionError as err:
        raise ConfigError(f"{path}.{err}" if path else str(err)) from err
    except OmegaConfBaseException as err:  # an interpolation that does not resolve, e.g. ${oops}
        raise ConfigError(f"the config does not resolve: {str(err).splitlines()[0]}") from err
    known = [f.name for f in fields(built)]
    unknown = sorted(set(node) - set(known))
    if unknown:
        raise ConfigError(f"{path}.{unknown[0]}: no such key; {path} has {known}.")
    return built


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
