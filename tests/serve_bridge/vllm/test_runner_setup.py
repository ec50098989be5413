"""What LoRazor's runners check before vLLM's runner is built (serve_bridge/vllm/runner_setup.py):
vLLM's defaults (async scheduling, prefix caching) on a runner that can serve them, for every bundle."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from serve_bridge.bundle import AdapterEntry, adapter_fingerprint, write_bundle
from serve_bridge.vllm import runner_setup
from serve_bridge.vllm.runner_setup import start_runtime
from serve_bridge.vllm.settings import BridgeError
from tests.serve_bridge.engine_walk import H
from tests.serve_bridge.test_runtime import _bundle, served  # noqa: F401 - fixture


def _config(async_scheduling: bool, prefix: bool = False) -> SimpleNamespace:
    return SimpleNamespace(lora_config=object(), speculative_config=None,
                           model_config=SimpleNamespace(runner_type="generate", get_hidden_size=lambda: H),
                           cache_config=SimpleNamespace(enable_prefix_caching=prefix),
                           scheduler_config=SimpleNamespace(async_scheduling=async_scheduling, scheduler_cls=None),
                           parallel_config=SimpleNamespace(pipeline_parallel_size=1, distributed_executor_backend="mp"))


def _profiled_bundle(tmp_path, served):  # noqa: F811
    entries = [AdapterEntry("prof2", adapter_fingerprint(served["prof2"]), "profiled", k=2),
               AdapterEntry("off", adapter_fingerprint(served["off"]), "none")]
    return write_bundle(tmp_path / "profiled", backbone="tiny", hidden_size=H, config_fingerprint="0" * 64,
                        adapters=entries)


def test_vllm_defaults_serve_every_bundle_on_v2(tmp_path, served, monkeypatch, caplog):  # noqa: F811
    """Async scheduling and prefix caching on (vLLM 0.33's defaults) serve profiled and learned
    bundles on the V2 runner, and the start-up line says so; vLLM 0.26's V1 runner refuses async
    scheduling."""
    monkeypatch.setattr(runner_setup.prefix_cache, "installed", lambda: True)  # the plugin installed the keys
    for bundle in (_profiled_bundle(tmp_path, served), _bundle(tmp_path, served, lag=1)):
        monkeypatch.setenv("LORAZOR_BUNDLE", str(bundle))
        with caplog.at_level(logging.INFO, logger="vllm.lorazor"):
            runtime = start_runtime(_config(True, prefix=True), "cpu", async_capable=True)
        assert runtime.report_releases
        assert f"hidden size {H}, async scheduling, prefix caching on)" in caplog.text
        assert "decision lag 0" not in caplog.text
        with pytest.raises(BridgeError, match="disable async scheduling"):  # vLLM 0.26's V1 runner
            start_runtime(_config(True), "cpu")
        start_runtime(_config(False), "cpu")


def test_lag_0_learned_bundle_is_served_as_calibrated_with_a_warning(tmp_path, served, monkeypatch,  # noqa: F811
                                                                     caplog):
    """A bundle whose learned policies release right after their decision (lag 0, every schema 1
    bundle) is served exactly as calibrated under async scheduling, reading each step's decisions
    before the next step is planned; the log says what that costs and how to avoid it."""
    monkeypatch.setenv("LORAZOR_BUNDLE", str(_bundle(tmp_path, served, lag=0)))
    with caplog.at_level(logging.WARNING, logger="vllm.lorazor"):
        runtime = start_runtime(_config(True), "cpu", async_capable=True)
    assert runtime.hold == 0
    assert "decision lag 0 (learn)" in caplog.text and "sweep.decision_lag=1" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vllm.lorazor"):
        start_runtime(_config(False), "cpu", async_capable=True)
    assert "decision lag 0" not in caplog.text  # synchronous: nothing is given up
