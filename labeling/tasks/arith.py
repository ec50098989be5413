"""The embedded demo task: seeded multi-step arithmetic word problems.

SmolLM2-135M-Instruct alone rarely gets these right; a rank-8 LoRA trained on the
train split (``scripts/train_adapter.py``) learns the chain format
``a + b = c`` … ``#### N``. Early in the response the adapter sets the chain up; once the
chain is under way the backbone can often finish it by itself, which is exactly the
trade-off StepTrim calibrates.

Splits are generated from disjoint seeds (train: seed, validation: seed+1, test: seed+2)
and validation/test drop any question that also occurs in train. Generation is pure
Python ``random.Random``, so every machine yields the same rows.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from labeling.evaluators.numeric import numeric_decided, numeric_match
from labeling.options import CheckedOptions
from labeling.tasks.base import SPLITS, Example, GeneratedTask

NAMES = ("Ann", "Ben", "Cara", "Dan", "Eva", "Finn", "Gia", "Hugo", "Ivy", "Jon", "Kim", "Leo")
ITEMS = ("apples", "marbles", "stickers", "coins", "books", "cards", "shells", "pens")
GAIN = ("finds {n} more", "buys {n} more", "gets {n} more", "is given {n} more")
LOSS = ("gives away {n}", "loses {n}", "sells {n}", "uses {n}")

INSTRUCTION = "Solve step by step, then give the final answer as '#### <number>'."


def make_problem(rng: random.Random) -> tuple[str, str, str]:
    """One problem: (question, worked solution, answer). Values stay in [0, 99]."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    value = rng.randint(5, 40)
    clauses, steps = [], []
    for _ in range(rng.randint(2, 3)):
        if value > 10 and rng.random() < 0.45:
            n = rng.randint(1, min(value - 1, 30))
            clauses.append(rng.choice(LOSS).format(n=n))
            steps.append(f"{value} - {n} = {value - n}")
            value -= n
        else:
            n = rng.randint(1, min(99 - value, 30))
            clauses.append(rng.choice(GAIN).format(n=n))
            steps.append(f"{value} + {n} = {value + n}")
            value += n
    start = steps[0].split(" ")[0]
    question = (
        f"{name} has {start} {item}. {name} " + ", then ".join(clauses)
        + f". How many {item} does {name} have now?"
    )
    solution = "\n".join(steps) + f"\n#### {value}"
    return question, solution, str(value)


@dataclass
class ArithOptions(CheckedOptions):
    rules = {"max_new_tokens": "positive_int", "seed": "integer"}

    max_new_tokens: int = 48
    seed: int = 0


@dataclass
class ArithTask(GeneratedTask, ArithOptions):
    """Seeded arithmetic word problems with a ``#### N`` answer (numeric match).

    n_generate: problems generated per split before the train/eval overlap is dropped (not a
    config option).
    """

    name = "arith"
    Options = ArithOptions
    n_generate: dict[str, int] = field(default_factory=lambda: {"train": 4000, "validation": 200, "test": 200})

    def _generate(self, split: str) -> list[tuple[str, str, str]]:
        offset = SPLITS.index(split)
        rng = random.Random(self.seed * 1000 + offset)
        return [make_problem(rng) for _ in range(self.n_generate[split])]

    def messages(self, ex: Example) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"{ex.question}\n{INSTRUCTION}"}]

    def score(self, ex: Example, response: str) -> int:
        return numeric_match(response, ex.reference)

    def decided(self, ex: Example, prefix: str) -> bool:
        return numeric_decided(prefix, ex.reference)
