"""Value checks shared by every command: a named rule per value, one line per broken rule.

The calibrate CLI applies these rules to its config (each option dataclass declares them,
:mod:`labeling.options`); the other commands apply them to their arguments
(:func:`serve_bridge.command_line.check_args`). A value that breaks its rule raises an
:class:`OptionError` whose message is ``key=value: what to use.``, with the value written as
Python writes it (so a line break in a value stays on one line).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

SEED_LIMIT = 1 << 63  # seeds are int64 in torch and numpy's generators


class OptionError(ValueError):
    """An option's value is out of range: ``key=value: what to use.`` (``key``: the field)."""

    def __init__(self, key: str, value: Any, wanted: str) -> None:
        super().__init__(f"{key}={value!r}: {wanted}.")
        self.key = key


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _is_text(v: Any) -> bool:
    return isinstance(v, str) and v.strip() != ""


RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "integer": (_is_int, "use an integer"),
    "positive_int": (lambda v: _is_int(v) and v >= 1, "use a positive integer"),
    "non_negative_int": (lambda v: _is_int(v) and v >= 0, "use a non-negative integer"),
    "optional_positive_int": (lambda v: v is None or (_is_int(v) and v >= 1), "use a positive integer or null"),
    "auto_or_positive_int": (lambda v: v == "auto" or (str(v).isdigit() and int(v) >= 1),
                             "use a positive integer or auto"),
    "split_size": (lambda v: v is None or (_is_int(v) and v >= 1),
                   "use a positive integer (the split's first rows; 0 leaves it empty) or null (all rows)"),
    "seed": (lambda v: _is_int(v) and 0 <= v < SEED_LIMIT, "use an integer from 0 to 2**63 - 1"),
    "positive_number": (lambda v: _is_number(v) and v > 0, "use a positive number"),
    "non_negative_number": (lambda v: _is_number(v) and v >= 0, "use a non-negative number"),
    "above_one": (lambda v: _is_number(v) and v > 1, "use a number above 1"),
    "port": (lambda v: _is_int(v) and 0 <= v <= 65535, "use a port from 0 (a free one) to 65535"),
    "fraction": (lambda v: _is_number(v) and 0 < v <= 1, "use a number in (0, 1]"),
    "probability": (lambda v: _is_number(v) and 0 < v < 1, "use a number in (0, 1)"),
    "share": (lambda v: _is_number(v) and 0 <= v < 1, "use a number in [0, 1)"),
    "text": (_is_text, "use a non-empty string"),
    "optional_text": (lambda v: v is None or _is_text(v), "use a non-empty string or null"),
    "texts": (lambda v: isinstance(v, (list, tuple)) and all(_is_text(s) for s in v), "use a list of non-empty strings"),
    "fractions": (lambda v: isinstance(v, (list, tuple)) and all(_is_number(x) and 0 < x <= 1 for x in v),
                  "use a list of numbers in (0, 1]"),
    "points": (lambda v: isinstance(v, (list, tuple)) and len(v) > 0 and all(_is_int(x) and x >= 0 for x in v),
               "use a non-empty list of non-negative integers"),
}


def check_value(key: str, value: Any, rule: str | tuple[Any, ...]) -> None:
    """Raise an OptionError unless ``value`` keeps ``rule`` (a name in RULES, or the allowed values)."""
    if isinstance(rule, tuple):
        if value not in rule:
            raise OptionError(key, value, f"use one of {list(rule)}")
        return
    ok, wanted = RULES[rule]
    if not ok(value):
        raise OptionError(key, value, wanted)


def check_at_most(key: str, value: int | float, limit: int | float, why: str) -> None:
    """Raise an OptionError if ``value`` exceeds ``limit``; ``why`` says what the limit bounds."""
    if value > limit:
        raise OptionError(key, value, f"use at most {limit} ({why})")


def check(options: Any, rules: dict[str, str | tuple[Any, ...]]) -> None:
    """Raise an OptionError for the first field of ``options`` that breaks its rule."""
    for key, rule in rules.items():
        check_value(key, getattr(options, key), rule)
