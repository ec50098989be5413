"""Several tasks in one run: each adapter serves the requests of one part.

A mix task holds named parts (built tasks). Its splits interleave the parts' splits round
robin (so engine batches mix adapters), each example tagged with its part in
``meta["task"]``; prompts and scores dispatch to that part. An adapter declares the part it
serves (``adapter.adapters[].task``), and the pipeline builds its requests from that part's
examples only (:func:`labeling.labels.build_requests`). The response limit is the largest of
the parts' limits: one engine call generates for all parts at once.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any
from itertools import zip_longest

from labeling.tasks.base import Example, Task, TaskError

PART_KEY = "task"  # Example.meta key naming the part an example belongs to


@dataclass
class MixOptions:
    """parts: part name → that task's own config (``{options, sizes}``)."""

    parts: dict[str, Any] = field(default_factory=dict)


class MixTask:
    """The union of named ``parts``; sizes apply per part (each part's own ``sizes``)."""

    name = "mix"

    def __init__(self, parts: Mapping[str, Task]) -> None:
        if not parts:
            raise TaskError("task 'mix': options.parts is empty; name at least one task, e.g. "
                            "parts: {arith: {}, counter: {}} (conf/task/demo.yaml).")
        self.parts = dict(parts)
        self.max_new_tokens = max(p.max_new_tokens for p in self.parts.values())

    def load_split(self, split: str) -> list[Example]:
        per_part = [[replace(ex, meta={**ex.meta, PART_KEY: name}) for ex in part.load_split(split)]
                    for name, part in self.parts.items()]
        rows = [ex for group in zip_longest(*per_part) for ex in group if ex is not None]
        uids = [ex.uid for ex in rows]
        if len(set(uids)) != len(uids):
            raise TaskError(f"task 'mix': parts {list(self.parts)} share example uids in split '{split}'; "
                            f"each part must name its examples uniquely.")
        return rows

    def part(self, ex: Example) -> Task:
        """The part that ``ex`` belongs to."""
        name = ex.meta.get(PART_KEY)
        if name not in self.parts:
            raise KeyError(f"example {ex.uid} belongs to no part of this mix ({ex.meta.get(PART_KEY)!r})")
        return self.parts[name]

    def messages(self, ex: Example) -> list[dict[str, str]]:
        return self.part(ex).messages(ex)

    def score(self, ex: Example, response: str) -> int:
        return self.part(ex).score(ex, response)

    def decided(self, ex: Example, prefix: str) -> bool:
        return self.part(ex).decided(ex, prefix)
