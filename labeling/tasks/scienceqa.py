"""ScienceQA, text-only (``derek-thomas/ScienceQA``, or a local directory of JSONL).

Hub rows (checked against the dataset card): ``image`` (None for text-only questions),
``question``, ``choices`` (2–5 option texts), ``answer`` (0-based index of the gold choice),
``hint`` (context text, often empty), plus ``task``, ``grade``, ``subject``, ``topic``,
``category``, ``skill``, ``lecture``, ``solution`` (unused). Rows with an image are dropped
before anything else (text-only, as in the paper). The hub also has a ``validation`` split;
we ignore it and carve validation from the text-only train rows, keeping the official test.
A local directory holds ``train.jsonl`` and ``test.jsonl`` with the same fields (``image``
null or absent for text-only rows).

Prompt: the hint as context (when non-empty), the question, the choices as ``A. …`` lines
and an instruction to end with ``Answer: <letter>`` (our wording). Output limit 320 tokens
(paper). Q(·): answer-letter match over the question's own letters (A–B … A–E).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from labeling.evaluators.letters import SCIENCEQA_LETTERS, format_choices, letter_decided, letter_match
from labeling.tasks.base import BaseTask, Example, TaskError, require_nonempty
from labeling.tasks.sources import PaperSplitOptions, paper_split

INSTRUCTION = "Explain briefly, then give the final answer as 'Answer: <letter>'."


def is_text_only(row: dict[str, Any]) -> bool:
    """True iff the row has no image (None, missing or empty)."""
    return not row.get("image")


@dataclass
class ScienceQAOptions(PaperSplitOptions):
    """source: hub id or a local directory (and the split options of :class:`PaperSplitOptions`)."""

    source: str = "derek-thomas/ScienceQA"
    max_new_tokens: int = 320


@dataclass
class ScienceQATask(BaseTask, ScienceQAOptions):
    name = "scienceqa"
    required_fields = {"question": (str,), "choices": (list,), "answer": (int,)}
    Options = ScienceQAOptions

    def _example(self, split: str, i: int, row: dict[str, Any]) -> Example:
        choices, answer = row.get("choices"), row.get("answer")
        if not isinstance(choices, list) or not 2 <= len(choices) <= len(SCIENCEQA_LETTERS):
            raise TaskError(f"task '{self.name}': field 'choices' must be a list of 2–{len(SCIENCEQA_LETTERS)} "
                            f"texts, got {choices!r:.120}. Check the source (expected derek-thomas/ScienceQA rows).")
        if not isinstance(answer, int) or not 0 <= answer < len(choices):
            raise TaskError(f"task '{self.name}': field 'answer' must be a 0-based index into 'choices', got "
                            f"{answer!r} for {len(choices)} choices. Check the source.")
        letters = SCIENCEQA_LETTERS[: len(choices)]
        return Example(uid=f"scienceqa-{split}-{i}", question=str(row["question"]), reference=letters[answer],
                       meta={"choices": dict(zip(letters, map(str, choices))), "hint": str(row.get("hint") or "")})

    def load_split(self, split: str) -> list[Example]:
        rows = paper_split(self.name, self.source, split, self.val_size, self.seed, keep=is_text_only)
        examples = [self._example(split, i, r) for i, r in enumerate(rows)]
        return require_nonempty(self.name, split, self.sizes.cap(split, examples), f"{self.source}, text-only rows")

    def messages(self, ex: Example) -> list[dict[str, str]]:
        context = f"Context: {ex.meta['hint']}\n\n" if ex.meta.get("hint") else ""
        body = f"{context}{ex.question}\n\n{format_choices(ex.meta['choices'])}\n\n{INSTRUCTION}"
        return [{"role": "user", "content": body}]

    def score(self, ex: Example, response: str) -> int:
        return letter_match(response, ex.reference, "".join(ex.meta["choices"]))

    def decided(self, ex: Example, prefix: str) -> bool:
        return letter_decided(prefix, ex.reference, "".join(ex.meta["choices"]))
