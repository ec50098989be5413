"""What a kernel benchmark prints, kept to be written to ``--out`` at the end: a new file, or one
that ``--replace`` may replace, checked before any GPU work and written under a temporary name
then renamed (:mod:`serve_bridge.safe_write`), so a mistake costs no run and no file."""
from __future__ import annotations

import argparse
from pathlib import Path

from serve_bridge.command_line import fail
from serve_bridge.safe_write import check_output, write_atomic
from serve_bridge.values import OptionError


def add_out_options(parser: argparse.ArgumentParser, what: str) -> None:
    """``--out FILE`` (also write ``what``, markdown) and ``--replace``."""
    parser.add_argument("--out", type=Path, default=None, help=f"also write {what} (markdown) to this new file")
    parser.add_argument("--replace", action="store_true", help="replace an existing --out file")


def check_out(args: argparse.Namespace) -> None:
    """One line and exit code 2 unless ``args.out`` is unset, new or replaceable, and writable."""
    if args.out is None:
        return
    try:
        check_output("--out", args.out, [], directory=False, replace=args.replace)
    except OptionError as err:
        fail(str(err))


class Printed:
    """Lines printed as they come (flushed) and kept for :meth:`write`."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)

    def write(self, path: Path | None) -> None:
        """Every line so far to ``path`` (nothing when None)."""
        if path is not None:
            write_atomic(path, "\n".join(self.lines) + "\n")
