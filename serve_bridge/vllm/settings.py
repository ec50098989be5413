"""How the vLLM bridge is switched on, and the engine settings it refuses (docs/design.md §4).

The bridge is active iff, when vLLM loads its general plugins, ``LORAZOR_BUNDLE`` names a policy
bundle directory (serving) or ``LORAZOR_CALIBRATION`` is on (calibration, set by
``labeling.engines.vllm``: no bundle, policies set over ``collective_rpc``). ``LORAZOR_ADAPTERS``
(``name=path,...``) optionally declares the served adapters, checked against the bundle at start-up;
``LORAZOR_LOG_INTERVAL_S`` sets the seconds between counter summaries (default 60, 0: never);
``LORAZOR_SLOTS`` switches slot hand-back (a released request stops counting against
``max_loras``; on by default with a bundle, refused in calibration mode).
``LORAZOR_BUNDLE_DIGEST`` pins the served bundle: its :func:`serve_bridge.bundle.bundle_digest`, as the
export stage prints it; the runtime then refuses any other bundle (an edited manifest included).
``LORAZOR_GRIDTRIM`` switches GridTrim on independently; ``LORAZOR_GRIDTRIM_LAUNCH`` (``ops``, the default,
or ``inductor``) picks how a compiled forward launches its kernels (:mod:`serve_bridge.gridtrim`).
Environment variables reach every vLLM process, so all of them agree (docs/vllm_integration.md §1, §9).
Pure Python: engine settings are read by attribute only, so this is tested on CPU without vLLM.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from serve_bridge.command_line import one_line

BUNDLE_ENV = "LORAZOR_BUNDLE"
DIGEST_ENV = "LORAZOR_BUNDLE_DIGEST"
ADAPTERS_ENV = "LORAZOR_ADAPTERS"
LOG_INTERVAL_ENV = "LORAZOR_LOG_INTERVAL_S"
V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
GRIDTRIM_ENV = "LORAZOR_GRIDTRIM"
GRIDTRIM_LAUNCH_ENV = "LORAZOR_GRIDTRIM_LAUNCH"
CALIBRATION_ENV = "LORAZOR_CALIBRATION"
SLOTS_ENV = "LORAZOR_SLOTS"
SCHEDULER_QUALNAME = "serve_bridge.vllm.scheduler.ReleaseScheduler"
ASYNC_SCHEDULER_QUALNAME = "serve_bridge.vllm.scheduler.ReleaseAsyncScheduler"
SLOT_EXECUTORS = ("uni", "mp")  # executors whose step output reaches the scheduler as the worker's object
RELEASES_ATTR = "lorazor_releases"  # ModelRunnerOutput attribute: {req_id: r} decided in that step


class BridgeError(RuntimeError):
    """The bridge cannot run with this vLLM or these engine settings; the message (one line) says the fix."""

    def __init__(self, message: str) -> None:
        super().__init__(one_line(message))


@dataclass(frozen=True)
class BridgeSettings:
    """Activation settings read from the environment.

    bundle: the policy bundle directory (None in calibration mode).
    adapters: served adapter name → local adapter directory (empty when not declared).
    log_interval_s: seconds between counter summaries in the log (0 = never).
    calibration: calibration mode (``LORAZOR_CALIBRATION``): no bundle; the runtime's
        policies, scorer and capture set are set over ``collective_rpc``.
    slots: slot hand-back (``LORAZOR_SLOTS``; serving only).
    bundle_digest: the digest the bundle must have (``LORAZOR_BUNDLE_DIGEST``), or None.
    """

    bundle: Path | None
    adapters: dict[str, str] = field(default_factory=dict)
    log_interval_s: float = 60.0
    calibration: bool = False
    slots: bool = False
    bundle_digest: str | None = None

    @staticmethod
    def from_env(environ: Mapping[str, str] | None = None) -> BridgeSettings | None:
        """The settings, or None when neither ``LORAZOR_BUNDLE`` nor ``LORAZOR_CALIBRATION``
        is set (bridge off)."""
        env = os.environ if environ is None else environ
        bundle = env.get(BUNDLE_ENV, "").strip()
        calibration = calibration_from_env(env)
        if calibration and bundle:
            raise BridgeError(f"{CALIBRATION_ENV} and {BUNDLE_ENV} are both set: calibration runs without a bundle "
                              f"(its policies come over collective_rpc); unset one of them.")
        digest = digest_from_env(env)
        if digest is not None and not bundle:
            raise BridgeError(f"{DIGEST_ENV} is set but {BUNDLE_ENV} is not: name the bundle it pins in {BUNDLE_ENV}, "
                              f"or unset {DIGEST_ENV}.")
        if not (bundle or calibration):
            return None
        slots = _serving_switch(SLOTS_ENV, "for slot hand-back", "slot hand-back serves a bundle's releases",
                                env, calibration)
        return BridgeSettings(bundle=Path(bundle).expanduser() if bundle else None,
                              adapters=parse_adapters(env.get(ADAPTERS_ENV, "")),
                              log_interval_s=_parse_interval(env.get(LOG_INTERVAL_ENV, "")),
                              calibration=calibration, slots=slots, bundle_digest=digest)


def _switch(name: str, purpose: str, environ: Mapping[str, str] | None, default: bool = False) -> bool:
    """An on/off variable: unset or "" → ``default``, "0" or "off" → False, "1" or "on" → True
    (case and surrounding whitespace ignored); anything else is refused, naming ``purpose``."""
    env = os.environ if environ is None else environ
    raw = env.get(name, "")
    value = raw.strip().lower()
    if not value:
        return default
    if value in ("0", "off"):
        return False
    if value in ("1", "on"):
        return True
    raise BridgeError(f"{name}={raw!r}: use 1 or on {purpose}, or 0, off or unset.")


def _serving_switch(name: str, purpose: str, why_not_calibrating: str, environ: Mapping[str, str],
                    calibration: bool) -> bool:
    """A switch of serving (:func:`_switch`): on by default with a bundle, off in calibration mode,
    where turning it on is refused, saying ``why_not_calibrating``."""
    on = _switch(name, purpose, environ, default=not calibration)
    if calibration and on:
        raise BridgeError(f"{name} is on in calibration mode ({CALIBRATION_ENV}): {why_not_calibrating}; "
                          f"unset {name}.")
    return on


def calibration_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``LORAZOR_CALIBRATION`` is on (see :func:`_switch`)."""
    return _switch(CALIBRATION_ENV, "for the calibration runtime (labeling.engines.vllm sets it)", environ)


