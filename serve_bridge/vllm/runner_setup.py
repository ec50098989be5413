"""What LoRazor's runner does before vLLM's runner is built, on every vLLM line: read the
switches, refuse engine settings StepTrim cannot run under, and start the release runtime."""
from __future__ import annotations

from typing import Any

from serve_bridge.bundle import Bundle
from serve_bridge.calibration import CalibrationRuntime
from serve_bridge.runtime import ReleaseRuntime, build_runtime, logger
from serve_bridge.steptrim import LearnedPolicy
from serve_bridge.vllm import prefix_cache
from serve_bridge.vllm.settings import (ASYNC_ENV, BridgeError, BridgeSettings, require_slot_engine,
                                        require_supported_engine)


def require_profiled_only(bundle: Bundle) -> None:
    """Refuse a bundle with learned policies under async scheduling: their decision on step t's
    hidden states must reach step t+1's LoRA mapping, which async scheduling plans before step t
    ends (docs/vllm_integration.md §9)."""
    learned = sorted(name for name, policy in bundle.policies.items() if isinstance(policy, LearnedPolicy))
    if learned:
        raise BridgeError(f"LoRazor serves profiled policies only under async scheduling ({ASYNC_ENV} is on, its "
                          f"default), but the bundle has learned ones ({', '.join(learned)}): disable async scheduling "
                          f"(async_scheduling=False / --no-async-scheduling).")


def start_runtime(vllm_config: Any, device: Any, async_capable: bool = False) -> ReleaseRuntime:
    """The runtime of this worker: the bundle's (serving), or an empty calibration runtime whose
    policies come over ``collective_rpc``, told whether the engine caches prefixes (it then
    refuses release policies). ``async_capable``: the runner can serve profiled bundles under
    async scheduling (vLLM 0.33's V2 runner), accepted unless ``LORAZOR_ASYNC_SCHEDULING=0``.
    Raises BridgeError, naming every fix, for unsupported settings."""
    settings = BridgeSettings.from_env()
    if settings is None:
        raise BridgeError("LoRazor's GPU model runner was built without LORAZOR_BUNDLE or LORAZOR_CALIBRATION; the "
                          "plugin installs it only when one of them is set in every vLLM process.")
    require_supported_engine(vllm_config, released_blocks_keyed=settings.calibration and prefix_cache.installed(),
                             async_allowed=settings.async_scheduling and async_capable)
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
        runtime = build_runtime(settings.bundle, hidden_size, device, settings.adapters, settings.log_interval_s,
                                settings.bundle_digest)
        async_scheduling = vllm_config.scheduler_config.async_scheduling
        if async_scheduling:
            require_profiled_only(runtime.bundle)
        logger.info("LoRazor StepTrim active: bundle %s (%d adapters with policies, hidden size %d, %s scheduling).",
                    settings.bundle, len(runtime.slot_of), hidden_size, "async" if async_scheduling else "synchronous")
    runtime.report_releases = settings.slots
    return runtime
