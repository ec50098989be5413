"""Policy bundle I/O — the contract between calibration and production servers (docs/design.md §5).

A bundle is a directory holding exactly:

- ``manifest.json``: ``schema_version`` (:data:`SCHEMA_VERSION`), ``toolkit_version``,
  ``backbone`` id, ``hidden_size``, ``config_fingerprint``; ``adapters``: one object per
  adapter with ``name``, ``weights_sha256`` (sha256 of its safetensors file, see
  :func:`adapter_fingerprint`), ``policy`` (``learned`` | ``profiled`` | ``none``), ``tau``
  and ``lag`` (learned only: the decision lag calibration priced, see
  :class:`serve_bridge.steptrim.LearnedPolicy`), ``k`` (profiled only), ``head``
  (``{"weight": name, "bias": name}`` tensor names in the heads file, learned only) and
  ``stats`` (calibration numbers, JSON);
  ``files``: ``{file name: sha256}`` for every other file of the bundle.
- ``heads.safetensors``: ``<adapter>.weight`` [H] float32 and ``<adapter>.bias`` [] float32
  for each learned adapter.

:func:`load_bundle` validates everything and raises one :class:`BundleError` on the first
problem. The bundle holds regular files only (a symlink, a directory or any other entry is an
error); the manifest is at most :data:`MAX_MANIFEST_BYTES`, strict JSON (no NaN/Infinity, no
duplicate keys or lone surrogates, at most :data:`MAX_JSON_DEPTH` levels); ``files`` lists
exactly ``heads.safetensors``, which is read once, hashed and parsed from the same bytes, so no
file is accepted without being parsed as what it is. Tensors are read only through
``safetensors.numpy`` after their header says float32, never unpickled: a file the manifest
does not list, or any other file, is an error. A learned adapter's ``head`` names its own
tensors (:func:`head_tensor_names`); an adapter of another policy has none. Every value the serving runtime would refuse is refused here (a profiled
``k`` ≥ :data:`serve_bridge.steptrim.K_LIMIT`, a ``tau`` or head value that is not a finite
float32, a hidden size outside 1…:data:`MAX_HIDDEN_SIZE`). An adapter the server serves but
the bundle lacks is not an error: it runs full LoRA (docs/design.md §2) and a :class:`BundleWarning`
says so.

Nothing in the manifest is covered by its own hashes, so a bundle is pinned as a whole:
:func:`bundle_digest` is a sha256 over every file of the bundle, the manifest included, computed
by :func:`load_bundle` from the very bytes it parsed (:attr:`Bundle.digest`).

This module imports no vLLM and nothing from the calibration packages.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import stat
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.numpy import load, save_file

from serve_bridge.command_line import one_line
from serve_bridge.safe_write import scratch_dir_for
from serve_bridge.steptrim import K_LIMIT, MAX_LAG, LearnedPolicy, Policy, ProfiledPolicy
from serve_bridge.strict_json import MAX_JSON_DEPTH, StrictJSONError, loads_strict, short_repr  # noqa: F401 (MAX_JSON_DEPTH: part of this API)

SCHEMA_VERSION = 2  # 2: learned entries record their decision lag; a schema 1 bundle's learned policies have lag 0
SCHEMA_VERSIONS = (1, 2)  # read
TOOLKIT_VERSION = "0.1.0"
MANIFEST = "manifest.json"
HEADS_FILE = "heads.safetensors"
POLICY_KINDS = ("learned", "profiled", "none")
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"  # peft's file name inside an adapter dir
MAX_MANIFEST_BYTES = 8 << 20
MAX_FILE_BYTES = 1 << 30  # any other bundle file (heads: 4 bytes per adapter and hidden unit)
MAX_HIDDEN_SIZE = 1 << 20
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_FLOAT32_MAX = float(np.finfo(np.float32).max)


class BundleError(ValueError):
    """A bundle that cannot be written or loaded; the message (one line: a line break in a path is
    escaped) names the file, field and fix."""

    def __init__(self, message: str) -> None:
        super().__init__(one_line(message))


class BundleWarning(UserWarning):
    """A served adapter without a policy in the bundle (it runs full LoRA)."""


@dataclass(frozen=True)
class AdapterEntry:
    """One adapter of a bundle.

    name: the adapter name as the server knows it.
    weights_sha256: sha256 of the adapter's safetensors file (:func:`adapter_fingerprint`).
    policy: ``learned`` (head + tau), ``profiled`` (k) or ``none`` (never released).
    tau: release threshold of a learned policy (s_t < tau ⇒ release), else None.
    lag: a learned policy's decision lag (release at the first t with s_t < tau, plus lag), else None.
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
    lag: int | None = None

    def to_policy(self) -> Policy:
        """The StepTrim policy object (None for ``none``: never released)."""
        if self.policy == "learned":
            return LearnedPolicy(torch.from_numpy(np.asarray(self.weight, np.float32)), float(self.bias),
                                 float(self.tau), int(self.lag or 0))
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
    digest: str = ""  # :func:`bundle_digest`, of the bytes this load read


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _digest(files: Mapping[str, bytes]) -> str:
    """sha256 over each file's name and sha256, in name order."""
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(f"{name}\0{hashlib.sha256(files[name]).hexdigest()}\n".encode())
    return h.hexdigest()


