"""Policy bundle: round trip and every validation failure, each with one clear BundleError."""
from __future__ import annotations

import json
import pickle
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from serve_bridge.bundle import (HEADS_FILE, MANIFEST, MAX_JSON_DEPTH, MAX_MANIFEST_BYTES, AdapterEntry, BundleError,
                                 BundleWarning, adapter_fingerprint, config_fingerprint, file_sha256, load_bundle,
                                 write_bundle)
from serve_bridge.steptrim import K_LIMIT, LearnedPolicy, ProfiledPolicy, StepTrim

H = 16
SHA = "ab" * 32


def _entries() -> list[AdapterEntry]:
    w = np.linspace(-1, 1, H, dtype=np.float32)
    return [AdapterEntry("arith-a", SHA, "learned", tau=0.25, weight=w, bias=-0.5, lag=1,
                         stats={"val_skip": 0.4, "rule": "P50", "frontier": [{"param": 0.25, "skip": 0.4}]}),
            AdapterEntry("arith-b", SHA, "profiled", k=8, stats={"val_skip": 0.7}),
            AdapterEntry("arith-c", SHA, "none")]


def _write(tmp_path: Path) -> Path:
    return write_bundle(tmp_path / "bundle", backbone="smollm2", hidden_size=H,
                        config_fingerprint=config_fingerprint({"task": "arith", "seed": 0}), adapters=_entries())


def _edit_manifest(path: Path, **changes) -> None:
    m = json.loads((path / MANIFEST).read_text())
    m.update(changes)
    (path / MANIFEST).write_text(json.dumps(m))


def test_round_trip(tmp_path):
    path = _write(tmp_path)
    assert sorted(p.name for p in path.iterdir()) == [HEADS_FILE, MANIFEST]
    b = load_bundle(path, expected_hidden_size=H, expected_backbone="smollm2",
                    known_adapters=["arith-a", "arith-b", "arith-c"])
    learned, profiled = b.policies["arith-a"], b.policies["arith-b"]
    assert isinstance(learned, LearnedPolicy) and isinstance(profiled, ProfiledPolicy)
    assert torch.equal(learned.weight, torch.from_numpy(_entries()[0].weight))
    assert (learned.bias, learned.tau, learned.lag, profiled.k, b.policies["arith-c"]) == (-0.5, 0.25, 1, 8, None)
    assert b.adapters["arith-a"].stats["frontier"] == [{"param": 0.25, "skip": 0.4}]
    assert (b.schema_version, b.hidden_size, b.backbone) == (2, H, "smollm2")
    assert b.config_fingerprint == config_fingerprint({"seed": 0, "task": "arith"})  # key order ignored
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["files"] == {HEADS_FILE: file_sha256(path / HEADS_FILE)}
    assert manifest["adapters"][0]["head"] == {"weight": "arith-a.weight", "bias": "arith-a.bias"}


def test_tampered_head_is_rejected(tmp_path):
    path = _write(tmp_path)
    raw = bytearray((path / HEADS_FILE).read_bytes())
    raw[-3] ^= 0x01  # a bit of a tensor value
    (path / HEADS_FILE).write_bytes(bytes(raw))
    with pytest.raises(BundleError, match="heads.safetensors: sha256 does not match"):
        load_bundle(path)


@pytest.mark.parametrize("kwargs, message", [
    ({"expected_hidden_size": H + 1}, f"'hidden_size' is {H} but the served model has {H + 1}"),
    ({"expected_backbone": "llama3b"}, "'backbone' is 'smollm2' but the server runs 'llama3b'"),
    ({"known_adapters": ["arith-a", "arith-c"]}, "adapter 'arith-b' is not served here"),
])
def test_mismatch_with_the_server(tmp_path, kwargs, message):
    with pytest.raises(BundleError, match=message):
        load_bundle(_write(tmp_path), **kwargs)


def test_known_adapter_missing_from_bundle_runs_full_lora(tmp_path):
    with pytest.warns(BundleWarning, match="'arith-z' has no policy.*full LoRA"):
        b = load_bundle(_write(tmp_path), known_adapters=["arith-a", "arith-b", "arith-c", "arith-z"])
    assert b.policies["arith-z"] is None and "arith-z" not in b.adapters


