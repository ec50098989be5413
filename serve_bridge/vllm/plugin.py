"""The ``vllm.general_plugins`` entry point (``lorazor = serve_bridge.vllm.plugin:register``).

vLLM calls :func:`register` in every process it starts. It does nothing unless a LoRazor switch
is on (``LORAZOR_BUNDLE`` or ``LORAZOR_CALIBRATION``: StepTrim and the prefix-cache keys, with a
bundle also the release-aware scheduler; ``LORAZOR_GRIDTRIM``: GridTrim), so installing LoRazor leaves
vLLM stock; with one on, it refuses an unsupported vLLM or runner with one clear error and installs
the hooks, the runner's and the prefix-cache keys from the installed vLLM's seam
(:mod:`serve_bridge.vllm.versions`; docs/vllm_integration.md §0-1). vLLM swallows import errors of
plugin modules, so this module imports nothing heavy and every check runs inside :func:`register`.
"""
from __future__ import annotations

from serve_bridge.vllm import versions
from serve_bridge.vllm.settings import (BUNDLE_ENV, CALIBRATION_ENV, GRIDTRIM_ENV, BridgeError, BridgeSettings,
                                        gridtrim_from_env, gridtrim_launch_from_env)

# punica_wrapper.QUALNAME, spelled out so that this module does not import vLLM's LoRA code.
GRIDTRIM_WRAPPER = "serve_bridge.vllm.punica_wrapper.GridTrimPunicaWrapper"


def register() -> None:
    """Activate the StepTrim runner iff ``BridgeSettings.from_env()`` finds it switched on
    (``LORAZOR_BUNDLE``, or the calibration switch), GridTrim iff ``LORAZOR_GRIDTRIM`` is on."""
    settings = BridgeSettings.from_env()
    steptrim = settings is not None
    gridtrim = gridtrim_from_env()
    if not (steptrim or gridtrim):
        return
    launch = gridtrim_launch_from_env() if gridtrim else None
    runner_env = CALIBRATION_ENV if settings is not None and settings.calibration else BUNDLE_ENV
    on = " and ".join(name for name, flag in ((runner_env, steptrim), (GRIDTRIM_ENV, gridtrim)) if flag)
    try:
        seam = versions.current()
        seam.require_runner()
    except BridgeError as err:
        raise BridgeError(f"{err} (LoRazor is on through {on}.)") from None
    from serve_bridge.vllm import lora_manager

    lora_manager.install(seam.sync_allowed)
    if launch is not None:
        install_gridtrim(launch)
    if steptrim:
        seam.install_runner()
    if settings is not None and not settings.calibration:
        from serve_bridge.vllm import scheduler

        scheduler.install()
    if settings is not None:
        seam.install_prefix_cache()


def install_gridtrim(launch: str) -> None:
    """Make ``current_platform.get_punica_wrapper()`` return :data:`GRIDTRIM_WRAPPER`, and key vLLM's
    compile cache by it and by ``launch``, how its compiled forward launches the kernels
    (:mod:`serve_bridge.vllm.compile_cache`); idempotent.

    The classmethod is replaced on the platform's class, so every reference to the platform sees it
    (docs/vllm_integration.md §4).
    """
    from vllm.platforms import current_platform

    from serve_bridge.vllm import compile_cache

    if not current_platform.is_cuda():
        raise BridgeError(f"LoRazor GridTrim ({GRIDTRIM_ENV} is on) runs Triton kernels on NVIDIA GPUs only, "
                          f"but vLLM's platform is {type(current_platform).__name__}; unset {GRIDTRIM_ENV}.")
    cls = type(current_platform)
    if cls.get_punica_wrapper() != GRIDTRIM_WRAPPER:
        cls.get_punica_wrapper = classmethod(lambda _cls: GRIDTRIM_WRAPPER)
    compile_cache.install(GRIDTRIM_WRAPPER, launch)