def bundle_digest(directory: str | Path) -> str:
    """The digest that pins a bundle: sha256 over the name and sha256 of every file of the bundle,
    ``manifest.json`` included, of a bundle that loads (:func:`load_bundle`). The export stage
    prints it; a server given it (``LORAZOR_BUNDLE_DIGEST``) serves no other bundle."""
    return load_bundle(directory).digest


def adapter_weights_file(path: str | Path) -> Path:
    """An adapter's weights file: ``path`` itself, or the peft directory's :data:`ADAPTER_WEIGHTS_FILE`."""
    p = Path(path)
    return p / ADAPTER_WEIGHTS_FILE if p.is_dir() else p


def adapter_fingerprint(path: str | Path) -> str:
    """sha256 of an adapter's weights: ``path`` is its safetensors file or its peft directory."""
    p = adapter_weights_file(path)
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


def _finite_float32(value: Any) -> bool:
    """A real number (not bool) whose float32 value is finite."""
    if not isinstance(value, (int, float, np.floating, np.integer)) or isinstance(value, (bool, np.bool_)):
        return False
    try:
        return math.isfinite(float(value)) and abs(float(value)) <= _FLOAT32_MAX
    except OverflowError:
        return False


def _check_entry(e: AdapterEntry, hidden_size: int, where: str) -> None:
    """Raise BundleError if an entry is inconsistent; ``where`` names the file and field."""
    if not isinstance(e.name, str) or not e.name:
        raise BundleError(f"{where}: 'name' must be a non-empty string.")
    if not isinstance(e.weights_sha256, str) or not _SHA256_RE.fullmatch(e.weights_sha256):
        raise BundleError(f"{where}: 'weights_sha256' must be a 64-hex sha256 (use adapter_fingerprint()).")
    if e.policy not in POLICY_KINDS:
        raise BundleError(f"{where}: 'policy' is {e.policy!r}; use one of {', '.join(POLICY_KINDS)}.")
    if e.policy == "learned":
        if not _finite_float32(e.tau):
            raise BundleError(f"{where}: a learned policy needs a finite 'tau' within float32's range, "
                              f"got {short_repr(e.tau)}.")
        if e.weight is None or e.bias is None:
            raise BundleError(f"{where}: a learned policy needs head tensors (weight [H], bias []).")
        if tuple(np.shape(e.weight)) != (hidden_size,) or np.ndim(e.bias) != 0:
            raise BundleError(f"{where}: head weight shape {tuple(np.shape(e.weight))} and bias shape "
                              f"{tuple(np.shape(e.bias))} must be ({hidden_size},) and () — the head was "
                              f"fitted on another backbone; re-run calibration for this backbone.")
        w, b = np.asarray(e.weight), np.asarray(e.bias)
        if w.dtype.kind not in "fiu" or b.dtype.kind not in "fiu" or not _finite_float32(b.item()) \
                or not (np.isfinite(w).all() and (np.abs(w) <= _FLOAT32_MAX).all()):
            raise BundleError(f"{where}: head tensors must hold finite float32 values; re-fit the head.")
        if e.lag is not None and (not isinstance(e.lag, int) or isinstance(e.lag, bool) or not 0 <= e.lag <= MAX_LAG):
            raise BundleError(f"{where}: 'lag' must be an integer in 0…{MAX_LAG} (the decision lag calibration "
                              f"priced), got {short_repr(e.lag)}; re-export the bundle.")
    elif e.tau is not None or e.weight is not None or e.bias is not None or e.lag is not None:
        raise BundleError(f"{where}: 'tau', 'lag' and head tensors belong to learned policies only "
                          f"(policy is {e.policy!r}).")
    if e.policy == "profiled":
        if not isinstance(e.k, int) or isinstance(e.k, bool) or not 0 <= e.k < K_LIMIT:
            raise BundleError(f"{where}: a profiled policy needs an integer 'k' with 0 ≤ k < 2**24, got "
                              f"{short_repr(e.k)} (no response has 2**24 forwards: use policy 'none' to never release).")
    elif e.k is not None:
        raise BundleError(f"{where}: 'k' belongs to profiled policies only (policy is {e.policy!r}).")


