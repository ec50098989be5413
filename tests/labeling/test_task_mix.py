"""task=mix: parts interleaved and tagged, prompts and scores dispatched per part, requests routed to the
adapters that serve each part, and the config mistakes as TaskError."""
from __future__ import annotations

import pytest

from labeling.labels import build_requests
from labeling.tasks import MixTask, TaskError, build_task
from labeling.tasks.mix import PART_KEY
from serve_bridge.steptrim import NO_SLOT

PARTS = {"arith": {"sizes": {"validation": 3}, "options": {"max_new_tokens": 40}},
         "counter": {"sizes": {"validation": 5}}}


class FakeEngine:
    """Just the prompt encoding build_requests needs."""

    def encode(self, messages: list[dict[str, str]]) -> list[int]:
        return [len(messages[0]["content"])]


def test_parts_interleave_and_dispatch() -> None:
    mix = build_task("mix", parts=PARTS)
    assert isinstance(mix, MixTask) and mix.max_new_tokens == 40  # the larger of 40 and counter's 32
    rows = mix.load_split("validation")
    assert [r.meta[PART_KEY] for r in rows] == ["arith", "counter"] * 3 + ["counter"] * 2
    arith, counter = build_task("arith"), build_task("counter")
    for r in rows:
        own = arith if r.meta[PART_KEY] == "arith" else counter
        assert mix.messages(r) == own.messages(r)
        assert mix.score(r, r.meta["solution"]) == 1
    a, c = rows[0], rows[1]
    assert mix.score(c, f"#### {c.reference}") == 0  # counter's evaluator: the restatement is required
    assert mix.score(a, f"#### {a.reference}") == 1  # arith's: numeric match


def test_requests_go_to_the_adapters_serving_each_part() -> None:
    mix = build_task("mix", parts=PARTS)
    rows = mix.load_split("validation")
    pairs = build_requests(FakeEngine(), mix, rows, [0, 1, NO_SLOT], {0: "arith", 1: "counter"})
    by_slot = {s: [ex.meta[PART_KEY] for ex, r in pairs if r.slot == s] for s in (0, 1, NO_SLOT)}
    assert by_slot == {0: ["arith"] * 3, 1: ["counter"] * 5, NO_SLOT: [r.meta[PART_KEY] for r in rows]}
    assert [r.slot for _, r in pairs][:4] == [0, NO_SLOT, 1, NO_SLOT]  # batches mix adapters
    everyone = build_requests(FakeEngine(), mix, rows, [0, 1])  # no parts: every adapter gets every example
    assert len(everyone) == 2 * len(rows)


@pytest.mark.parametrize("kwargs, match", [
    ({"parts": {}}, "parts is empty"),
    ({"parts": PARTS, "seed": 1}, "unknown option"),
    ({"parts": {"mix": {}}}, "cannot itself be a mix"),
    ({"parts": PARTS, "sizes": {"train": 4}}, "sizes per part"),
    ({"parts": {"nope": {}}}, "unknown task 'nope'"),
])
def test_config_mistakes_are_task_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(TaskError, match=match):
        build_task("mix", **kwargs)
