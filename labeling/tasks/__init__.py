"""Task registry: ``build_task(name, **options)`` maps a config to a :class:`Task`.

Tasks are data: each module declares a loader, a prompt template and an evaluator, and
registers its class here by name.
"""
from __future__ import annotations

from dataclasses import fields
from typing import Any

from labeling.tasks.arith import ArithTask
from labeling.tasks.base import SPLITS, Example, SplitSizes, Task, TaskError
from labeling.tasks.gsm8k import GSM8KTask
from labeling.tasks.counter import CounterTask
from labeling.tasks.medqa4 import MedQA4Task
from labeling.tasks.mix import MixTask
from labeling.tasks.scienceqa import ScienceQATask
from labeling.tasks.spider import SpiderTask
from serve_bridge.values import OptionError

REGISTRY: dict[str, type] = {
    ArithTask.name: ArithTask,
    CounterTask.name: CounterTask,
    GSM8KTask.name: GSM8KTask,
    SpiderTask.name: SpiderTask,
    MedQA4Task.name: MedQA4Task,
    ScienceQATask.name: ScienceQATask,
}


def build_task(name: str, sizes: dict[str, int | None] | None = None, **options: Any) -> Task:
    """Instantiate the registered task ``name``; raise TaskError for an unknown name.

    ``mix`` builds each of ``options["parts"]`` (part name → ``{options, sizes}``, as a task's
    own config) and combines them (:class:`labeling.tasks.mix.MixTask`); sizes go per part.
    """
    if name == MixTask.name:
        return _build_mix(sizes, options)
    cls = task_class(name)
    for kind, given, known in (("option", options, cls.Options), ("split size", sizes or {}, SplitSizes)):
        unknown = sorted(set(given) - {f.name for f in fields(known)})
        if unknown:
            raise TaskError(f"task {name!r} has no {kind} {unknown[0]!r}; its {kind}s: "
                            f"{', '.join(f.name for f in fields(known))}.")
    return cls(sizes=SplitSizes(**(sizes or {})), **options)


def task_class(name: str) -> type:
    """The registered task class ``name``; TaskError naming the known tasks for another name."""
    if name not in REGISTRY:
        raise TaskError(f"unknown task {name!r}; known tasks: {', '.join(sorted(REGISTRY))}. "
                        f"Add conf/task/{name}.yaml and register the class in labeling/tasks/__init__.py.")
    return REGISTRY[name]


def _build_mix(sizes: dict[str, int | None] | None, options: dict[str, Any]) -> MixTask:
    if any(v is not None for v in (sizes or {}).values()):
        raise TaskError("task 'mix': set sizes per part (task.options.parts.<part>.sizes), not task.sizes.")
    parts = options.pop("parts", None) or {}
    if options:
        raise TaskError(f"task 'mix': unknown option(s) {sorted(options)}; it takes only `parts`.")
    if MixTask.name in parts:
        raise TaskError("task 'mix': a part cannot itself be a mix.")
    built = {}
    for p, spec in parts.items():
        extra = sorted(set(spec or {}) - {"options", "sizes"})
        if extra:
            raise TaskError(f"task 'mix': part '{p}': unknown key {extra[0]!r}; a part takes `options` and `sizes`.")
        try:
            built[p] = build_task(p, sizes=(spec or {}).get("sizes"), **((spec or {}).get("options") or {}))
        except OptionError as err:
            raise TaskError(f"task 'mix': part '{p}': {err}") from err
    return MixTask(built)


__all__ = ["SPLITS", "Example", "MixTask", "REGISTRY", "SplitSizes", "Task", "TaskError", "build_task", "task_class"]
