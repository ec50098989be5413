"""Adapter registry for calibration: named peft LoRA directories, validated before loading.

An adapter is a peft LoRA directory (``adapter_config.json`` + ``adapter_model.safetensors``).
Validation happens before any weight is loaded so that a wrong adapter fails with one
clear message instead of a shape error deep inside peft.
"""
from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from serve_bridge.strict_json import StrictJSONError, loads_strict, short_repr


class AdapterError(ValueError):
    """A user-facing adapter problem (missing dir, wrong hidden size...)."""


@dataclass(frozen=True)
class AdapterSpec:
    """name: the adapter's serving name; path: its peft directory; task: the part of a mix
    task whose requests it serves (None: every request of the run's task)."""

    name: str
    path: str
    task: str | None = None


def weights_file(spec: AdapterSpec) -> Path:
    """The adapter's safetensors file, or AdapterError naming what is missing."""
    d = Path(spec.path)
    if not d.is_dir():
        raise AdapterError(
            f"adapter '{spec.name}': directory {d} does not exist. Fix adapter.adapters[].path "
            f"(paths are relative to the directory you run from, or absolute)."
        )
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        if not (d / f).is_file():
            raise AdapterError(f"adapter '{spec.name}': {d / f} is missing; save the adapter with peft's save_pretrained.")
    return d / "adapter_model.safetensors"


def read_adapter_config(spec: AdapterSpec) -> dict[str, Any]:
    """``adapter_config.json`` of ``spec`` checked as a LoRA config: peft_type LORA, a positive
    integer rank ``r`` (and ``rank_pattern`` ranks), a positive ``lora_alpha``, target modules."""
    path = Path(spec.path) / "adapter_config.json"
    try:
        config = loads_strict(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise AdapterError(f"adapter '{spec.name}': {path} is not valid UTF-8 ({err.reason}).") from err
    except StrictJSONError as err:
        raise AdapterError(f"adapter '{spec.name}': {path}:{err.lineno or 1} is not valid JSON ({err}); "
                           f"save the adapter with peft's save_pretrained.") from err
    if not isinstance(config, dict):
        raise AdapterError(f"adapter '{spec.name}': {path} holds a JSON {type(config).__name__}, not an object.")
    if config.get("peft_type") != "LORA":
        raise AdapterError(f"adapter '{spec.name}': {spec.path} is a {config.get('peft_type')!r} adapter, not LORA.")
    for key in ("rank_pattern", "alpha_pattern"):
        pattern = config.get(key)
        if pattern is not None and not (isinstance(pattern, dict) and all(k for k in pattern)):
            raise AdapterError(f"adapter '{spec.name}': {path} has {key}={short_repr(pattern)}; use an object mapping "
                               f"module names to values, or leave it out.")
    ranks = {"r": config.get("r"), **{f"rank_pattern[{k!r}]": v for k, v in (config.get("rank_pattern") or {}).items()}}
    for key, r in ranks.items():
        if not isinstance(r, int) or isinstance(r, bool) or r < 1:
            raise AdapterError(f"adapter '{spec.name}': {path} has {key}={r!r}; "
                               f"a LoRA rank must be a positive integer.")
    alphas = {"lora_alpha": config.get("lora_alpha", 8),
              **{f"alpha_pattern[{k!r}]": v for k, v in (config.get("alpha_pattern") or {}).items()}}
    for key, alpha in alphas.items():
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha) or alpha <= 0:
            raise AdapterError(f"adapter '{spec.name}': {path} has {key}={short_repr(alpha)}; use a positive number.")
    targets = config.get("target_modules")
    names = [targets] if isinstance(targets, str) else targets
    if not isinstance(names, list) or not names or not all(isinstance(t, str) and t for t in names):
        raise AdapterError(f"adapter '{spec.name}': {path} has target_modules={short_repr(targets)}; name the modules "
                           f"the adapter patches (a list of module names, or one regular expression).")
    return config


def base_model_matches(base: str, backbone_names: Sequence[str]) -> bool:
    """True iff the adapter's ``base_model_name_or_path`` could name a backbone known by
    ``backbone_names`` (its config name, hub id, GGUF file...): the last path component of
    each, lower-cased with only letters and digits kept, contains the other."""
    def norm(name: str) -> str:
        return re.sub(r"[^a-z0-9]", "", name.rstrip("/").rsplit("/", 1)[-1].split(".", 1)[0].lower())

    b = norm(base)
    return any(n and (n in b or b in n) for n in map(norm, backbone_names) if len(n) >= 3)


def validate_adapter(spec: AdapterSpec, hidden_size: int, backbone_names: Sequence[str] = ()) -> dict:
    """Check that ``spec`` is a LoRA adapter for a backbone of ``hidden_size``; return its config.

    Checks, before any weight is loaded: the config (:func:`read_adapter_config`); that its
    ``base_model_name_or_path``, if set, names the backbone (:func:`base_model_matches`, when
    ``backbone_names`` are given); that the safetensors file is complete and holds LoRA pairs
    whose lora_A is [r, in] and lora_B [out, r] with the config's rank; and that every lora_A
    reading the residual stream (q/k/v/gate/up projections) has ``hidden_size`` input features.
    """
    f = weights_file(spec)
    config = read_adapter_config(spec)
    base = config.get("base_model_name_or_path")
    if backbone_names and isinstance(base, str) and base and not base_model_matches(base, backbone_names):
        raise AdapterError(f"adapter '{spec.name}': its adapter_config.json names base model {base!r}, but the "
                           f"backbone is {backbone_names[0]!r}. Use an adapter trained for this backbone.")
    try:
        with safe_open(str(f), framework="pt") as st:
            shapes = {key: st.get_slice(key).get_shape() for key in st.keys()}
    except SafetensorError as err:
        raise AdapterError(f"adapter '{spec.name}': {f} is not a complete safetensors file ({err}); "
                           f"save the adapter again.") from err
    pairs = {k: k.replace("lora_A", "lora_B") for k in shapes if "lora_A" in k}
    if not pairs:
        raise AdapterError(f"adapter '{spec.name}': {f} holds no LoRA weights (no lora_A tensors).")
    for key_a, key_b in pairs.items():
        a, b = shapes[key_a], shapes.get(key_b)
        if b is None or len(a) != 2 or len(b) != 2 or a[0] != b[1] or not (config.get("rank_pattern")
                                                                          or a[0] == config["r"]):
            raise AdapterError(f"adapter '{spec.name}': {f} has {key_a} of shape {list(a)} and {key_b} of shape "
                               f"{list(b) if b else 'missing'}; expected [r, in] and [out, r] with r={config['r']}.")
        if any(p in key_a for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")) and a[-1] != hidden_size:
            raise AdapterError(
                f"adapter '{spec.name}': {f} was built for hidden size {a[-1]} "
                f"({key_a}), but the backbone has hidden size {hidden_size}. "
                f"Use an adapter trained for this backbone (conf/backbone) or pick the matching backbone."
            )
    return config
