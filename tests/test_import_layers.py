"""Imports point one way: no cycles among the project's modules, and vLLM only where it belongs.

Every ``import`` statement counts, wherever it stands (module level, inside a function, under
``TYPE_CHECKING``), so a function-level import cannot hide a cycle. Importing ``a.b.c`` also runs
``a/__init__.py`` and ``a/b/__init__.py``; those package imports count too, except the importer's
own enclosing packages (Python has already started them).

Layers, from the bottom: ``lora_kernels`` (Triton and torch only) → the engine-independent core
``serve_bridge`` (release semantics, bundle, decisions, runtimes, GridTrim host code) → the vLLM
integration ``serve_bridge.vllm``, the one package that imports ``vllm``. ``calibrate``,
``labeling`` and ``predictors`` use the core, never the integration, with one exception: the
vLLM labeling engine (``labeling.engines.vllm`` and its submodules) runs the integration's
calibration mode, so it sets its environment variables and calls its ``collective_rpc`` functions.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("calibrate", "labeling", "predictors", "serve_bridge", "lora_kernels", "conf", "benchmarks")
VLLM_ENGINE = "labeling.engines.vllm"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _project_modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES if (ROOT / pkg).is_dir() for p in sorted((ROOT / pkg).rglob("*.py"))}


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _imported_names(module: str, path: Path) -> set[str]:
    """Absolute dotted names of everything ``module`` imports, anywhere in its source."""
    package = module if _is_package(path) else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The most specific project module that importing ``name`` loads, or None (not ours)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _enclosing(module: str, path: Path) -> set[str]:
    parts = module.split(".")
    own = len(parts) if _is_package(path) else len(parts) - 1
    return {".".join(parts[:i]) for i in range(1, own + 1)}


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module → project modules its imports run, module → every absolute name it imports)."""
    modules = _project_modules()
    graph: dict[str, set[str]] = {}
    imported: dict[str, set[str]] = {}
    for module, path in modules.items():
        imported[module] = names = _imported_names(module, path)
        skip = _enclosing(module, path) | {module}
        targets: set[str] = set()
        for name in names:
            target = _resolve(name, modules)
            if target is None:
                continue
            parts = target.split(".")
            targets.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))  # packages on the way
        graph[module] = {t for t in targets if t in modules and t not in skip}
    return graph, imported


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected sets of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


GRAPH, IMPORTED = import_graph()


def test_the_graph_sees_function_level_and_relative_imports():
    assert "lora_kernels.steptrim" in GRAPH["serve_bridge.steptrim"]  # imported inside a method
    assert "serve_bridge.runtime" in GRAPH["serve_bridge.calibration"]


def test_cycles_finds_a_cycle_through_a_package_init():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    found = cycles(GRAPH)
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def _core(module: str) -> bool:
    return _within(module, "serve_bridge") and not _within(module, "serve_bridge.vllm")


RULES = [
    ("lora_kernels imports no other package of the project, nor vLLM",
     lambda m: _within(m, "lora_kernels"), ("vllm", "serve_bridge", "calibrate", "labeling", "predictors", "conf")),
    ("the serve_bridge core never imports vLLM or its integration",
     _core, ("vllm", "serve_bridge.vllm", "calibrate", "labeling", "predictors")),
    ("the vLLM integration imports no calibration pipeline",
     lambda m: _within(m, "serve_bridge.vllm"), ("calibrate", "labeling", "predictors")),
    ("calibrate, labeling and predictors reach vLLM's integration only through the vLLM labeling engine",
     lambda m: any(_within(m, p) for p in ("calibrate", "labeling", "predictors")) and not _within(m, VLLM_ENGINE),
     ("serve_bridge.vllm",)),
    ("predictors never import vLLM", lambda m: _within(m, "predictors"), ("vllm",)),
    ("the installed packages never import the benchmark harness or the tests (neither is in the wheel)",
     lambda m: not _within(m, "benchmarks"), ("benchmarks", "tests")),
]


@pytest.mark.parametrize("rule, applies, forbidden", RULES, ids=[r[0] for r in RULES])
def test_layers(rule, applies, forbidden):
    bad = sorted(f"{m} imports {n}" for m, names in IMPORTED.items() if applies(m)
                 for n in names if any(_within(n, f) for f in forbidden))
    assert not bad, f"{rule}: " + "; ".join(bad)


def test_the_integration_is_the_only_serve_bridge_code_importing_vllm():
    users = {m for m, names in IMPORTED.items() if _within(m, "serve_bridge") and any(_within(n, "vllm") for n in names)}
    assert users and all(_within(m, "serve_bridge.vllm") for m in users)
