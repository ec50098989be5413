"""vLLM 0.34.0 (2026-11-16, torch 2.14): StepTrim in the V2 GPU model runner, vLLM's only one.

0.34's hooks are 0.33's (:mod:`serve_bridge.vllm.model_runner_v2`, shared): where the two differ
only in a signature, the shared code takes both. ``LoraState.make_lora_inputs`` gains
``num_logits`` (``v1/worker/gpu/lora_utils.py:94-107``), one lm_head row per logits row, which
is one per request since the plugin refuses speculative decoding. Patches of this line (beside
the common ones, docs/vllm_integration.md §0):

- ``vllm.v1.worker.gpu.model_runner.GPUModelRunner`` ← :class:`serve_bridge.vllm.model_runner_v2.LoRazorGPUModelRunner`,
  as on 0.33. Why: the step's LoRA inputs (``make_lora_inputs``, called at
  ``v1/worker/gpu/model_runner.py:1941-1947``), request finish/add (:1255, :1284) and the
  forward's hidden states (``ExecuteModelState``, :2189-2202) are the runner's. How: module
  attribute, imported lazily by ``Worker._make_model_runner`` (``v1/worker/gpu_worker.py:579-587``).
  Upstream: no per-token release hook (issue #54839). Removal: when the V2 runner grows a
  LoRA-inputs hook.
- ``vllm.v1.worker.gpu.model_runner.get_num_active_loras_for_dispatch`` ← the masked mapping's
  kernel group count, as on 0.33 (``lora_utils.py:38-49``, called at ``model_runner.py:1883``).
  Removal: when vLLM counts the no-adapter group itself.
- ``vllm.v1.engine.core.frontend_block_hashes`` ← ``None`` for a request with
  a forced release, vLLM's own answer otherwise. Why: 0.34's Rust frontend (``vllm-rs``) may send
  prompt block hashes it computed in its own process, with vLLM's extra keys only
  (``EngineCoreRequest.block_hashes``); the engine core keeps them (``v1/core/kv_cache_utils.py:1037-1058``,
  imported by name in ``v1/engine/core.py:67``, called at :1287), so a released request's prompt
  blocks would miss the release key. With None the engine hashes them itself, through the keyed
  ``generate_block_hash_extra_keys``. Upstream: none (no per-request extra key). Removal: with the
  prefix-cache keys.

Not patched: 0.34 has no V1 runner to refuse (``v1/worker/gpu_model_runner.py`` is gone), and vLLM
itself stops on ``VLLM_USE_V2_MODEL_RUNNER`` set to anything but 1 (``platforms/interface.py:1481-1486``,
checked when an engine's config is built, ``engine/arg_utils.py:2294``), so engines LoRazor
starts leave it unset.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# 0.33's GPU-sync allowance: utils/gpu_sync_debug.py is the same file, and so is worker_manager.py's use (:295)
from serve_bridge.vllm.versions.v0_33 import sync_allowed as sync_allowed

VERSION = "0.34.0"
RUNNER = "V2"
RUNNER_ENV: dict[str, str] = {}  # VLLM_USE_V2_MODEL_RUNNER stays unset: 1 only draws a warning, 0 an error
V1_RUNNER = False


def require_runner(environ: Mapping[str, str] | None = None) -> None:
    """Nothing to refuse: the V2 runner is 0.34's only one (vLLM refuses any other choice itself)."""


def install_runner() -> None:
    """Make vLLM's workers build LoRazor's V2 runner (idempotent)."""
    from serve_bridge.vllm import model_runner_v2

    model_runner_v2.install()


def install_prefix_cache() -> None:
    """Key vLLM's block hashes by release position (:func:`serve_bridge.vllm.prefix_cache.install`),
    and have the engine core hash the prompt of a request with a forced release itself rather than
    take a frontend's hashes (module doc; other release positions lie past the prompt). Idempotent."""
    from vllm.v1.engine import core

    from serve_bridge.vllm import prefix_cache

    prefix_cache.install()
    original = core.frontend_block_hashes
    if getattr(original, "lorazor_keyed", False):
        return

    def frontend_block_hashes(request: Any, prefix_hash_config: Any) -> Any:
        if prefix_cache.forced_release(request) is not None:
            return None
        return original(request, prefix_hash_config)

    frontend_block_hashes.lorazor_keyed = True  # type: ignore[attr-defined]
    core.frontend_block_hashes = frontend_block_hashes