def digest_from_env(environ: Mapping[str, str]) -> str | None:
    """``LORAZOR_BUNDLE_DIGEST`` as 64 lowercase hex digits, or None when unset or empty; anything
    else is refused."""
    raw = environ.get(DIGEST_ENV, "")
    value = raw.strip().lower()
    if not value:
        return None
    if not re.fullmatch(r"[0-9a-f]{64}", value):
        raise BridgeError(f"{DIGEST_ENV}={raw!r}: give the bundle's 64-hex digest as the export printed it "
                          f"(serve_bridge.bundle.bundle_digest), or unset it.")
    return value


def parse_adapters(text: str) -> dict[str, str]:
    """Parse ``name=path,name=path`` (whitespace around items is ignored; empty text → {})."""
    out: dict[str, str] = {}
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        name, sep, path = (s.strip() for s in item.partition("="))
        if not sep or not name or not path:
            raise BridgeError(f"{ADAPTERS_ENV}: item {item!r} is not name=path; write e.g. "
                              f"{ADAPTERS_ENV}='sql=/adapters/sql,math=/adapters/math'.")
        if name in out:
            raise BridgeError(f"{ADAPTERS_ENV}: adapter '{name}' is listed twice; list each adapter once.")
        out[name] = path
    return out


def _parse_interval(text: str) -> float:
    if not text.strip():
        return 60.0
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise BridgeError(f"{LOG_INTERVAL_ENV}={text!r}: give a number of seconds ≥ 0 (0 disables the log).")
    return value


