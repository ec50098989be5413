"""Prompt encoding and response decoding, shared by the calibration engines."""
from __future__ import annotations

from typing import Any


class ChatIO:
    """``encode``/``decode`` of an engine holding a transformers tokenizer as ``self.tokenizer``."""

    tokenizer: Any

    def encode(self, messages: list[dict[str, str]]) -> list[int]:
        """Chat-template a request's messages into prompt token ids (generation prompt added)."""
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out if isinstance(out, list) else out["input_ids"])

    def decode(self, tokens: list[int]) -> str:
        """A response's text, special tokens (the stop token included) dropped."""
        return self.tokenizer.decode(tokens, skip_special_tokens=True)
