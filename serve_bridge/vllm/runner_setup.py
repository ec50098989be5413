"""What LoRazor's runner does before vLLM's runner is built, on every vLLM line: read the
switches, refuse engine settings StepTrim cannot run under, and start the release runtime."""
from __future__ import annotations

from typing import Any

from serve_bridge.calibration import CalibrationRuntime
from serve_bridge.runtime import ReleaseRuntime, build_runtime, logger
from serve_bridge.steptrim import LearnedPolicy
from serve_bridge.vllm import prefix_cache
from serve_bridge.vllm.settings import BridgeError, BridgeSettings, engine_fixes, refuse, release_engine_fixes


def warn_if_waiting(runtime: ReleaseRuntime, bundle: Any) -> None:
    """Under async scheduling, say when learned policies of decision lag 0 make every step wait for
    the previous step's decisions (served exactly as calibrated, without async scheduling's overlap;
    docs/vllm_integration.md §9)."""
    eager = sorted(n for n, p in runtime.bundle.policies.items() if isinstance(p, LearnedPolicy) and p.lag == 0)
    if eager:
        logger.warning("LoRazor: bundle %s has learned policies of decision lag 0 (%s): under async scheduling each "
                       "step is planned only after the previous step's decisions are read, which gives up most of "
                       "async scheduling's overlap. Re-export the bundle with sweep.decision_lag=1 (the default) to "
                       "serve it without waiting.", bundle, ", ".join(eager))


def start_runtime(vllm_config: Any, device: Any, async_capable: bool = False) -> ReleaseRuntime:
    """The runtime of this worker: the bundle's (serving), or an empty calibration runtime whose
    policies come over ``collective_rpc``, told whether the engine caches prefixes (it then
    refuses release policies). ``async_capable``: the runner plans a step before the previous
    step's decisions are read (vLLM 0.33's V2 runner), so it serves under async scheduling.
    Raises one BridgeError naming every fix for unsupported settings."""
    settings = BridgeSettings.from_env()
    if settings is None:
        raise BridgeError("LoRazor's GPU model runner was built without LORAZOR_BUNDLE or LORAZOR_CALIBRATION; the "
                          "plugin installs it only when one of them is set in every vLLM process.")
    serving = not settings.calibration
    keyed = bool(vllm_config.cache_config.enable_prefix_caching) and prefix_cache.installed()
    fixes = engine_fixes(vllm_config, released_blocks_keyed=keyed, async_allowed=async_capable and serving)
    refuse(fixes + release_engine_fixes(vllm_config) if serving else fixes)
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
            warn_if_waiting(runtime, settings.bundle)
        logger.info("LoRazor StepTrim active: bundle %s (%d adapters with policies, hidden size %d, %s scheduling, "
                    "prefix caching %s).", settings.bundle, len(runtime.slot_of), hidden_size,
                    "async" if async_scheduling else "synchronous",
                    "on" if vllm_config.cache_config.enable_prefix_caching else "off")
    runtime.report_releases = serving
    return runtime
