"""The second embedded demo task: a count that changes a variable number of times.

A question gives a start count and 1…``max_moves`` changes (``gets d more`` / ``gives away
d``, the count stays in 0–9). The trained response writes the count after each change as one
digit (the tokenizer splits digits, so one token per change), then commits with ``#### N``
and ends with the restatement ``The answer is N.``::

    758
    #### 8
    The answer is 8.

The changes need the adapter: SmolLM2-135M alone does not keep the running count (nor the
format). Once the answer is committed, the restatement is what the backbone writes by itself
after a ``#### N`` line for a "how many" question, and then it ends the turn. So the point
after which the adapter can be dropped is the commit, and it moves with the number of
changes (one digit token each), while the tail after it is the same few tokens for every
request. A fixed release step k must wait for the longest chain; a per-request
release can stop right after the commit.

Scored by :func:`labeling.evaluators.restated.restated_match` (``#### N``, then one sentence
stating N). Splits come from disjoint seeds (train: seed, validation: seed+1, test:
seed+2); validation and test drop questions that also occur in train. Pure Python
``random.Random``, so every machine yields the same rows.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from labeling.evaluators.restated import restated_decided, restated_match, restatement
from labeling.options import CheckedOptions
from labeling.tasks.base import SPLITS, Example, GeneratedTask

NAMES = ("Ann", "Ben", "Cara", "Dan", "Eva", "Finn", "Gia", "Hugo", "Ivy", "Jon", "Kim", "Leo")
ITEMS = ("apples", "marbles", "stickers", "coins", "books", "cards", "shells", "pens")
INSTRUCTION = ("Solve it step by step: write the count after each change as one digit, all digits on one line, "
               "then give the final answer as '#### <number>', then say the answer in a sentence.")


def make_problem(rng: random.Random, max_moves: int) -> tuple[str, str, str]:
    """One problem: (question, worked solution, answer); 1…max_moves changes, counts in 0–9."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    value = rng.randint(0, 9)
    start, moves, values = value, [], []
    for _ in range(rng.randint(1, max_moves)):
        ups = range(1, 10 - value)
        downs = range(1, value + 1)
        if downs and (not ups or rng.random() < 0.5):
            d = rng.choice(downs)
            moves.append(f"gives away {d}")
            value -= d
        else:
            d = rng.choice(ups)
            moves.append(f"gets {d} more")
            value += d
        values.append(str(value))
    question = f"{name} has {start} {item}. {name} {', then '.join(moves)}. How many {item} does {name} have now?"
    solution = "".join(values) + f"\n#### {value}\n" + restatement(str(value))
    return question, solution, str(value)


@dataclass
class CounterOptions(CheckedOptions):
    """max_moves: the most changes a problem has (1…12)."""

    rules = {"max_new_tokens": "positive_int", "seed": "integer", "max_moves": tuple(range(1, 13))}

    max_new_tokens: int = 32
    seed: int = 0
    max_moves: int = 6


@dataclass
class CounterTask(GeneratedTask, CounterOptions):
    """Running count over 1…``max_moves`` changes, ``#### N`` then ``The answer is N.``

    n_generate: problems generated per split (not a config option).
    """

    name = "counter"
    Options = CounterOptions
    n_generate: dict[str, int] = field(default_factory=lambda: {"train": 4000, "validation": 600, "test": 600})

    def _generate(self, split: str) -> list[tuple[str, str, str]]:
        rng = random.Random(self.seed * 1000 + 500 + SPLITS.index(split))
        return [make_problem(rng, self.max_moves) for _ in range(self.n_generate[split])]

    def messages(self, ex: Example) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"{INSTRUCTION}\n{ex.question}"}]

    def score(self, ex: Example, response: str) -> int:
        return restated_match(response, ex.reference)

    def decided(self, ex: Example, prefix: str) -> bool:
        return restated_decided(prefix, ex.reference)
