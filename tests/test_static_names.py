"""Every name our Python code uses is defined: pyflakes over every tracked module.

Much of the code runs only on a GPU with vLLM (tests/gpu, the serving benchmarks' engine
processes, the vLLM seams of other versions), where the CPU suite cannot execute it; a misspelt
name there would first fail on the GPU. This reads each file without running it and fails on an
undefined name, an undefined local, or an ``__all__`` entry that does not exist.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from pyflakes import api, messages, reporter

ROOT = Path(__file__).resolve().parents[1]
UNDEFINED = (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)


class _Collect(reporter.Reporter):
    """Keeps pyflakes' messages instead of printing them."""

    def __init__(self) -> None:
        super().__init__(None, None)
        self.found: list[messages.Message] = []
        self.errors: list[str] = []

    def flake(self, message: messages.Message) -> None:
        self.found.append(message)

    def syntaxError(self, filename, msg, lineno, offset, text) -> None:  # noqa: N802 - pyflakes' name
        self.errors.append(f"{filename}:{lineno}: {msg}")

    def unexpectedError(self, filename, msg) -> None:  # noqa: N802 - pyflakes' name
        self.errors.append(f"{filename}: {msg}")


def tracked_modules() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return [ROOT / p for p in out.stdout.split()]


def test_every_name_is_defined() -> None:
    files = tracked_modules()
    assert any(p.parts[-2:] == ("gpu", "real_engines.py") for p in files)
    found = _Collect()
    for path in files:
        api.checkPath(str(path), found)
    assert found.errors == []
    undefined = [f"{Path(m.filename).relative_to(ROOT)}:{m.lineno}: {m.message % m.message_args}"
                 for m in found.found if isinstance(m, UNDEFINED)]
    assert undefined == []


def test_an_undefined_name_is_found(tmp_path: Path) -> None:
    path = tmp_path / "misspelt.py"
    path.write_text("def f(x):\n    from os.path import join\n\n    return jion(x, x)\n")
    found = _Collect()
    api.checkPath(str(path), found)
    assert [m.message_args for m in found.found if isinstance(m, UNDEFINED)] == [("jion",)]
