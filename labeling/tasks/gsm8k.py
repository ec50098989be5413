"""GSM8K (``openai/gsm8k``, config ``main``, or a local directory of JSONL).

Prompt: the question plus an instruction to end with ``#### <number>``; output limit 256
tokens (paper). Q(·): numeric match with lm-eval's strict ``#### N`` extractor, falling back
to the flexible last-number extractor (``labeling/evaluators/numeric.py``).
"""
from __future__ import annotations

import re

from labeling.evaluators.numeric import Mode, numeric_match
from labeling.tasks.base import BaseTask, Example, SplitSizes, require_nonempty
from labeling.tasks.sources import paper_split

INSTRUCTION = "Solve step by step, then give the final answer as '#### <number>'."
CALC_RE = re.compile(r"<<[^>]*>>")


def clean_solution(answer: str) -> str:
    """The GSM8K solution without its ``<<a*b=c>>`` calculator annotations."""
    return CALC_RE.sub("", answer)


class GSM8KTask(BaseTask):
    name = "gsm8k"
    required_fields = {"question": (str,), "answer": (str,)}

    def __init__(self, source: str = "openai/gsm8k", max_new_tokens: int = 256, val_size: int = 500,
                 seed: int = 1234, extractor: Mode = "strict_then_flexible", sizes: SplitSizes | None = None) -> None:
        super().__init__(max_new_tokens, sizes)
        self.source, self.val_size, self.seed, self.extractor = source, int(val_size), int(seed), extractor

    def load_split(self, split: str) -> list[Example]:
        rows = paper_split(self.name, self.source, split, self.val_size, self.seed, hub_config="main")
        examples = [
            Example(uid=f"gsm8k-{split}-{i}", question=r["question"],
                    reference=r["answer"].split("####")[-1].strip(),
                    meta={"solution": clean_solution(r["answer"])})
            for i, r in enumerate(rows)
        ]
        return require_nonempty(self.name, split, self.sizes.cap(split, examples), self.source)

    def messages(self, ex: Example) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"{ex.question}\n{INSTRUCTION}"}]

    def score(self, ex: Example, response: str) -> int:
        return numeric_match(response, ex.reference, self.extractor)
