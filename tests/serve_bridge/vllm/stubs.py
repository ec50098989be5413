"""Import one of serve_bridge.vllm's modules over stand-ins for the vLLM modules it imports."""
from __future__ import annotations

import importlib
import sys
from types import ModuleType

import pytest


def import_over(monkeypatch: pytest.MonkeyPatch, modules: dict[str, ModuleType], name: str) -> ModuleType:
    """``name`` imported with ``modules`` in ``sys.modules``; dropped again afterwards, so the next
    import of ``name`` sees real vLLM."""
    for module_name, module in modules.items():
        monkeypatch.setitem(sys.modules, module_name, module)
    monkeypatch.delitem(sys.modules, name, raising=False)
    module = importlib.import_module(name)
    monkeypatch.delitem(sys.modules, name)
    return module
