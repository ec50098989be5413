"""What LoRazor's runner does before vLLM's runner is built, on every vLLM line: read the
switches, refuse engine settings StepTrim cannot run under, and start the release runtime."""
from __future__ import annotations

from typing import Any

from serve_bridge.calibration import CalibrationRuntime
from serve_bridge.runtime import ReleaseRuntime, build_runtime, logger
from serve_bridge.vllm import prefix_cache
from serve_bridge.vllm.settings import BridgeError, BridgeSettings, require_slot_engine, require_supported_engine


def start_runtime(vllm_config: Any, device: Any) -> ReleaseRuntime:
    """The runtime of this worker: the bundle's (serving), or an empty calibration runtime whose
    policies come over ``collective_rpc``, told whether the engine caches prefixes (it then
    refuses release policies). Raises BridgeError, naming every fix, for unsupported settings."""
    settings = BridgeSettings.from_env()
    if settings is None:
        raise BridgeError("LoRazor's GPU model runner was built without LORAZOR_BUNDLE or LORAZOR_CALIBRATION; the "
                          "plugin installs it only when one of them is set in every vLLM process.")
    require_supported_engine(vllm_config, released_blocks_keyed=settings.calibration and prefix_cache.installed())
    if settings.slots:
        require_slot_engine(vllm_config)
    hidden_size = vllm_config.model_config.get_hidden_size()
    runtime: ReleaseRuntime
    if settings.calibration:
        runtime = CalibrationRuntime(hidden_size, device, log_interval_s=settings.log_interval_s,
                                     prefix_caching=bool(vllm_config.cache_config.enable_prefix_caching))
        logger.info("LoRazor calibration runtime active (hidden size %d); policies come over collective_rpc.",
                    hidden_size)
    else:
        runtime = build_runtime(settings.bundle, hidden_size, device, settings.adapters, settings.log_interval_s)
        logger.info("LoRazor StepTrim active: bundle %s (%d adapters with policies, hidden size %d).",
                    settings.bundle, len(runtime.slot_of), hidden_size)
    runtime.report_releases = settings.slots
    return runtime
