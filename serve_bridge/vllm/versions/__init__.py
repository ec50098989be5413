"""The per-version seam: what differs between the vLLM lines LoRazor supports, one module each.

Everything else in :mod:`serve_bridge.vllm` is written once, against these modules' names. A seam
module imports vLLM only inside its functions, so picking one costs nothing. Each lists its
patches (vLLM file:line, why, upstream status, removal plan) in its docstring;
docs/vllm_integration.md §0 has the same table. Adding a vLLM line means one new module here and
one entry in :data:`SEAMS`; which lines are kept, and for how long: docs/serving.md.

A seam module holds ``VERSION``; ``RUNNER``, the GPU model runner its hooks live in;
``RUNNER_ENV``, the runner switch engines that LoRazor starts set; ``V1_RUNNER``, whether the line
still ships vLLM's V1 runner; ``require_runner``, ``install_runner``, ``sync_allowed`` and
``install_prefix_cache``.
"""
from __future__ import annotations

import importlib
import importlib.metadata
from types import ModuleType

from serve_bridge.vllm.settings import BUNDLE_ENV, BridgeError

# vLLM version → its seam module, newest first (docs/serving.md: each release's state).
SEAMS = {"0.34.0": "serve_bridge.vllm.versions.v0_34", "0.33.0": "serve_bridge.vllm.versions.v0_33",
         "0.26.0": "serve_bridge.vllm.versions.v0_26"}
SUPPORTED = tuple(SEAMS)
EXTRA = "0.34.0"  # the newest maintained release, which `pip install 'lorazor[vllm]'` installs


def supported_text() -> str:
    """The supported versions, newest first, and how to install each, for one-line errors."""
    return ", or ".join(f"vllm=={v} (pip install 'lorazor[vllm]')" if v == EXTRA
                        else f"vllm=={v} (pip install lorazor 'vllm=={v}')" for v in SUPPORTED)


def seam(version: str) -> ModuleType:
    """The seam module for vLLM ``version``; any other version is refused with one BridgeError."""
    name = SEAMS.get(version)
    if name is None:
        raise BridgeError(f"LoRazor's serve_bridge hooks private APIs of vLLM {', '.join(SUPPORTED)} only, but vLLM "
                          f"{version} is installed. Install {supported_text()}, or unset {BUNDLE_ENV} to serve "
                          f"without StepTrim.")
    return importlib.import_module(name)


def installed_version() -> str | None:
    """The installed vLLM's version from its package metadata (vLLM is not imported), or None."""
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


def runner_environment(version: str | None = None) -> dict[str, str]:
    """The runner switch an engine that LoRazor starts sets for vLLM ``version`` (default: the
    installed one, read without importing vLLM); empty for a line that needs none, and for another
    version, which the plugin then refuses in one line."""
    version = installed_version() if version is None else version
    return dict(seam(version).RUNNER_ENV) if version in SEAMS else {}


def has_v1_runner(version: str | None = None) -> bool:
    """Whether vLLM ``version`` (default: the installed one) still ships its V1 GPU model runner,
    which ``VLLM_USE_V2_MODEL_RUNNER=0`` selects; False for a version LoRazor does not support."""
    version = installed_version() if version is None else version
    return version in SEAMS and seam(version).V1_RUNNER


def current() -> ModuleType:
    """The seam of the vLLM that ``import vllm`` gives (imports it)."""
    import vllm

    return seam(vllm.__version__)