def _check_hidden_size(hidden_size: Any, where: str) -> None:
    if not isinstance(hidden_size, int) or isinstance(hidden_size, bool) or not 1 <= hidden_size <= MAX_HIDDEN_SIZE:
        raise BundleError(f"{where}: 'hidden_size' must be an integer in 1..{MAX_HIDDEN_SIZE}, got "
                          f"{short_repr(hidden_size)}.")


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
    _check_hidden_size(hidden_size, f"bundle {out}")
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
                        "tau": None if e.tau is None else float(e.tau),
                        "lag": int(e.lag or 0) if e.policy == "learned" else None, "k": e.k, "head": head,
                        "stats": e.stats})
    scratch = scratch_dir_for(out)
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


def _strict_json(data: bytes, what: str) -> Any:
    """``data`` parsed as strict JSON (UTF-8, :func:`serve_bridge.strict_json.loads_strict`)."""
    try:
        return loads_strict(data.decode("utf-8"))
    except (UnicodeDecodeError, StrictJSONError) as err:
        raise BundleError(f"{what} is not valid JSON ({str(err)[:200]}); re-export the bundle.") from None


def _read_regular(path: Path, limit: int) -> bytes:
    """The bytes of ``path``, which must be a regular file (not a symlink) of at most ``limit`` bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise BundleError(f"{path} is missing; copy the whole bundle directory or re-export it.") from None
    except OSError as err:
        if os.path.islink(path):
            raise BundleError(f"{path} is a symbolic link; a bundle holds regular files only. Copy the "
                              f"bundle with its files, not links.") from None
        raise BundleError(f"{path} cannot be read ({err.strerror}).") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise BundleError(f"{path} is not a regular file; a bundle holds regular files only.")
        if info.st_size > limit:
            raise BundleError(f"{path} has {info.st_size} bytes, more than the {limit} a bundle allows; "
                              f"it is not a bundle written by LoRazor.")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise BundleError(f"{path} grew past {limit} bytes while being read.")
    return data


def _read_files(root: Path, files: Mapping[str, Any]) -> dict[str, bytes]:
    """Bytes of every listed file, each checked against its sha256; nothing else may be in the bundle."""
    where = f"{root / MANIFEST}"
    for name, digest in files.items():
        if not isinstance(name, str) or "\x00" in name or Path(name).name != name or not name.endswith(".safetensors"):
            raise BundleError(f"{where}: 'files' lists {short_repr(name)}; a bundle holds only plain "
                              f".safetensors file names. Re-export the bundle.")
        if name != HEADS_FILE:  # every file a bundle may hold is parsed as what it is: schema 1 has one
            raise BundleError(f"{where}: 'files' lists {short_repr(name)}; a bundle holds only {HEADS_FILE} "
                              f"besides the manifest. Remove it and re-export the bundle.")
        if not isinstance(digest, str) or not _SHA256_RE.fullmatch(digest):
            raise BundleError(f"{where}: 'files' gives {short_repr(digest)} for {name}; expected a 64-hex sha256. "
                              f"Re-export the bundle.")
    with os.scandir(root) as it:
        entries = sorted(it, key=lambda e: e.name)
    for entry in entries:
        if entry.name != MANIFEST and entry.name not in files:
            raise BundleError(f"{root / entry.name}: not listed in {where} 'files'. A bundle holds only "
                              f"manifest.json and the listed .safetensors files (never pickles); remove it.")
        if not entry.is_file(follow_symlinks=False):
            kind = "a symbolic link" if entry.is_symlink() else "not a regular file"
            raise BundleError(f"{root / entry.name} is {kind}; a bundle holds regular files only. Copy the "
                              f"bundle with its files.")
    out = {}
    for name, digest in files.items():
        data = _read_regular(root / name, MAX_FILE_BYTES)
        if hashlib.sha256(data).hexdigest() != digest:
            raise BundleError(f"{root / name}: sha256 does not match {where} 'files' — the file was modified "
                              f"or corrupted. Re-copy the bundle from its source; do not edit it.")
        out[name] = data
    return out


def _load_heads(data: bytes, path: Path) -> dict[str, np.ndarray]:
    """The float32 tensors of a heads file; any other dtype or a malformed file is a BundleError."""
    n = int.from_bytes(data[:8], "little") if len(data) >= 8 else -1
    if not 0 < n <= len(data) - 8:
        raise BundleError(f"{path} is not a valid safetensors file (bad header length); re-export.")
    header = _strict_json(data[8:8 + n], f"{path} header")
    if not isinstance(header, dict):
        raise BundleError(f"{path} is not a valid safetensors file (header is not an object); re-export.")
    for name, info in header.items():
        if name != "__metadata__" and (not isinstance(info, dict) or info.get("dtype") != "F32"):
            dtype = info.get("dtype") if isinstance(info, dict) else None
            raise BundleError(f"{path}: tensor {short_repr(name)} is {str(dtype)[:20]}, expected F32 (float32); "
                              f"re-export the bundle.")
    try:
        return load(data)
    except (SafetensorError, ValueError, TypeError, OverflowError) as err:
        raise BundleError(f"{path} is not a valid safetensors file ({str(err)[:200]}); re-export.") from None


def _entry(rec: Any, i: int, heads: Mapping[str, np.ndarray], hidden_size: int, root: Path,
           version: int) -> AdapterEntry:
    where = f"{root / MANIFEST} adapters[{i}]"
    if not isinstance(rec, dict):
        raise BundleError(f"{where}: expected an object; re-export the bundle.")
    name = _field(rec, "name", str, where)
    where = f"{root / MANIFEST} adapter {short_repr(name)}"
    policy = _field(rec, "policy", str, where)
    weight = bias = None
    if policy != "learned" and rec.get("head") is not None:
        raise BundleError(f"{where}: a {short_repr(policy)} adapter has a 'head'; heads belong to learned policies "
                          f"only (the runtime would never read it). Re-export the bundle.")
    if policy == "learned":
        head = _field(rec, "head", dict, where)
        names = (head.get("weight"), head.get("bias"))
        if names != head_tensor_names(name):
            raise BundleError(f"{where}: head tensors {short_repr(list(names))} are not the adapter's own "
                              f"{list(head_tensor_names(name))} (the runtime would score it with another head); "
                              f"re-export the bundle.")
        for n in names:
            if not isinstance(n, str) or n not in heads:
                raise BundleError(f"{where}: head tensor {short_repr(n)} is not in {root / HEADS_FILE}; re-export.")
            if heads[n].dtype != np.float32:
                raise BundleError(f"{root / HEADS_FILE}: tensor {n!r} is {heads[n].dtype}, expected float32.")
        weight, bias = heads[names[0]], heads[names[1]]
    lag = rec.get("lag")
    if version == 1 and lag is not None:
        raise BundleError(f"{where}: 'lag' appears in a schema 1 manifest, which has none; re-export the bundle.")
    if version > 1 and policy == "learned" and lag is None:
        raise BundleError(f"{where}: a learned policy of a schema {version} manifest needs its 'lag'; re-export the "
                          f"bundle.")
    entry = AdapterEntry(name=name, weights_sha256=_field(rec, "weights_sha256", str, where), policy=policy,
                         tau=rec.get("tau"), k=rec.get("k"), weight=weight, bias=bias,
                         stats=_field(rec, "stats", dict, where),
                         lag=0 if version == 1 and policy == "learned" else lag)
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
    if not root.is_dir() or not os.path.lexists(mpath):
        raise BundleError(f"{mpath} not found: {root} is not a policy bundle. Point the server at the "
                          f"directory written by the calibration export stage.")
    raw = _read_regular(mpath, MAX_MANIFEST_BYTES)
    manifest = _strict_json(raw, str(mpath))
    if not isinstance(manifest, dict):
        raise BundleError(f"{mpath}: expected a JSON object; re-export the bundle.")
    where = str(mpath)
    version = _field(manifest, "schema_version", int, where)
    if version > SCHEMA_VERSION:
        raise BundleError(f"{where}: 'schema_version' {short_repr(version)} was written by a newer LoRazor (this "
                          f"one reads {' and '.join(map(str, SCHEMA_VERSIONS))}); upgrade LoRazor on the server.")
    if version not in SCHEMA_VERSIONS:
        raise BundleError(f"{where}: 'schema_version' {short_repr(version)} is unknown (this LoRazor reads "
                          f"{' and '.join(map(str, SCHEMA_VERSIONS))}); re-export the bundle.")
    files = _field(manifest, "files", dict, where)
    data = _read_files(root, files)
    hidden_size = _field(manifest, "hidden_size", int, where)
    _check_hidden_size(hidden_size, where)
    if expected_hidden_size is not None and hidden_size != expected_hidden_size:
        raise BundleError(f"{where}: 'hidden_size' is {hidden_size} but the served model has "
                          f"{expected_hidden_size}: this bundle was calibrated for another backbone.")
    backbone = _field(manifest, "backbone", str, where)
    if expected_backbone is not None and backbone != expected_backbone:
        raise BundleError(f"{where}: 'backbone' is {backbone!r} but the server runs {expected_backbone!r}; "
                          f"use the bundle calibrated for this backbone.")
    if HEADS_FILE not in files:
        raise BundleError(f"{where}: 'files' does not list {HEADS_FILE}; re-export the bundle.")
    heads = _load_heads(data[HEADS_FILE], root / HEADS_FILE)
    records = _field(manifest, "adapters", list, where)
    adapters: dict[str, AdapterEntry] = {}
    for i, rec in enumerate(records):
        e = _entry(rec, i, heads, hidden_size, root, version)
        if e.name in adapters:
            raise BundleError(f"{where}: adapter '{e.name}' appears twice in 'adapters'; re-export.")
        adapters[e.name] = e
    used = {n for rec in records if rec["policy"] == "learned" for n in (rec["head"]["weight"], rec["head"]["bias"])}
    if set(heads) - used:
        raise BundleError(f"{root / HEADS_FILE}: tensor {short_repr(sorted(set(heads) - used)[0])} belongs to no "
                          f"learned adapter of {where}; re-export the bundle.")
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
                  adapters=adapters, policies=policies, digest=_digest({MANIFEST: raw, **data}))