def test_future_and_unknown_schema(tmp_path):
    path = _write(tmp_path)
    _edit_manifest(path, schema_version=3)
    with pytest.raises(BundleError, match="'schema_version' 3 was written by a newer LoRazor"):
        load_bundle(path)
    _edit_manifest(path, schema_version="1")
    with pytest.raises(BundleError, match="field 'schema_version' has type str"):
        load_bundle(path)


def _set_lag(path: Path, lag, version: int) -> None:
    m = json.loads((path / MANIFEST).read_text())
    m["schema_version"] = version
    for rec in m["adapters"]:
        if rec["policy"] == "learned":
            if lag is None:
                rec.pop("lag")
            else:
                rec["lag"] = lag
    (path / MANIFEST).write_text(json.dumps(m))


def test_schema_1_bundle_is_served_as_calibrated(tmp_path):
    """A bundle written before learned entries recorded their decision lag (schema 1, no 'lag') was
    priced with lag 0, and loads as lag 0; a schema 2 learned entry must name its lag."""
    path = _write(tmp_path)
    _set_lag(path, None, 1)
    assert load_bundle(path).policies["arith-a"].lag == 0
    _set_lag(path, 1, 1)
    with pytest.raises(BundleError, match="'lag' appears in a schema 1 manifest"):
        load_bundle(path)
    _set_lag(path, None, 2)
    with pytest.raises(BundleError, match="needs its 'lag'"):
        load_bundle(path)
    for bad in (-1, 9, 1.5, True, "1"):
        _set_lag(path, bad, 2)
        with pytest.raises(BundleError, match="'lag' must be an integer in 0…8"):
            load_bundle(path)
    m = json.loads((path / MANIFEST).read_text())
    m["adapters"][1]["lag"] = 1  # a profiled entry
    _set_lag(path, 0, 2)
    (path / MANIFEST).write_text(json.dumps({**m, "adapters": [json.loads((path / MANIFEST).read_text())["adapters"][0],
                                                               m["adapters"][1], m["adapters"][2]]}))
    with pytest.raises(BundleError, match="'tau', 'lag' and head tensors belong to learned policies only"):
        load_bundle(path)


def test_missing_files(tmp_path):
    path = _write(tmp_path)
    (path / HEADS_FILE).unlink()
    with pytest.raises(BundleError, match="heads.safetensors is missing"):
        load_bundle(path)
    (path / MANIFEST).unlink()
    with pytest.raises(BundleError, match="manifest.json not found"):
        load_bundle(path)