def gridtrim_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``LORAZOR_GRIDTRIM`` switches GridTrim on (see :func:`_switch`)."""
    return _switch(GRIDTRIM_ENV, "to serve LoRA linears with LoRazor's GridTrim kernels (0, off or unset keep "
                   "vLLM's)", environ)


def gridtrim_launch_from_env(environ: Mapping[str, str] | None = None) -> str:
    """``LORAZOR_GRIDTRIM_LAUNCH``: how a compiled forward launches GridTrim's kernels, ``"ops"`` or
    ``"inductor"`` (case and surrounding whitespace ignored), ``gridtrim.DEFAULT_LAUNCH`` when unset
    or empty; anything else is refused."""
    from serve_bridge.gridtrim import COMPILED_LAUNCHES, DEFAULT_LAUNCH

    env = os.environ if environ is None else environ
    raw = env.get(GRIDTRIM_LAUNCH_ENV, "")
    value = raw.strip().lower() or DEFAULT_LAUNCH
    if value not in COMPILED_LAUNCHES:
        raise BridgeError(f"{GRIDTRIM_LAUNCH_ENV}={raw!r}: use {' or '.join(COMPILED_LAUNCHES)} (how a compiled "
                          f"forward launches GridTrim's kernels), or unset it.")
    return value


def engine_fixes(vllm_config: Any, released_blocks_keyed: bool = False, async_allowed: bool = False) -> list[str]:
    """Every change of engine settings StepTrim needs (empty: none), as fixes to name at once.

    - LoRA must be enabled (there is nothing to release otherwise), on a generative model
      (pooling models decode nothing; vLLM 0.33's classification heads are not slot-copied).
    - Prefix caching only when ``released_blocks_keyed``: vLLM hashes blocks with the LoRA name,
      so a block computed after a release must be keyed with its release point
      (:mod:`serve_bridge.vllm.prefix_cache`), or it would be reused as the adapter's.
    - Async scheduling only when ``async_allowed`` (a runner that plans a step before the previous
      one's decisions are read: vLLM 0.33's V2 runner, serving).
    - No speculative decoding and no pipeline parallelism: one sampled position per
      request per step, and final hidden states on this rank.
    """
    fixes = []
    if vllm_config.lora_config is None:
        fixes.append("enable LoRA (enable_lora=True / --enable-lora)")
    runner = vllm_config.model_config.runner_type
    if runner != "generate":
        fixes.append(f"serve a generative model (runner 'generate', found {runner!r}): release acts on decoded tokens")
    if vllm_config.cache_config.enable_prefix_caching and not released_blocks_keyed:
        fixes.append("disable prefix caching (enable_prefix_caching=False / --no-enable-prefix-caching): in "
                     "calibration mode blocks decoded after a release the runtime decides would be cached under the "
                     "adapter's name")
    if vllm_config.scheduler_config.async_scheduling and not async_allowed:
        fixes.append("disable async scheduling (async_scheduling=False / --no-async-scheduling): calibration and vLLM "
                     "0.26's V1 runner read each step's decisions before the next step is planned")
    if vllm_config.speculative_config is not None:
        fixes.append("disable speculative decoding (StepTrim decides once per generated token)")
    if vllm_config.parallel_config.pipeline_parallel_size != 1:
        fixes.append("use pipeline_parallel_size=1 (decisions read the final hidden states on this rank)")
    return fixes


def release_engine_fixes(vllm_config: Any) -> list[str]:
    """Every change of engine settings a served bundle's releases need to reach the scheduler
    (slot hand-back, and the prefix-cache keys of learned releases); empty: none.

    - The scheduler must be LoRazor's (``scheduler_cls`` unset, which the plugin resolves to it,
      or :data:`SCHEDULER_QUALNAME`, or :data:`ASYNC_SCHEDULER_QUALNAME` under async scheduling):
      another one would keep counting released requests and hash blocks without release points.
    - The executor must be ``uni`` or ``mp``: the step output with learned releases
      then reaches the scheduler as the driver worker's object, or pickled with its attributes.
    """
    fixes = []
    cls = vllm_config.scheduler_config.scheduler_cls
    name = cls if isinstance(cls, str) or cls is None else f"{cls.__module__}.{cls.__qualname__}"
    if name not in (None, SCHEDULER_QUALNAME, ASYNC_SCHEDULER_QUALNAME):
        fixes.append(f"use LoRazor's scheduler (unset scheduler_cls, or scheduler_cls={SCHEDULER_QUALNAME!r}), "
                     f"not {name!r}")
    backend = vllm_config.parallel_config.distributed_executor_backend
    if backend not in SLOT_EXECUTORS:
        fixes.append(f"use distributed_executor_backend 'mp' or 'uni' (found {backend!r}): learned releases "
                     f"reach the scheduler with the step output only through those")
    return fixes


def refuse(fixes: list[str]) -> None:
    """One BridgeError naming every fix at once, if there is any."""
    if fixes:
        raise BridgeError(f"LoRazor ({BUNDLE_ENV} or {CALIBRATION_ENV} is set) cannot run with these engine settings: "
                          + "; ".join(fixes) + ".")

