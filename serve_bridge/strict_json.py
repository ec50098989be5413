"""Strict, bounded JSON: the one parser for JSON a user hands LoRazor (bundle manifests and
safetensors headers, local data rows, adapter configs).

Python's ``json`` accepts what other readers refuse or misread: NaN and Infinity, duplicate
keys (the last one wins), lone UTF-16 surrogates (``"\\ud800"``, which no UTF-8 writer can
encode), integers of thousands of digits, numbers that overflow to infinity (``1e400``),
and nesting deep enough to exhaust the interpreter's stack. :func:`loads_strict` refuses
each with a :class:`StrictJSONError` naming it, so no library downstream (``datasets``,
pyarrow, peft, the serving runtime) ever sees such a value.
"""
from __future__ import annotations

import json
import math
from typing import Any

MAX_JSON_DEPTH = 32  # nesting levels of a document (a data row is an object at level 1)
MAX_INT_DIGITS = 4300  # Python's own bound on int() of a string


class StrictJSONError(ValueError):
    """Text that is not strict, bounded JSON. lineno, colno: where parsing stopped (1-based),
    when the parser knows it."""

    def __init__(self, reason: str, lineno: int | None = None, colno: int | None = None) -> None:
        super().__init__(reason)
        self.lineno, self.colno = lineno, colno


def short_repr(value: Any) -> str:
    """repr of a parsed value for a message, cut to 60 characters (a huge integer by its size)."""
    text = repr(value) if not isinstance(value, int) or abs(value) < 1 << 64 else \
        f"an integer of {value.bit_length()} bits"
    return text if len(text) <= 60 else text[:57] + "..."


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"duplicate key {short_repr(key)}")
        obj[key] = value
    return obj


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} overflows a 64-bit float")
    return value


def _int_parser(int_bits: int | None):
    def parse(text: str) -> int:
        digits = len(text.lstrip("-"))
        if digits > MAX_INT_DIGITS:
            raise ValueError(f"integer of {digits} digits")
        value = int(text)
        if int_bits is not None and value.bit_length() > int_bits:
            raise ValueError(f"integer of {digits} digits does not fit {int_bits + 1}-bit storage")
        return value
    return parse


def _check_tree(value: Any, max_depth: int) -> None:
    """Depth and lone-surrogate check of a parsed document, without recursion."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise StrictJSONError(f"string {short_repr(item)} holds a lone UTF-16 surrogate, which is not "
                                      f"text") from None
            continue
        if not isinstance(item, (dict, list)):
            continue
        if depth > max_depth:
            raise StrictJSONError(f"nested deeper than {max_depth} levels")
        children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
        stack.extend((c, depth + 1) for c in children)


def loads_strict(text: str, max_depth: int = MAX_JSON_DEPTH, int_bits: int | None = None) -> Any:
    """``text`` parsed as strict JSON: finite numbers, unique keys, no lone surrogates, at most
    ``max_depth`` levels, integers of at most :data:`MAX_INT_DIGITS` digits and, unless
    ``int_bits`` is None, ``int_bits`` bits plus sign; StrictJSONError otherwise."""
    try:
        value = json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_unique_keys,
                           parse_float=_finite_float, parse_int=_int_parser(int_bits))
    except json.JSONDecodeError as err:
        raise StrictJSONError(err.msg, err.lineno, err.colno) from None
    except RecursionError:
        raise StrictJSONError(f"nested too deeply (more than {max_depth} levels)") from None
    except ValueError as err:  # raised by a hook above
        raise StrictJSONError(str(err)[:200]) from None
    _check_tree(value, max_depth)
    return value
