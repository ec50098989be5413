"""vLLM 0.26.0 (2026-07-25, torch 2.11): StepTrim in the V1 GPU model runner.

Patches of this line (beside the common ones, docs/vllm_integration.md §0):

- ``vllm.v1.worker.gpu_model_runner.GPUModelRunner`` ← :class:`serve_bridge.vllm.model_runner.LoRazorGPUModelRunner`.
  Why: the mapping, the CUDA-graph LoRA count and the decision hooks live in that runner
  (``v1/worker/gpu_model_runner.py:1169, 2252, 3877, 4111, 4497``). How: module attribute, which
  ``Worker.init_device`` reads lazily (``v1/worker/gpu_worker.py:412-416``). Upstream: no hook
  for per-token adapter release (vLLM issue #54839 asks for slot hand-back). Removal: when
  LoRazor stops supporting 0.26.
- The V2 runner is refused (``VLLM_USE_V2_MODEL_RUNNER=0`` required): vLLM 0.26 picks it for
  dense models and its hooks are not written for this line.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from typing import ContextManager

from serve_bridge.vllm.settings import BUNDLE_ENV, V2_RUNNER_ENV, BridgeError

VERSION = "0.26.0"
RUNNER = "V1"
RUNNER_ENV = {V2_RUNNER_ENV: "0"}  # what engines LoRazor starts itself set
V1_RUNNER = True


def require_runner(environ: Mapping[str, str] | None = None) -> None:
    """Refuse unless the V1 runner is selected explicitly (vLLM 0.26 picks V2 for dense models)."""
    env = os.environ if environ is None else environ
    if env.get(V2_RUNNER_ENV, "").strip().lower() not in ("0", "false"):
        raise BridgeError(f"LoRazor on vLLM {VERSION} runs inside vLLM's V1 GPU model runner; set {V2_RUNNER_ENV}=0 "
                          f"(found {V2_RUNNER_ENV}={env.get(V2_RUNNER_ENV, '<unset>')!r}), or unset {BUNDLE_ENV}.")


def install_runner() -> None:
    """Make vLLM's workers build LoRazor's V1 runner (idempotent)."""
    from serve_bridge.vllm import model_runner

    model_runner.install()


def sync_allowed() -> ContextManager[None]:
    """0.26 has no GPU-sync checker: nothing to allow."""
    return contextlib.nullcontext()


def install_prefix_cache() -> None:
    """Key vLLM's block hashes by release position (:func:`serve_bridge.vllm.prefix_cache.install`)."""
    from serve_bridge.vllm import prefix_cache

    prefix_cache.install()
