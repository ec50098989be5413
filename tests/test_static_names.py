"""Every name our Python code uses is defined: pyflakes over every tracked module.

Much of the code runs only on a GPU with vLLM (tests/gpu, the serving benchmarks' engine
processes, the vLLM seams of other versions), where the CPU suite cannot execute it; a misspelt
name there would first fail on the GPU. This reads each file without running it and fails on an
undefined name, an undefined local, or an ``__all__`` entry that does not exist; and on a name
taken from one of our modules (``from benchmarks.serving.bench import X`` or ``bench.X`` after
``from benchmarks.serving import bench``) that the module, imported on this CPU, does not have.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import subprocess
from pathlib import Path
from types import ModuleType

import pytest
from pyflakes import api, messages, reporter

ROOT = Path(__file__).resolve().parents[1]
UNDEFINED = (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)
FIRST_PARTY = ("benchmarks", "calibrate", "labeling", "lora_kernels", "predictors", "serve_bridge", "tests")


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


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a parent that is not a package
        return False


def _module(name: str) -> ModuleType | None:
    """Our module ``name``, imported; None where it needs what this CPU lacks (vLLM)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def missing_names(path: Path, root: Path = ROOT) -> list[str]:
    """``file:line: module.name`` for each name ``path`` takes from one of our modules that the
    module lacks: ``from module import name``, and ``alias.name`` where ``alias`` is a module of ours.
    Modules that do not import on this CPU are not looked into."""
    tree = ast.parse(path.read_text())
    aliases: dict[str, ModuleType] = {}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in FIRST_PARTY:
            for a in node.names:
                child = f"{node.module}.{a.name}"
                if _is_module(child):
                    if (m := _module(child)) is not None:
                        aliases[a.asname or a.name] = m
                elif a.name != "*" and (parent := _module(node.module)) is not None and not hasattr(parent, a.name):
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {child}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.asname and a.name.split(".")[0] in FIRST_PARTY and (m := _module(a.name)) is not None:
                    aliases[a.asname] = m
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and not hasattr(aliases[node.value.id], node.attr)):
            found.append(f"{path.relative_to(root)}:{node.lineno}: {aliases[node.value.id].__name__}.{node.attr}")
    return found


def test_every_name_taken_from_our_modules_exists() -> None:
    missing = [line for path in tracked_modules() for line in missing_names(path)]
    assert missing == []


def test_a_name_our_module_lacks_is_found(tmp_path: Path) -> None:
    path = tmp_path / "probe.py"
    path.write_text("from benchmarks.serving import bench\nfrom serve_bridge.values import no_such_rule\n"
                    "x = bench.no_such_table\n")
    assert sorted(missing_names(path, tmp_path)) == ["probe.py:2: serve_bridge.values.no_such_rule",
                                                     "probe.py:3: benchmarks.serving.bench.no_such_table"]
