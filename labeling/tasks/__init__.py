"""Task registry: ``build_task(name, **options)`` maps a config to a :class:`Task`.

Tasks are data: each module declares a loader, a prompt template and an evaluator, and
registers its class here by name.
"""
from __future__ import annotations

from typing import Any

from labeling.tasks.arith import ArithTask
from labeling.tasks.base import SPLITS, Example, SplitSizes, Task, TaskError
from labeling.tasks.gsm8k import GSM8KTask
from labeling.tasks.medqa4 import MedQA4Task
from labeling.tasks.scienceqa import ScienceQATask
from labeling.tasks.spider import SpiderTask

REGISTRY: dict[str, type] = {
    ArithTask.name: ArithTask,
    GSM8KTask.name: GSM8KTask,
    SpiderTask.name: SpiderTask,
    MedQA4Task.name: MedQA4Task,
    ScienceQATask.name: ScienceQATask,
}


def build_task(name: str, sizes: dict[str, int | None] | None = None, **options: Any) -> Task:
    """Instantiate the registered task ``name``; raise TaskError for an unknown name."""
    if name not in REGISTRY:
        raise TaskError(f"unknown task {name!r}; known tasks: {', '.join(sorted(REGISTRY))}. "
                        f"Add conf/task/{name}.yaml and register the class in labeling/tasks/__init__.py.")
    return REGISTRY[name](sizes=SplitSizes(**(sizes or {})), **options)


__all__ = ["SPLITS", "Example", "REGISTRY", "SplitSizes", "Task", "TaskError", "build_task"]