class _Boom:
    """Unpickling this creates a marker file: proof that a loader unpickled it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


@pytest.mark.parametrize("name", ["extra.pt", "heads.pkl", "weights.bin", "sub/model.safetensors"])
def test_smuggled_files_are_rejected_and_never_unpickled(tmp_path, name):
    path, marker = _write(tmp_path), tmp_path / "unpickled"
    (path / name).parent.mkdir(exist_ok=True)
    (path / name).write_bytes(pickle.dumps(_Boom(marker)))
    with pytest.raises(BundleError, match="not listed in .*manifest.json 'files'.*remove it"):
        load_bundle(path)
    m = json.loads((path / MANIFEST).read_text())  # even when listed with a correct hash
    _edit_manifest(path, files=m["files"] | {name: file_sha256(path / name)})
    with pytest.raises(BundleError, match="only plain .safetensors"):
        load_bundle(path)
    assert not marker.exists()


def test_inconsistent_entries_fail_at_write_and_leave_nothing(tmp_path):
    w = np.zeros(H, np.float32)
    bad = [(AdapterEntry("x", SHA, "learned", tau=0.1, weight=np.zeros(H + 1, np.float32), bias=0.0), "must be"),
           (AdapterEntry("x", SHA, "learned", weight=w, bias=0.0), "finite 'tau'"),
           (AdapterEntry("x", SHA, "profiled", k=-1), r"integer 'k' with 0 ≤ k < 2\*\*24"),
           (AdapterEntry("x", SHA, "none", k=3), "'k' belongs to profiled"),
           (AdapterEntry("x", SHA, "best"), "'policy' is 'best'"),
           (AdapterEntry("x", "abc", "none"), "64-hex sha256"),
           (AdapterEntry("x", SHA, "none", stats={"skip": float("nan")}), "plain JSON")]
    for entry, message in bad:
        with pytest.raises(BundleError, match=message):
            write_bundle(tmp_path / "b", backbone="m", hidden_size=H, config_fingerprint="c", adapters=[entry])
    assert list(tmp_path.iterdir()) == []  # no half-written bundle or scratch directory
    _write(tmp_path)
    with pytest.raises(BundleError, match="already exists and is not empty"):
        _write(tmp_path)


def test_adapter_fingerprint(tmp_path):
    (tmp_path / "ad").mkdir()
    (tmp_path / "ad" / "adapter_model.safetensors").write_bytes(b"weights")
    digest = file_sha256(tmp_path / "ad" / "adapter_model.safetensors")
    assert adapter_fingerprint(tmp_path / "ad") == digest
    assert adapter_fingerprint(tmp_path / "ad" / "adapter_model.safetensors") == digest
    with pytest.raises(BundleError, match="adapter weights .* not found"):
        adapter_fingerprint(tmp_path / "nope")


def test_load_time_is_printed(tmp_path):
    entries = [AdapterEntry(f"ad{i}", SHA, "learned", tau=0.1, weight=np.ones(4096, np.float32), bias=0.0)
               for i in range(32)]
    path = write_bundle(tmp_path / "big", backbone="m", hidden_size=4096, config_fingerprint="c", adapters=entries)
    start = time.perf_counter()
    b = load_bundle(path, expected_hidden_size=4096, known_adapters=[e.name for e in entries])
    ms = 1000 * (time.perf_counter() - start)
    print(f"\nload_bundle: 32 learned adapters, H=4096: {ms:.1f} ms")
    assert len(b.policies) == 32


@pytest.mark.parametrize("name", [MANIFEST, HEADS_FILE])
def test_symlinked_files_are_rejected(tmp_path, name):
    """A bundle file that links elsewhere (here: to a valid copy outside the bundle) is refused."""
    path = _write(tmp_path)
    outside = tmp_path / f"outside-{name}"
    (path / name).rename(outside)
    (path / name).symlink_to(outside)
    with pytest.raises(BundleError, match="symbolic link"):
        load_bundle(path)


def test_manifest_size_and_nesting_are_bounded(tmp_path):
    path = _write(tmp_path)
    m = json.loads((path / MANIFEST).read_text())
    (path / MANIFEST).write_text(json.dumps(m | {"pad": "x" * MAX_MANIFEST_BYTES}))
    with pytest.raises(BundleError, match="more than the"):
        load_bundle(path)
    for depth, message in ((100_000, "nested too deeply"), (MAX_JSON_DEPTH + 1, "deeper than")):
        (path / MANIFEST).write_text(json.dumps(m)[:-1] + ', "deep": ' + "[" * depth + "]" * depth + "}")
        with pytest.raises(BundleError, match=message):
            load_bundle(path)
    (path / MANIFEST).write_text(json.dumps(m).replace(f'"hidden_size": {H}', '"hidden_size": ' + "1" * 5000))
    with pytest.raises(BundleError, match="not valid JSON"):
        load_bundle(path)


def test_bf16_head_is_a_bundle_error(tmp_path):
    from safetensors.torch import save

    path = _write(tmp_path)
    data = save({"arith-a.weight": torch.zeros(H, dtype=torch.bfloat16),
                 "arith-a.bias": torch.zeros((), dtype=torch.bfloat16)})
    (path / HEADS_FILE).write_bytes(data)
    _edit_manifest(path, files={HEADS_FILE: file_sha256(path / HEADS_FILE)})
    with pytest.raises(BundleError, match="tensor 'arith-a.(weight|bias)' is BF16, expected F32"):
        load_bundle(path)


@pytest.mark.parametrize("k, ok", [(K_LIMIT - 1, True), (K_LIMIT, False), (10**30, False)])
def test_profiled_k_is_checked_as_the_runtime_checks_it(tmp_path, k, ok):
    path = _write(tmp_path)
    m = json.loads((path / MANIFEST).read_text())
    m["adapters"][1]["k"] = k
    (path / MANIFEST).write_text(json.dumps(m))
    if ok:
        b = load_bundle(path)
        StepTrim([b.policies[n] for n in sorted(b.policies)], H)  # the runtime accepts what loads
    else:
        with pytest.raises(BundleError, match="0 ≤ k < 2"):
            load_bundle(path)
        with pytest.raises(ValueError):  # what the runtime would have raised, unexplained, at start-up
            StepTrim([ProfiledPolicy(k)], H)
