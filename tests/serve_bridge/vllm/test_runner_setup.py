"""What LoRazor's runners check before vLLM's runner is built (serve_bridge/vllm/runner_setup.py):
async scheduling unless switched off, on a runner that can serve it, for profiled bundles."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from serve_bridge.bundle import AdapterEntry, adapter_fingerprint, write_bundle
from serve_bridge.vllm.runner_setup import start_runtime
from serve_bridge.vllm.settings import BridgeError
from tests.serve_bridge.engine_walk import H
from tests.serve_bridge.test_runtime import _bundle, served  # noqa: F401 - fixture


def _config(async_scheduling: bool) -> SimpleNamespace:
    return SimpleNamespace(lora_config=object(), speculative_config=None,
                           model_config=SimpleNamespace(runner_type="generate", get_hidden_size=lambda: H),
                           cache_config=SimpleNamespace(enable_prefix_caching=False),
                           scheduler_config=SimpleNamespace(async_scheduling=async_scheduling, scheduler_cls=None),
                           parallel_config=SimpleNamespace(pipeline_parallel_size=1, distributed_executor_backend="mp"))


def _profiled_bundle(tmp_path, served):  # noqa: F811
    entries = [AdapterEntry("prof2", adapter_fingerprint(served["prof2"]), "profiled", k=2),
               AdapterEntry("off", adapter_fingerprint(served["off"]), "none")]
    return write_bundle(tmp_path / "profiled", backbone="tiny", hidden_size=H, config_fingerprint="0" * 64,
                        adapters=entries)


def test_async_scheduling_serves_profiled_bundles_on_v2_unless_switched_off(tmp_path, served, monkeypatch,  # noqa: F811
                                                                            caplog):
    monkeypatch.setenv("LORAZOR_BUNDLE", str(_profiled_bundle(tmp_path, served)))
    monkeypatch.delenv("LORAZOR_ASYNC_SCHEDULING", raising=False)
    with caplog.at_level(logging.INFO, logger="vllm.lorazor"):
        runtime = start_runtime(_config(True), "cpu", async_capable=True)  # on by default
    assert sorted(runtime.slot_of) == ["off", "prof2"]
    assert f"hidden size {H}, async scheduling)" in caplog.text  # the start-up line says so
    with pytest.raises(BridgeError, match="disable async scheduling"):  # vLLM 0.26's V1 runner
        start_runtime(_config(True), "cpu")
    monkeypatch.setenv("LORAZOR_ASYNC_SCHEDULING", "0")
    with pytest.raises(BridgeError, match="disable async scheduling"):  # switched off
        start_runtime(_config(True), "cpu", async_capable=True)
    start_runtime(_config(False), "cpu")  # the switch changes nothing without async scheduling


def test_async_scheduling_refuses_learned_policies(tmp_path, served, monkeypatch):  # noqa: F811
    monkeypatch.setenv("LORAZOR_BUNDLE", str(_bundle(tmp_path, served)))
    monkeypatch.delenv("LORAZOR_ASYNC_SCHEDULING", raising=False)
    with pytest.raises(BridgeError, match=r"but the bundle has learned ones \(learn\): disable async scheduling"):
        start_runtime(_config(True), "cpu", async_capable=True)
    start_runtime(_config(False), "cpu", async_capable=True)  # synchronous: learned policies are served
