"""vLLM 0.33.0 (2026-11-02, torch 2.14): StepTrim in the V2 GPU model runner, vLLM's default.

Patches of this line (beside the common ones, docs/vllm_integration.md §0):

- ``vllm.v1.worker.gpu.model_runner.GPUModelRunner`` ← :class:`serve_bridge.vllm.model_runner_v2.LoRazorGPUModelRunner`.
  Why: the step's LoRA inputs (``LoraState.make_lora_inputs``, ``v1/worker/gpu/lora_utils.py:94-104``,
  called at ``v1/worker/gpu/model_runner.py:1877-1884``), request add/finish (:1188, :1215) and
  the forward's hidden states (:2046-2060) are the runner's. How: module attribute, which
  ``Worker._make_model_runner`` imports lazily (``v1/worker/gpu_worker.py:578-583``); the
  runner's ``lora_state`` is replaced by a subclass of vLLM's ``LoraState``. Upstream: no
  per-token release hook (issue #54839). Removal: when the V2 runner grows a LoRA-inputs hook.
- ``vllm.v1.worker.gpu.model_runner.get_num_active_loras_for_dispatch`` ← the masked mapping's
  kernel group count. Why: vLLM counts adapters (``v1/worker/gpu/lora_utils.py:38-49``) but the
  kernels' grid covers LoRA groups, the no-adapter group included
  (``lora/ops/triton_ops/lora_kernel_metadata.py:133-155``); released rows add that group. How:
  module attribute, read at call time (``v1/worker/gpu/model_runner.py:1821``). Removal: when
  vLLM counts the no-adapter group itself.
- ``vllm.v1.worker.gpu_model_runner.GPUModelRunner`` ← a class that refuses to be built
  (:func:`refuse_v1_runner`). Why: vLLM falls back to its V1 runner for features V2 lacks
  (``config/vllm.py:741-767``), and the plugin's hooks on this line are V2's: serving there would
  silently not release. Removal: with this line (0.34 has no V1 runner).
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, ContextManager

from serve_bridge.vllm.settings import BUNDLE_ENV, CALIBRATION_ENV, V2_RUNNER_ENV, BridgeError

VERSION = "0.33.0"
RUNNER = "V2"
RUNNER_ENV = {V2_RUNNER_ENV: "1"}  # what engines LoRazor starts itself set
V1_RUNNER = True


def require_runner(environ: Mapping[str, str] | None = None) -> None:
    """Refuse an explicit request for the V1 runner (V2 is vLLM 0.33's default)."""
    env = os.environ if environ is None else environ
    if env.get(V2_RUNNER_ENV, "").strip().lower() in ("0", "false"):
        raise BridgeError(f"LoRazor on vLLM {VERSION} runs inside vLLM's V2 GPU model runner (the default); unset "
                          f"{V2_RUNNER_ENV} (found {V2_RUNNER_ENV}={env[V2_RUNNER_ENV]!r}), or unset {BUNDLE_ENV}.")


def install_runner() -> None:
    """Make vLLM's workers build LoRazor's V2 runner, and refuse the V1 runner (idempotent)."""
    from serve_bridge.vllm import model_runner_v2

    model_runner_v2.install()
    refuse_v1_runner()


def refuse_v1_runner() -> None:
    """Make ``vllm.v1.worker.gpu_model_runner.GPUModelRunner`` a subclass whose constructor raises
    one BridgeError (idempotent): LoRazor's hooks on this line are the V2 runner's."""
    import vllm.v1.worker.gpu_model_runner as v1_runner

    base = v1_runner.GPUModelRunner
    if getattr(base, "lorazor_refused", False):
        return

    class V1RunnerRefused(base):  # type: ignore[misc, valid-type]
        """vLLM 0.33's V1 runner, refused: LoRazor's hooks on this line are the V2 runner's."""

        lorazor_refused = True

        def __init__(self, vllm_config: Any, device: Any) -> None:
            raise BridgeError(f"vLLM {VERSION} built its V1 GPU model runner for this engine (a feature the V2 runner "
                              f"lacks, named in vLLM's log above, or {V2_RUNNER_ENV}=0); LoRazor on vLLM {VERSION} "
                              f"runs in the V2 runner: drop that feature, or unset {BUNDLE_ENV} and {CALIBRATION_ENV}.")

    v1_runner.GPUModelRunner = V1RunnerRefused


def sync_allowed() -> ContextManager[None]:
    """vLLM's GPU-sync checker allows syncs inside this context (``utils/gpu_sync_debug.py``); the
    adapter loads that ``worker_manager.py:294`` wraps in it happen in ours too."""
    from vllm.utils.gpu_sync_debug import gpu_sync_allowed

    return gpu_sync_allowed()


def install_prefix_cache() -> None:
    """Key vLLM's block hashes by release position (:func:`serve_bridge.vllm.prefix_cache.install`)."""
    from serve_bridge.vllm import prefix_cache

    prefix_cache.install()
