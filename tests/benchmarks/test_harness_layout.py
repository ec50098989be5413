"""The benchmark harness runs from a checkout as ``python -m benchmarks.<area>.<name>``: every
directory of benchmark scripts is a package, and no script edits ``sys.path``."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p for p in (ROOT / "benchmarks").rglob("*.py") if p.name != "__init__.py")


def test_every_script_directory_is_a_package():
    missing = sorted({str(d) for p in SCRIPTS for d in p.relative_to(ROOT).parents
                      if d != Path(".") and not (ROOT / d / "__init__.py").is_file()})
    assert SCRIPTS and not missing, f"no __init__.py in {missing}"


def test_no_script_edits_sys_path():
    edits = [f"{p.relative_to(ROOT)}:{node.lineno}" for p in SCRIPTS for node in ast.walk(ast.parse(p.read_text()))
             if isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
             and node.value.id == "sys"]
    assert not edits, f"sys.path used in {edits}; import through the benchmarks package instead"
