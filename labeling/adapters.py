"""Adapter registry for calibration: named peft LoRA directories, validated before loading.

An adapter is a peft LoRA directory (``adapter_config.json`` + ``adapter_model.safetensors``).
Validation happens before any weight is loaded so that a wrong adapter fails with one
clear message instead of a shape error deep inside peft.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open


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


def validate_adapter(spec: AdapterSpec, hidden_size: int) -> dict:
    """Check that ``spec`` is a LoRA adapter for a backbone of ``hidden_size``; return its config.

    Every lora_A that reads the residual stream (q/k/v/gate/up projections) must have
    ``hidden_size`` input features.
    """
    f = weights_file(spec)
    config = json.loads((Path(spec.path) / "adapter_config.json").read_text())
    if config.get("peft_type") != "LORA":
        raise AdapterError(f"adapter '{spec.name}': {spec.path} is a {config.get('peft_type')!r} adapter, not LORA.")
    with safe_open(str(f), framework="pt") as st:
        for key in st.keys():
            if "lora_A" in key and any(p in key for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
                in_features = st.get_slice(key).get_shape()[-1]
                if in_features != hidden_size:
                    raise AdapterError(
                        f"adapter '{spec.name}': {f} was built for hidden size {in_features} "
                        f"({key}), but the backbone has hidden size {hidden_size}. "
                        f"Use an adapter trained for this backbone (conf/backbone) or pick the matching backbone."
                    )
    return config
