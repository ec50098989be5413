"""GPU tests: ``pytest -m gpu tests/gpu`` on a machine with an NVIDIA GPU (a supported vLLM for most).

Tests marked ``gpu`` are skipped without CUDA. The ``vllm_env`` fixture skips without vLLM, and
gives the environment for the engine processes the tests start: the checkout on ``PYTHONPATH``
and, when LoRazor is not pip-installed, a dist-info with its ``vllm.general_plugins`` entry point
(``scripts/plugin_dist_info.py``), so vLLM loads the plugin in every process it starts.
"""
from __future__ import annotations

import importlib.util
import os
from importlib.metadata import entry_points

import pytest

from serve_bridge.vllm.versions import runner_environment
from tests.gpu.harness import ROOT, engine_environ


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _cuda():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (CUDA)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def _plugin_visible() -> bool:
    return any(ep.name == "lorazor" for ep in entry_points(group="vllm.general_plugins"))


@pytest.fixture(scope="session")
def vllm_env(tmp_path_factory) -> dict[str, str]:
    """Environment for a vLLM engine process started from the checkout root (:func:`engine_environ`)."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs a supported vLLM (pip install -e '.[vllm]')")
    paths = [str(ROOT)]
    if not _plugin_visible():
        spec = importlib.util.spec_from_file_location("plugin_dist_info", ROOT / "scripts" / "plugin_dist_info.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        paths.insert(0, str(module.write_dist_info(tmp_path_factory.mktemp("entry_points"))))
    env = engine_environ()
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    # the engines' read-outs are collective_rpc callables, which cross to an engine core in another
    # process only with insecure serialization: keep the engine core in-process unless a test says
    env |= runner_environment() | {"PYTHONUNBUFFERED": "1"}
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return env

