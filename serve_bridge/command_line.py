"""The contract of every LoRazor command: a user mistake is one line on stderr and exit code 2.

:func:`report` prints ``error: <message>`` as one line (:func:`one_line`: a line break inside the
message, e.g. in a path, is written as ``\\n``) and returns the exit code; :func:`fail` exits with
it. :class:`Parser` is argparse's parser with its errors reported that way instead of a usage
block; :func:`number` and :func:`existing_dir` are argparse ``type=`` converters, and :class:`MinMax`
an action for ``MIN MAX`` pairs, whose refusals are that one line too; :func:`need_files` refuses an
input directory that lacks a file the command reads. :func:`check_args` checks parsed arguments
against the rules every command shares (:mod:`serve_bridge.values`), naming each argument as
``--option=value``. A command catches only the errors that are user mistakes; any other exception
is a bug and raises with its traceback.
"""
from __future__ import annotations

import argparse
import sys
from argparse import Namespace
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from serve_bridge.values import RULES, OptionError, check_value

USAGE_EXIT = 2
_LINE_BREAKS = "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"  # what str.splitlines() splits on


def one_line(text: str) -> str:
    """``text`` with every line break and other control character written as Python escapes it."""
    return "".join(repr(c)[1:-1] if c in _LINE_BREAKS or ord(c) < 32 or c == "\x7f" else c for c in text)


def report(message: str) -> int:
    """Print ``error: <message>`` on stderr as one line; return the usage exit code."""
    print(f"error: {one_line(message)}", file=sys.stderr, flush=True)
    return USAGE_EXIT


def fail(message: str) -> NoReturn:
    """:func:`report` ``message`` and exit with the usage exit code."""
    sys.exit(report(message))


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors (unknown or missing arguments, values of the wrong type)
    are one line on stderr and exit code 2."""

    def error(self, message: str) -> NoReturn:
        fail(f"{message} ({self.prog} --help lists the arguments)")


def option_name(dest: str) -> str:
    """The command-line spelling of an argparse destination: ``max_len`` → ``--max-len``."""
    return "--" + dest.replace("_", "-")


def check_args(args: Namespace, rules: dict[str, str | tuple[Any, ...]]) -> None:
    """Check each given argument (not None) of ``args`` against its rule (a name in
    :data:`serve_bridge.values.RULES`, or the allowed values); an OptionError names the first
    broken one as ``--option=value``."""
    for dest, rule in rules.items():
        value = getattr(args, dest)
        if value is not None:
            check_value(option_name(dest), value, rule)


def number(rule: str) -> Callable[[str], int | float]:
    """An argparse ``type=`` for a number kept to ``rule`` (a numeric rule of
    :data:`serve_bridge.values.RULES`): an integer for the ``*_int`` rules and ``seed``, else a
    float; text that is not one, or a value that breaks the rule, is the parser's one-line error."""
    parse = int if rule.endswith("_int") or rule in ("integer", "seed", "port") else float
    ok, wanted = RULES[rule]

    def convert(text: str) -> int | float:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: {wanted}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{text!r}: {wanted}")
        return value

    convert.__name__ = rule
    return convert


def existing_dir(text: str) -> Path:
    """An argparse ``type=`` for a directory that must exist (an input: a run, a bundle)."""
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: " + ("not a directory" if path.exists() else "does not exist"))
    return path


class MinMax(argparse.Action):
    """``nargs=2`` values ``MIN MAX`` with MIN ≤ MAX (each converted by the argument's ``type``);
    reversed ones are refused as ``--option=[MIN, MAX]: give MIN ≤ MAX.``"""

    def __call__(self, parser: argparse.ArgumentParser, namespace: Namespace, values: Any,
                 option_string: str | None = None) -> None:
        low, high = values
        if low > high:
            parser.error(str(OptionError(option_string, [low, high], "give MIN ≤ MAX")))
        setattr(namespace, self.dest, values)


def need_files(option: str, directory: Path, files: Sequence[str], what: str) -> None:
    """:func:`fail` unless every one of ``files`` (relative paths) is in ``directory``, the value of
    ``option``; ``what`` says which directory the command wants (e.g. "a run whose sweep stage
    finished")."""
    for name in files:
        if not (directory / name).is_file():
            fail(f"{option}={str(directory)!r}: has no {name}; give {what}")
