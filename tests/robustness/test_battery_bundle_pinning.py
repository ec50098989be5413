"""Bundle pinning: the export prints the bundle's digest (serve_bridge.bundle.bundle_digest: every
file, the manifest included), and a server given it in ``LORAZOR_BUNDLE_DIGEST`` serves that bundle
and refuses any other in one line, an edited manifest included (the manifest's own hashes cover
only the other files). The new names are imported inside the tests, so each case fails on its own
where they are missing."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from benchmarks.robustness.kill_resume import KILL_CONFIG
from calibrate.pipeline import format_final
from serve_bridge.bundle import AdapterEntry, BundleError, write_bundle
from tests.calibrate.test_pipeline import run

H = 8


def _bundle(path: Path) -> Path:
    entries = [AdapterEntry("p", "0" * 64, "profiled", k=3, stats={"val_skip": 0.25}),
               AdapterEntry("l", "1" * 64, "learned", tau=0.5, weight=np.ones(H, np.float32), bias=0.0)]
    return write_bundle(path, backbone="m", hidden_size=H, config_fingerprint="c", adapters=entries)


def _edit_manifest(bundle: Path, edit) -> None:
    manifest = json.loads((bundle / "manifest.json").read_text())
    edit({a["name"]: a for a in manifest["adapters"]})
    (bundle / "manifest.json").write_text(json.dumps(manifest, indent=1))  # write_bundle indents by 2


EDITS = {  # an edit of manifest.json that still loads: nothing else notices it
    "learned_threshold": lambda a: a["l"].update(tau=-3.0),
    "profiled_release_point": lambda a: a["p"].update(k=0),
    "stats": lambda a: a["p"]["stats"].update(val_skip=0.9),
    "layout_only": lambda a: None,  # the same JSON, written with other white space
}


@pytest.mark.parametrize("case", sorted(EDITS))
def test_a_pinned_server_refuses_an_edited_manifest(tmp_path: Path, case: str) -> None:
    from serve_bridge.bundle import bundle_digest, load_bundle
    from serve_bridge.runtime import load_served_bundle

    bundle = _bundle(tmp_path / "bundle")
    pinned = bundle_digest(bundle)
    _edit_manifest(bundle, EDITS[case])
    load_bundle(bundle)  # the edit loads: the manifest's hashes cover the heads file only
    assert bundle_digest(bundle) != pinned
    with pytest.raises(BundleError, match=f"has digest {bundle_digest(bundle)}, not the pinned {pinned} "
                                          f"\\(LORAZOR_BUNDLE_DIGEST\\)") as info:
        load_served_bundle(bundle, H, digest=pinned)
    assert "\n" not in str(info.value)


def test_the_pinned_bundle_is_served_wherever_it_lies(tmp_path: Path) -> None:
    from serve_bridge.bundle import bundle_digest
    from serve_bridge.runtime import build_runtime, load_served_bundle

    bundle = _bundle(tmp_path / "bundle")
    copy = Path(shutil.copytree(bundle, tmp_path / "elsewhere" / "bundle"))
    pinned = bundle_digest(bundle)
    assert bundle_digest(copy) == pinned  # the digest is of the files, not of where they lie
    served, _ = load_served_bundle(copy, H, digest=pinned)
    assert served.digest == pinned
    assert sorted(build_runtime(copy, H, "cpu", digest=pinned).slot_of) == ["l", "p"]
    with pytest.raises(BundleError, match="not the pinned"):
        build_runtime(copy, H, "cpu", digest="0" * 64)


DIGEST_SETTINGS = {  # name: (environment, message fragment; None: accepted)
    "not_hex": ({"LORAZOR_BUNDLE": "/b", "LORAZOR_BUNDLE_DIGEST": "xyz"}, "LORAZOR_BUNDLE_DIGEST='xyz': give"),
    "one_digit_short": ({"LORAZOR_BUNDLE": "/b", "LORAZOR_BUNDLE_DIGEST": "a" * 63}, "give the bundle's 64-hex"),
    "without_a_bundle": ({"LORAZOR_BUNDLE_DIGEST": "a" * 64}, "LORAZOR_BUNDLE_DIGEST is set but LORAZOR_BUNDLE is not"),
    "in_calibration_mode": ({"LORAZOR_CALIBRATION": "1", "LORAZOR_BUNDLE_DIGEST": "a" * 64},
                            "LORAZOR_BUNDLE_DIGEST is set but LORAZOR_BUNDLE is not"),
}


@pytest.mark.parametrize("case", sorted(DIGEST_SETTINGS))
def test_a_digest_setting_the_server_cannot_use_is_one_line(case: str) -> None:
    from serve_bridge.vllm.settings import BridgeError, BridgeSettings

    env, fragment = DIGEST_SETTINGS[case]
    with pytest.raises(BridgeError) as info:
        BridgeSettings.from_env(env)
    assert fragment in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_the_digest_setting_is_read_with_the_bundle() -> None:
    from serve_bridge.vllm.settings import BridgeSettings

    settings = BridgeSettings.from_env({"LORAZOR_BUNDLE": "/b", "LORAZOR_BUNDLE_DIGEST": f" {'AB' * 32} "})
    assert settings.bundle_digest == "ab" * 32
    assert BridgeSettings.from_env({"LORAZOR_BUNDLE": "/b"}).bundle_digest is None


def test_the_export_prints_the_digest(tmp_path: Path, small_run, capsys) -> None:
    from serve_bridge.bundle import bundle_digest

    run_dir = Path(shutil.copytree(small_run[0], tmp_path / "run"))
    (run_dir / "stages" / "export.json").unlink()
    summaries = run(run_dir, [*KILL_CONFIG, "stages=[export]"])
    digest = bundle_digest(run_dir / "bundle")
    assert f"digest {digest}" in capsys.readouterr().out
    assert summaries["export"]["bundle_digest"] == digest
    assert f"bundle digest (LORAZOR_BUNDLE_DIGEST): {digest}" in format_final(summaries)
