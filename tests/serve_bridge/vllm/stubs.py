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


def fake_lora_managers(monkeypatch: pytest.MonkeyPatch) -> dict[str, type]:
    """Empty stand-ins for the two vLLM LoRA-manager classes ``lora_manager.install`` patches
    (``vllm.lora.worker_manager.LRUCacheWorkerLoRAManager``, ``vllm.lora.model_manager.LoRAModelManager``),
    put in ``sys.modules``; returned by class name."""
    classes = {}
    monkeypatch.setitem(sys.modules, "vllm.lora", ModuleType("vllm.lora"))
    for module_name, cls_name in (("vllm.lora.worker_manager", "LRUCacheWorkerLoRAManager"),
                                  ("vllm.lora.model_manager", "LoRAModelManager")):
        module = ModuleType(module_name)
        classes[cls_name] = type(cls_name, (), {})
        setattr(module, cls_name, classes[cls_name])
        monkeypatch.setitem(sys.modules, module_name, module)
    return classes
