"""The ``vllm.general_plugins`` entry point (``lorazor = serve_bridge.plugin:register``).

vLLM calls :func:`register` in every process it starts, before any worker builds its model
runner (``vllm/plugins/__init__.py:77``, called from ``engine/arg_utils.py:769``,
``v1/engine/core.py:112`` and ``v1/worker/worker_base.py:247`` in 0.26.0). Without
``LORAZOR_BUNDLE`` it does nothing, so installing LoRazor leaves vLLM stock. With it, it
refuses an unsupported vLLM or runner with one clear error and installs the StepTrim
runner; engine settings and the bundle are checked when that runner starts.

vLLM swallows import errors of plugin modules, so this module imports nothing heavy and
all checks run inside :func:`register`, whose errors vLLM does not catch.
"""
from __future__ import annotations

from serve_bridge.settings import BridgeSettings, require_v1_runner, require_vllm_version


def register() -> None:
    """Activate StepTrim in this vLLM process iff ``LORAZOR_BUNDLE`` is set."""
    if BridgeSettings.from_env() is None:
        return
    import vllm

    require_vllm_version(vllm.__version__)
    require_v1_runner()
    from serve_bridge.vllm_hooks import install

    install()
