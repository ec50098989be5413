"""Policy bundle I/O — the contract between calibration and production servers (docs/design.md §5).

A bundle is a directory holding exactly:

- ``manifest.json``: ``schema_version`` (:data:`SCHEMA_VERSION`), ``toolkit_version``,
  ``backbone`` id, ``hidden_size``, ``config_fingerprint``; ``adapters``: one object per
  adapter with ``name``, ``weights_sha256`` (sha256 of its safetensors file, see
  :func:`adapter_fingerprint`), ``policy`` (``learned`` | ``profiled`` | ``none``), ``tau``
  (learned only), ``k`` (profiled only), ``head`` (``{"weight": name, "bias": name}`` tensor
  names in the heads file, learned only) and ``stats`` (calibration numbers, JSON);
  ``files``: ``{file name: sha256}`` for every other file of the bundle.
- ``heads.safetensors``: ``<adapter>.weight`` [H] float32 and ``<adapter>.bias`` [] float32
  for each learned adapter.

:func:`load_bundle` validates everything and raises one :class:`BundleError` on the first
problem. It reads tensors only through ``safetensors.numpy.load_file`` and never unpickles:
a file the manifest does not list, or any non-safetensors file, is an error. An adapter the
server serves but the bundle lacks is not an error: it runs full LoRA (docs/design.md §2) and a
:class:`BundleWarning` says so.

This module imports no vLLM and nothing from the calibration packages.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import uuid
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from serve_bridge.steptrim import LearnedPolicy, Policy, ProfiledPolicy

SCHEMA_VERSION = 1
TOOLKIT_VERSION = "0.1.0"
MANIFEST = "manifest.json"
HEADS_FILE = "heads.safetensors"
POLICY_KINDS = ("learned", "profiled", "none")
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"  # peft's file name inside an adapter dir


class BundleError(ValueError):
    """A bundle that cannot be written or loaded; the message names the file, field and fix."""


class BundleWarning(UserWarning):
    """A served adapter without a policy in the bundle (it runs full LoRA)."""


@dataclass(frozen=True)
class AdapterEntry:
    """One adapter of a bundle.

    name: the adapter name as the server knows it.
    weights_sha256: sha256 of the adapter's safetensors file (:func:`adapter_fingerprint`).
    policy: ``learned`` (head + tau), ``profiled`` (k) or ``none`` (never released).
    tau: release threshold of a learned policy (s_t < tau ⇒ release), else None.
    k: release point of a profiled policy, else None.
    weight, bias: the learned head, float32 [H] and a float (learned only, else None).
    stats: calibration numbers (validation skip, loss, rule, frontier summary); JSON only.
    """

    name: str
    weights_sha256: str
    policy: str
    tau: float | None = None
    k: int | None = None
    weight: np.ndarray | None = None
    bias: float | None = None
    stats: dict[str, Any] = field(default_factory=dict)

    def to_policy(self) -> Policy:
        """The StepTrim policy object (None for ``none``: never released)."""
        if self.policy == "learned":
            return LearnedPolicy(torch.from_numpy(np.asarray(self.weight, np.float32)), float(self.bias),
                                 float(self.tau))
        if self.policy == "profiled":
            return ProfiledPolicy(int(self.k))
        return None


@dataclass(frozen=True)
class Bundle:
    """A validated, loaded bundle.

    policies: adapter → StepTrim policy (None = never release), covering the bundle's
        adapters and, when the loader got ``known_adapters``, every known adapter.
    adapters: the bundle's entries by name (policy, tau/k, head, fingerprint, stats).
    """

    path: Path
    schema_version: int
    toolkit_version: str
    backbone: str
    hidden_size: int
    config_fingerprint: str
    adapters: dict[str, AdapterEntry]
    policies: dict[str, Policy]


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def adapter_fingerprint(path: str | Path) -> str:
    """sha256 of an adapter's weights: ``path`` is its safetensors file or its peft directory."""
    p = Path(path)
    if p.is_dir():
        p = p / ADAPTER_WEIGHTS_FILE
    if not p.is_file() or p.suffix != ".safetensors":
        raise BundleError(f"adapter weights {p} not found: pass the adapter's .safetensors file or a "
                          f"peft directory holding {ADAPTER_WEIGHTS_FILE}.")
    return file_sha256(p)


