"""Numeric-answer matching with lm-eval's GSM8K extractors.

Two extractors, as lm-eval's ``gsm8k`` task defines them (facts, not code, taken over):

- **strict**: the number after ``#### `` (regex ``#### (\\-?[0-9\\.\\,]+)``, first match);
- **flexible**: the last number-like token in the response
  (regex ``(-?[$0-9.,]{2,})|(-?[0-9]+)``, last match).

``mode="strict_then_flexible"`` (the default) uses strict when the response has a
``#### N`` line and falls back to flexible otherwise. Values are compared as numbers after
removing ``,`` and ``$`` and a trailing ``.``, so ``1,000`` == ``1000`` == ``1000.0``; NaN and the
infinities are no numbers (a reference that reads as one matches nothing).

:func:`numeric_decided` says when no continuation of a response prefix can change its score:
once the first ``#### N`` match is followed by a character that ends ``N`` (strict, and
strict_then_flexible, whose strict answer then always wins). The flexible extractor takes the
*last* number, which any continuation can replace, so it is never decided; nor is anything
before a complete ``#### N``.
"""
from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Literal, get_args

STRICT_RE = re.compile(r"#### (\-?[0-9\.\,]+)")
FLEXIBLE_RE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")

Mode = Literal["strict", "flexible", "strict_then_flexible"]
MODES: tuple[str, ...] = get_args(Mode)


def _decimal(text: str) -> Decimal | None:
    cleaned = text.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        return Decimal(cleaned)
    except InvalidOperation:
        return None


def _to_number(text: str) -> Decimal | None:
    """``text`` as a finite number, else None (NaN and the infinities, which Decimal reads, are
    no numbers: no answer equals them, and a signaling NaN cannot even be compared)."""
    value = _decimal(text)
    return value if value is not None and value.is_finite() else None


def is_special_number(text: str) -> bool:
    """Whether ``text`` reads as a NaN or an infinity (``nan``, ``sNaN``, ``-Infinity``...)."""
    value = _decimal(text)
    return value is not None and not value.is_finite()


def is_number(text: str) -> bool:
    """Whether ``text`` reads as a number the way answers and references are compared."""
    return _to_number(text) is not None


def extract_strict(response: str) -> str | None:
    """The ``#### N`` answer, or None."""
    m = STRICT_RE.search(response)
    return m.group(1) if m else None


def extract_flexible(response: str) -> str | None:
    """The last number-like token, or None."""
    matches = FLEXIBLE_RE.findall(response)
    if not matches:
        return None
    a, b = matches[-1]
    return a or b


def extract_answer(response: str, mode: Mode = "strict_then_flexible") -> str | None:
    """Extract the answer string with the chosen extractor."""
    if mode == "strict":
        return extract_strict(response)
    if mode == "flexible":
        return extract_flexible(response)
    if mode == "strict_then_flexible":
        s = extract_strict(response)
        return s if s is not None else extract_flexible(response)
    raise ValueError(f"unknown numeric extractor mode {mode!r}; use strict, flexible or strict_then_flexible")


def strict_answer_complete(response: str) -> bool:
    """Whether ``response`` has a ``#### N`` match that no continuation can extend or displace:
    a character that is not part of ``N`` follows it (the first match stays the first one)."""
    m = STRICT_RE.search(response)
    return m is not None and m.end() < len(response)


def numeric_decided(prefix: str, reference: str, mode: Mode = "strict_then_flexible") -> bool:
    """True only if every continuation of ``prefix`` gets the same :func:`numeric_match` score:
    a reference that is no number (always 0), or a complete strict answer (module docstring)."""
    if mode not in MODES:
        raise ValueError(f"unknown numeric extractor mode {mode!r}; use strict, flexible or strict_then_flexible")
    return not is_number(reference) or mode != "flexible" and strict_answer_complete(prefix)


def numeric_match(response: str, reference: str, mode: Mode = "strict_then_flexible") -> int:
    """1 iff the extracted answer equals ``reference`` as a number."""
    got = extract_answer(response, mode)
    if got is None:
        return 0
    a, b = _to_number(got), _to_number(reference)
    return int(a is not None and b is not None and a == b)
