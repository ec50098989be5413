"""What a benchmark writes to ``--out``, checked before any work so a mistake costs no run and no
file: a new file or a directory whose files of this benchmark's names are new, either of them
replaced only with ``--replace``, and written under a temporary name then renamed
(:mod:`serve_bridge.safe_write`)."""
from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from serve_bridge.command_line import fail
from serve_bridge.safe_write import check_output, write_atomic
from serve_bridge.values import OptionError


def add_out_options(parser: argparse.ArgumentParser, what: str) -> None:
    """``--out FILE`` (also write ``what``, markdown) and ``--replace``."""
    parser.add_argument("--out", type=Path, default=None, help=f"also write {what} (markdown) to this new file")
    parser.add_argument("--replace", action="store_true", help="replace an existing --out file")


def add_out_dir_options(parser: argparse.ArgumentParser, names: Sequence[str], *, required: bool = False) -> None:
    """``--out DIR`` (written: ``names``) and ``--replace``."""
    parser.add_argument("--out", type=Path, required=required, default=None,
                        help=f"write {', '.join(names)} into this directory (created if missing)")
    parser.add_argument("--replace", action="store_true", help="replace those files where --out already has them")


def check_out(args: argparse.Namespace, names: Sequence[str] = ()) -> None:
    """One line and exit code 2 unless ``args.out`` is unset or can take the output: without
    ``names`` a file, new or replaceable; with them a directory (existing or not) in which each of
    ``names`` is new or replaceable. Either way its place must be writable."""
    if args.out is None:
        return
    try:
        if not names:
            check_output("--out", args.out, [], directory=False, replace=args.replace)
            return
        if args.out.exists() and not args.out.is_dir():
            raise OptionError("--out", str(args.out), "exists and is not a directory")
        for name in names:
            if (args.out / name).exists() and not args.replace:
                raise OptionError("--out", str(args.out), f"already holds {name}; choose another directory, or pass "
                                                          "--replace to replace it")
            check_output("--out", args.out / name, [], directory=False, replace=True)
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