def config_fingerprint(config: Mapping[str, Any]) -> str:
    """sha256 of a config's canonical JSON (sorted keys); pass a plain, resolved mapping."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()


def head_tensor_names(adapter: str) -> tuple[str, str]:
    """Tensor names of an adapter's head: (``<adapter>.weight``, ``<adapter>.bias``)."""
    return f"{adapter}.weight", f"{adapter}.bias"


def _check_entry(e: AdapterEntry, hidden_size: int, where: str) -> None:
    """Raise BundleError if an entry is inconsistent; ``where`` names the file and field."""
    if not isinstance(e.name, str) or not e.name:
        raise BundleError(f"{where}: 'name' must be a non-empty string.")
    if not isinstance(e.weights_sha256, str) or len(e.weights_sha256) != 64:
        raise BundleError(f"{where}: 'weights_sha256' must be a 64-hex sha256 (use adapter_fingerprint()).")
    if e.policy not in POLICY_KINDS:
        raise BundleError(f"{where}: 'policy' is {e.policy!r}; use one of {', '.join(POLICY_KINDS)}.")
    if e.policy == "learned":
        if not isinstance(e.tau, (int, float)) or isinstance(e.tau, bool) or not math.isfinite(e.tau):
            raise BundleError(f"{where}: a learned policy needs a finite 'tau', got {e.tau!r}.")
        if e.weight is None or e.bias is None:
            raise BundleError(f"{where}: a learned policy needs head tensors (weight [H], bias []).")
        if tuple(np.shape(e.weight)) != (hidden_size,) or np.ndim(e.bias) != 0:
            raise BundleError(f"{where}: head weight shape {tuple(np.shape(e.weight))} and bias shape "
                              f"{tuple(np.shape(e.bias))} must be ({hidden_size},) and () — the head was "
                              f"fitted on another backbone; re-run calibration for this backbone.")
        if not (np.isfinite(e.weight).all() and math.isfinite(float(e.bias))):
            raise BundleError(f"{where}: head tensors hold non-finite values; re-fit the head.")
    elif e.tau is not None or e.weight is not None or e.bias is not None:
        raise BundleError(f"{where}: 'tau' and head tensors belong to learned policies only "
                          f"(policy is {e.policy!r}).")
    if e.policy == "profiled":
        if not isinstance(e.k, int) or isinstance(e.k, bool) or e.k < 0:
            raise BundleError(f"{where}: a profiled policy needs an integer 'k' ≥ 0, got {e.k!r}.")
    elif e.k is not None:
        raise BundleError(f"{where}: 'k' belongs to profiled policies only (policy is {e.policy!r}).")


