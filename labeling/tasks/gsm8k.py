"""GSM8K (``openai/gsm8k``, config ``main``, or a local directory of JSONL).

Prompt: the question plus an instruction to end with ``#### <number>``; output limit 256
tokens (paper). Q(·): numeric match with lm-eval's strict ``#### N`` extractor, falling back
to the flexible last-number extractor (``labeling/evaluators/numeric.py``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from labeling.evaluators.numeric import MODES, is_special_number, numeric_decided, numeric_match
from labeling.tasks.base import BaseTask, Example, require_nonempty
from labeling.tasks.sources import PaperSplitOptions, paper_split

INSTRUCTION = "Solve step by step, then give the final answer as '#### <number>'."
CALC_RE = re.compile(r"<<[^>]*>>")


def clean_solution(answer: str) -> str:
    """The GSM8K solution without its ``<<a*b=c>>`` calculator annotations."""
    return CALC_RE.sub("", answer)


def reference_of(answer: str) -> str:
    """The reference of a GSM8K answer: what follows its last ``####``."""
    return answer.split("####")[-1].strip()


@dataclass
class GSM8KOptions(PaperSplitOptions):
    """source: hub id or a local directory with train.jsonl / test.jsonl; extractor: a
    :data:`labeling.evaluators.numeric.Mode`; the split options of :class:`PaperSplitOptions`."""

    rules = {"extractor": MODES}

    source: str = "openai/gsm8k"
    max_new_tokens: int = 256
    extractor: str = "strict_then_flexible"


@dataclass
class GSM8KTask(BaseTask, GSM8KOptions):
    name = "gsm8k"
    required_fields = {"question": (str,), "answer": (str,)}
    Options = GSM8KOptions

    def load_split(self, split: str) -> list[Example]:
        rows = paper_split(self.name, self.source, split, self.val_size, self.seed, hub_config="main")
        examples = [
            Example(uid=f"gsm8k-{split}-{i}", question=r["question"],
                    reference=reference_of(r["answer"]),
                    meta={"solution": clean_solution(r["answer"])})
            for i, r in enumerate(rows)
        ]
        return require_nonempty(self.name, split, self.sizes.cap(split, examples), self.source)

    def messages(self, ex: Example) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"{ex.question}\n{INSTRUCTION}"}]

    def score(self, ex: Example, response: str) -> int:
        return numeric_match(response, ex.reference, self.extractor)  # type: ignore[arg-type]

    def decided(self, ex: Example, prefix: str) -> bool:
        return numeric_decided(prefix, ex.reference, self.extractor)  # type: ignore[arg-type]

    def row_problem(self, row: dict[str, Any]) -> str | None:
        """A reference that reads as NaN or an infinity: no answer could ever match it."""
        ref = reference_of(row["answer"])
        if is_special_number(ref):
            return f"field 'answer' gives the reference {ref!r}, which is not a finite number; end it with '#### <number>'"
        return None
