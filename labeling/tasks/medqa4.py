"""MedQA-USMLE 4-option (``GBaker/MedQA-USMLE-4-options``, or a local directory of JSONL).

Hub rows (checked against the dataset card and public loaders): ``question`` (the vignette
and stem), ``options`` (a mapping ``{"A": text, …, "D": text}``), ``answer_idx`` (the gold
letter), ``answer`` (the gold option's text) and ``meta_info`` (unused). Splits: ``train``
and ``test``; validation is carved from train. A local directory holds ``train.jsonl`` and
``test.jsonl`` with the same fields (``options`` may also be a list of four strings).

Prompt: the question, the options as ``A. …`` lines and an instruction to end with
``Answer: <letter>`` (our wording; the paper fixes only the limit). Output limit 128 tokens
(paper). Q(·): answer-letter match over A–D (``labeling/evaluators/letters.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from labeling.evaluators.letters import MEDQA_LETTERS, format_choices, letter_decided, letter_match
from labeling.tasks.base import BaseTask, Example, TaskError, require_nonempty
from labeling.tasks.sources import PaperSplitOptions, paper_split

INSTRUCTION = "Explain briefly, then give the final answer as 'Answer: <letter>'."


def parse_options(task: str, row: dict[str, Any], letters: str) -> dict[str, str]:
    """``{letter: text}`` from a mapping keyed by letter or a list in letter order."""
    opts = row.get("options")
    if isinstance(opts, dict):
        opts = {k.strip().upper(): v for k, v in opts.items() if v is not None}
    elif isinstance(opts, list):
        opts = dict(zip(letters, opts))
    if not isinstance(opts, dict) or sorted(opts) != list(letters):
        raise TaskError(f"task '{task}': field 'options' must map exactly the letters {list(letters)} to texts, "
                        f"got {opts!r:.120}. Check the dataset source (expected GBaker/MedQA-USMLE-4-options rows).")
    return {k: str(opts[k]) for k in letters}


@dataclass
class MedQA4Options(PaperSplitOptions):
    """source: hub id or a local directory (and the split options of :class:`PaperSplitOptions`)."""

    source: str = "GBaker/MedQA-USMLE-4-options"
    max_new_tokens: int = 128


@dataclass
class MedQA4Task(BaseTask, MedQA4Options):
    name = "medqa4"
    required_fields = {"question": (str,), "options": (dict, list), "answer_idx": (str,)}
    Options = MedQA4Options

    def _example(self, split: str, i: int, row: dict[str, Any]) -> Example:
        options = parse_options(self.name, row, MEDQA_LETTERS)
        gold = str(row.get("answer_idx") or "").strip().upper()
        if gold not in options:
            raise TaskError(f"task '{self.name}': field 'answer_idx' is {row.get('answer_idx')!r}, expected one of "
                            f"{list(MEDQA_LETTERS)} (question: {str(row.get('question'))[:60]!r}). Check the source.")
        return Example(uid=f"medqa4-{split}-{i}", question=str(row["question"]), reference=gold,
                       meta={"options": options})

    def load_split(self, split: str) -> list[Example]:
        rows = paper_split(self.name, self.source, split, self.val_size, self.seed)
        examples = [self._example(split, i, r) for i, r in enumerate(rows)]
        return require_nonempty(self.name, split, self.sizes.cap(split, examples), self.source)

    def messages(self, ex: Example) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"{ex.question}\n\n{format_choices(ex.meta['options'])}\n\n{INSTRUCTION}"}]

    def score(self, ex: Example, response: str) -> int:
        return letter_match(response, ex.reference, MEDQA_LETTERS)

    def decided(self, ex: Example, prefix: str) -> bool:
        return letter_decided(prefix, ex.reference, MEDQA_LETTERS)
