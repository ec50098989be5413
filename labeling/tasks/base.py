"""Task contract: tasks are data (a split loader, a prompt template, an evaluator).

A task turns a split name into :class:`Example` rows, renders each example as chat
messages for the backbone's chat template, and scores a generated response with
Q(·) ∈ {0, 1}.  Tasks never import an engine; engines never import a task module.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

from labeling.options import CheckedOptions

SPLITS = ("train", "validation", "test")


class TaskError(ValueError):
    """A user-facing task/data problem (unknown task, missing path, empty split...)."""


@dataclass(frozen=True)
class Example:
    """One request of a task.

    uid: stable id, unique within the task (used to key caches and features).
    question: the user-facing problem text, before templating.
    reference: the gold answer in the task's own form (a number, a letter, SQL...).
    meta: task-specific extras (e.g. Spider's ``db_id``, MedQA's options).
    """

    uid: str
    question: str
    reference: str
    meta: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Task(Protocol):
    """What the pipeline needs from a task."""

    name: str
    max_new_tokens: int

    def load_split(self, split: str) -> list[Example]:
        """Return the examples of ``split`` (one of :data:`SPLITS`); raise TaskError if empty."""

    def messages(self, ex: Example) -> list[dict[str, str]]:
        """Chat messages for ``ex`` (rendered with the backbone's chat template)."""

    def score(self, ex: Example, response: str) -> int:
        """Q(response) ∈ {0, 1}: 1 iff the response answers ``ex`` correctly."""

    def decided(self, ex: Example, prefix: str) -> bool:
        """True only if every continuation of the response prefix ``prefix`` gets the same
        :meth:`score` (the engines may stop there); False when the task cannot tell."""


def require_nonempty(task: str, split: str, rows: list[Example], source: str) -> list[Example]:
    """Raise one clear TaskError when a split has no rows."""
    if not rows:
        raise TaskError(
            f"task '{task}': split '{split}' is empty (source: {source}). "
            f"Check the dataset path/id and the split sizes in conf/task/{task}.yaml."
        )
    return rows


@dataclass
class SplitSizes(CheckedOptions):
    """Optional caps on split sizes (None = all rows). Caps apply after the seeded split."""

    rules = {"train": "split_size", "validation": "split_size", "test": "split_size"}

    train: int | None = None
    validation: int | None = None
    test: int | None = None

    def cap(self, split: str, rows: list[Example]) -> list[Example]:
        n = getattr(self, split)
        return rows if n is None else rows[:n]


@dataclass
class BaseTask:
    """Shared plumbing for concrete tasks: name, options class, split caps.

    A concrete task is a dataclass that inherits its options (``Options``, a dataclass holding
    every option's type and default, ``max_new_tokens`` among them): the config schema
    (:mod:`calibrate.config`) and the constructor are the same declaration.
    """

    name: ClassVar[str]
    # Fields every row of the task's data must have, with their accepted types (checked on
    # local files before any work, see calibrate/validate.py).
    required_fields: ClassVar[dict[str, tuple[type, ...]]] = {}
    Options: ClassVar[type]
    sizes: SplitSizes = field(default_factory=SplitSizes)

    def decided(self, ex: Example, prefix: str) -> bool:
        """No answer-decided rule: every response is generated to its end."""
        return False

    def row_problem(self, row: dict[str, Any]) -> str | None:
        """What is wrong with a row of the task's local data beyond its ``required_fields`` (checked
        before any work, calibrate/validate.py), or None."""
        return None


@dataclass
class GeneratedTask(BaseTask):
    """A seeded generated task (its options have ``seed``): ``_generate(split)`` gives its
    (question, solution, answer) rows."""

    def _generate(self, split: str) -> list[tuple[str, str, str]]:
        raise NotImplementedError

    def load_split(self, split: str) -> list[Example]:
        """The ``_generate(split)`` rows, the evaluation splits without the questions train has,
        capped by ``sizes``; uids ``<name>-<split>-<i>``."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; use one of {SPLITS}")
        rows = self._generate(split)
        if split != "train":
            seen = {q for q, _, _ in self._generate("train")}
            rows = [r for r in rows if r[0] not in seen]
        examples = [Example(uid=f"{self.name}-{split}-{i}", question=q, reference=a, meta={"solution": s})
                    for i, (q, s, a) in enumerate(rows)]
        return require_nonempty(self.name, split, self.sizes.cap(split, examples), f"generated, seed={self.seed}")