def write_bundle(directory: str | Path, *, backbone: str, hidden_size: int, config_fingerprint: str,
                 adapters: Sequence[AdapterEntry], toolkit_version: str = TOOLKIT_VERSION) -> Path:
    """Write a bundle to ``directory`` (must not exist or be empty) and return its path.

    The bundle is assembled in a scratch directory beside it and renamed into place, so an
    interrupted write never leaves a half bundle behind.
    """
    out = Path(directory)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise BundleError(f"bundle directory {out} already exists and is not empty: choose a new "
                          f"directory or delete it first.")
    names = [e.name for e in adapters]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise BundleError(f"adapters {dupes} appear more than once; pass one AdapterEntry per adapter.")
    tensors: dict[str, np.ndarray] = {}
    records = []
    for e in sorted(adapters, key=lambda e: e.name):
        _check_entry(e, hidden_size, f"adapter '{e.name}'")
        head = None
        if e.policy == "learned":
            w_name, b_name = head_tensor_names(e.name)
            tensors[w_name] = np.ascontiguousarray(e.weight, dtype=np.float32)
            tensors[b_name] = np.array(e.bias, dtype=np.float32)
            head = {"weight": w_name, "bias": b_name}
        records.append({"name": e.name, "weights_sha256": e.weights_sha256, "policy": e.policy,
                        "tau": None if e.tau is None else float(e.tau), "k": e.k, "head": head,
                        "stats": e.stats})
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = out.parent / f".{out.name}.partial-{uuid.uuid4().hex[:8]}"
    scratch.mkdir()
    try:
        save_file(tensors, str(scratch / HEADS_FILE))
        manifest = {
            "schema_version": SCHEMA_VERSION, "toolkit_version": toolkit_version, "backbone": backbone,
            "hidden_size": int(hidden_size), "config_fingerprint": config_fingerprint,
            "adapters": records, "files": {HEADS_FILE: file_sha256(scratch / HEADS_FILE)},
        }
        try:
            text = json.dumps(manifest, indent=2, allow_nan=False)
        except (TypeError, ValueError) as err:
            raise BundleError(f"manifest field 'stats' must be plain JSON (finite numbers, str, lists, "
                              f"dicts): {err}. Convert numpy values with float()/int().") from err
        (scratch / MANIFEST).write_text(text + "\n")
        if out.exists():
            out.rmdir()
        os.replace(scratch, out)
    finally:
        if scratch.exists():
            shutil.rmtree(scratch)
    return out


def _field(obj: Mapping[str, Any], key: str, types: type | tuple[type, ...], where: str) -> Any:
    if key not in obj:
        raise BundleError(f"{where}: field '{key}' is missing; re-export the bundle with this toolkit.")
    value = obj[key]
    if not isinstance(value, types) or isinstance(value, bool):
        raise BundleError(f"{where}: field '{key}' has type {type(value).__name__}; expected "
                          f"{getattr(types, '__name__', types)}. Re-export the bundle.")
    return value


def _check_files(root: Path, files: Mapping[str, Any]) -> None:
    """Every listed file exists with its sha256; nothing else is in the bundle."""
    where = f"{root / MANIFEST}"
    for name, digest in files.items():
        if not isinstance(name, str) or Path(name).name != name or not name.endswith(".safetensors"):
            raise BundleError(f"{where}: 'files' lists {name!r}; a bundle holds only plain "
                              f".safetensors file names. Re-export the bundle.")
        path = root / name
        if not path.is_file():
            raise BundleError(f"{path} is missing (listed in {where} 'files'); copy the whole bundle "
                              f"directory or re-export it.")
        if file_sha256(path) != digest:
            raise BundleError(f"{path}: sha256 does not match {where} 'files' — the file was modified "
                              f"or corrupted. Re-copy the bundle from its source; do not edit it.")
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if rel != MANIFEST and rel not in files:
            raise BundleError(f"{path}: not listed in {where} 'files'. A bundle holds only manifest.json "
                              f"and the listed .safetensors files (never pickles); remove it.")


def _entry(rec: Any, i: int, heads: Mapping[str, np.ndarray], hidden_size: int, root: Path) -> AdapterEntry:
    where = f"{root / MANIFEST} adapters[{i}]"
    if not isinstance(rec, dict):
        raise BundleError(f"{where}: expected an object; re-export the bundle.")
    name = _field(rec, "name", str, where)
    where = f"{root / MANIFEST} adapter '{name}'"
    policy = _field(rec, "policy", str, where)
    weight = bias = None
    if policy == "learned":
        head = _field(rec, "head", dict, where)
        names = (head.get("weight"), head.get("bias"))
        for n in names:
            if not isinstance(n, str) or n not in heads:
                raise BundleError(f"{where}: head tensor {n!r} is not in {root / HEADS_FILE}; re-export.")
            if heads[n].dtype != np.float32:
                raise BundleError(f"{root / HEADS_FILE}: tensor {n!r} is {heads[n].dtype}, expected float32.")
        weight, bias = heads[names[0]], heads[names[1]]
    entry = AdapterEntry(name=name, weights_sha256=_field(rec, "weights_sha256", str, where), policy=policy,
                         tau=rec.get("tau"), k=rec.get("k"), weight=weight, bias=bias,
                         stats=_field(rec, "stats", dict, where))
    _check_entry(entry, hidden_size, where)
    return entry if bias is None else replace(entry, bias=float(bias))


