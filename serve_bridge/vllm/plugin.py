"""The ``vllm.general_plugins`` entry point (``lorazor = serve_bridge.vllm.plugin:register``).

vLLM calls :func:`register` in every process it starts, before any worker builds its model
runner (``vllm/plugins/__init__.py:77``, called from ``engine/arg_utils.py:769``,
``v1/engine/core.py:112`` and ``v1/worker/worker_base.py:247`` in 0.26.0). Two independent
switches (``serve_bridge.vllm.settings``):

- ``LORAZOR_BUNDLE`` (or the calibration switch, see ``serve_bridge.vllm.settings``): StepTrim.
  Installs the StepTrim runner; engine settings and the bundle are checked when that runner
  starts. With a bundle, also the release-aware scheduler (slot hand-back,
  :mod:`serve_bridge.vllm.scheduler`) unless ``LORAZOR_SLOTS=0``.
- ``LORAZOR_GRIDTRIM=1``: GridTrim. Makes the CUDA platform name
  :class:`serve_bridge.vllm.punica_wrapper.GridTrimPunicaWrapper` as its punica wrapper, so LoRA
  linears run LoRazor's work-list kernels.

With neither, it does nothing, so installing LoRazor leaves vLLM stock. With either, it refuses
an unsupported vLLM or runner (and, for GridTrim, a non-CUDA platform) with one clear error, and
makes vLLM's worker LoRA manager read its adapter registry once per step instead of once per
adapter (:mod:`serve_bridge.vllm.lora_manager`; same calls, same order). In calibration mode it
also keys prefix-cache blocks by forced release position (:mod:`serve_bridge.vllm.prefix_cache`), so
the calibration engine may cache prefixes.

vLLM swallows import errors of plugin modules, so this module imports nothing heavy and
all checks run inside :func:`register`, whose errors vLLM does not catch.
"""
from __future__ import annotations

from serve_bridge.vllm.settings import (BUNDLE_ENV, CALIBRATION_ENV, GRIDTRIM_ENV, BridgeError, BridgeSettings,
                                   gridtrim_from_env, require_v1_runner, require_vllm_version)

# vllm_punica.QUALNAME, spelled out so that this module does not import vLLM's LoRA code.
GRIDTRIM_WRAPPER = "serve_bridge.vllm.punica_wrapper.GridTrimPunicaWrapper"


def register() -> None:
    """Activate the StepTrim runner iff ``BridgeSettings.from_env()`` finds it switched on
    (``LORAZOR_BUNDLE``, or the calibration switch), GridTrim iff ``LORAZOR_GRIDTRIM`` is on."""
    settings = BridgeSettings.from_env()
    steptrim = settings is not None
    gridtrim = gridtrim_from_env()
    if not (steptrim or gridtrim):
        return
    import vllm

    runner_env = CALIBRATION_ENV if settings is not None and settings.calibration else BUNDLE_ENV
    on = " and ".join(name for name, flag in ((runner_env, steptrim), (GRIDTRIM_ENV, gridtrim)) if flag)
    try:
        require_vllm_version(vllm.__version__)
        require_v1_runner()
    except BridgeError as err:
        raise BridgeError(f"{err} (LoRazor is on through {on}.)") from None
    from serve_bridge.vllm import lora_manager as vllm_lora_manager

    vllm_lora_manager.install()
    if gridtrim:
        install_gridtrim()
    if steptrim:
        from serve_bridge.vllm.model_runner import install

        install()
    if settings is not None and settings.slots:
        from serve_bridge.vllm import scheduler

        scheduler.install()
    if settings is not None and settings.calibration:
        from serve_bridge.vllm import prefix_cache

        prefix_cache.install()


def install_gridtrim() -> None:
    """Make ``current_platform.get_punica_wrapper()`` return :data:`GRIDTRIM_WRAPPER` (idempotent).

    vLLM 0.26.0 resolves the wrapper by that qualname in ``lora/punica_wrapper/
    punica_selector.py:13-16``; the CUDA platform's classmethod returns
    ``vllm.lora.punica_wrapper.punica_gpu.PunicaWrapperGPU`` (``platforms/cuda.py:551-552``).
    ``vllm.platforms.current_platform`` is resolved lazily (``platforms/__init__.py:261-280``),
    and already is when general plugins load (``config/compilation.py:22`` imports it at module
    level, before ``engine/arg_utils.py:767-769`` loads plugins). The method is replaced on the
    platform's class, so every reference to the platform sees it.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        raise BridgeError(f"LoRazor GridTrim ({GRIDTRIM_ENV} is on) runs Triton kernels on NVIDIA GPUs only, "
                          f"but vLLM's platform is {type(current_platform).__name__}; unset {GRIDTRIM_ENV}.")
    cls = type(current_platform)
    if cls.get_punica_wrapper() != GRIDTRIM_WRAPPER:
        cls.get_punica_wrapper = classmethod(lambda _cls: GRIDTRIM_WRAPPER)