def load_bundle(directory: str | Path, expected_hidden_size: int | None = None,
                expected_backbone: str | None = None,
                known_adapters: Iterable[str] | None = None) -> Bundle:
    """Load and validate a bundle; raise one :class:`BundleError` on the first problem.

    expected_hidden_size / expected_backbone: the served model's values (checked if given).
    known_adapters: the adapter names the server serves. A bundle adapter outside this set
    is an error; a known adapter absent from the bundle gets policy None (full LoRA) and a
    :class:`BundleWarning`.
    """
    root = Path(directory)
    mpath = root / MANIFEST
    if not mpath.is_file():
        raise BundleError(f"{mpath} not found: {root} is not a policy bundle. Point the server at the "
                          f"directory written by the calibration export stage.")
    try:
        manifest = json.loads(mpath.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise BundleError(f"{mpath} is not valid JSON ({err}); re-export the bundle.") from err
    if not isinstance(manifest, dict):
        raise BundleError(f"{mpath}: expected a JSON object; re-export the bundle.")
    where = str(mpath)
    version = _field(manifest, "schema_version", int, where)
    if version > SCHEMA_VERSION:
        raise BundleError(f"{where}: 'schema_version' {version} was written by a newer LoRazor (this one "
                          f"reads {SCHEMA_VERSION}); upgrade LoRazor on the server.")
    if version != SCHEMA_VERSION:
        raise BundleError(f"{where}: 'schema_version' {version} is unknown (this LoRazor reads "
                          f"{SCHEMA_VERSION}); re-export the bundle.")
    files = _field(manifest, "files", dict, where)
    _check_files(root, files)
    hidden_size = _field(manifest, "hidden_size", int, where)
    if expected_hidden_size is not None and hidden_size != expected_hidden_size:
        raise BundleError(f"{where}: 'hidden_size' is {hidden_size} but the served model has "
                          f"{expected_hidden_size}: this bundle was calibrated for another backbone.")
    backbone = _field(manifest, "backbone", str, where)
    if expected_backbone is not None and backbone != expected_backbone:
        raise BundleError(f"{where}: 'backbone' is {backbone!r} but the server runs {expected_backbone!r}; "
                          f"use the bundle calibrated for this backbone.")
    if HEADS_FILE not in files:
        raise BundleError(f"{where}: 'files' does not list {HEADS_FILE}; re-export the bundle.")
    try:
        heads = load_file(str(root / HEADS_FILE))
    except SafetensorError as err:
        raise BundleError(f"{root / HEADS_FILE} is not a valid safetensors file ({err}); re-export.") from err
    records = _field(manifest, "adapters", list, where)
    adapters: dict[str, AdapterEntry] = {}
    for i, rec in enumerate(records):
        e = _entry(rec, i, heads, hidden_size, root)
        if e.name in adapters:
            raise BundleError(f"{where}: adapter '{e.name}' appears twice in 'adapters'; re-export.")
        adapters[e.name] = e
    policies = {name: e.to_policy() for name, e in adapters.items()}
    if known_adapters is not None:
        known = list(known_adapters)
        unknown = [n for n in adapters if n not in known]
        if unknown:
            raise BundleError(f"{where}: adapter '{unknown[0]}' is not served here (served: "
                              f"{', '.join(known) or 'none'}); load the adapter or use a bundle for this "
                              f"server's adapters.")
        for n in known:
            if n not in adapters:
                warnings.warn(f"adapter '{n}' has no policy in {root}: it runs full LoRA (never released).",
                              BundleWarning, stacklevel=2)
                policies[n] = None
    return Bundle(path=root, schema_version=version, toolkit_version=_field(manifest, "toolkit_version", str, where),
                  backbone=backbone, hidden_size=hidden_size,
                  config_fingerprint=_field(manifest, "config_fingerprint", str, where),
                  adapters=adapters, policies=policies)
