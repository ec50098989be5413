"""Atomic stage commits (calibrate/rundir.py) and verified labeling shards under injected faults:
a stage that fails, or a process killed at any rename of a publish, leaves either the previous
complete state or the new one once the next run recovers — never outputs that disagree with
their marker — and a damaged output is never trusted."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from calibrate.rundir import CONFIG_CHANGED, NOT_RUN, RunDir
from labeling.labels import ShardStats, _shard_stale, _write_shard
from tests.robustness.helpers import digest

OLD = {"bundle/manifest.json": "old manifest", "bundle/heads.safetensors": "old heads",
       "plots/frontier_a.png": "old a", "plots/frontier_b.png": "old b"}
NEW = {"bundle/manifest.json": "new manifest", "bundle/heads.safetensors": "new heads",
       "plots/frontier_a.png": "new a", "plots/release_hist_a.png": "new hist"}
UNRELATED = {"plots/positive_rate_per_t.png": "labels plot", "labels/points.parquet": "points"}


class Killed(BaseException):
    """Stands in for SIGKILL: not an Exception, so nothing on the way catches it."""


def _stage(run: RunDir, files: dict[str, str], fp: str, summary: dict | None = None) -> None:
    run.begin("export")
    for rel, text in files.items():
        run.out(*rel.split("/")).write_text(text)
    run.commit("export", fp, summary or {"fp": fp})


def _state(root: Path) -> dict[str, str]:
    return {rel: (root / rel).read_text() for rel in digest(root) if not rel.startswith("stages/")}


def _base(tmp_path: Path, with_old: bool) -> RunDir:
    run = RunDir(tmp_path / "run")
    for rel, text in UNRELATED.items():
        run.path(*rel.split("/")).write_text(text)
    if with_old:
        _stage(run, OLD, "fp-old")
    return run


def _renames_in_commit(tmp_path: Path, with_old: bool) -> int:
    """How many os.rename/os.replace calls one commit makes (counted on a scratch copy)."""
    run = _base(tmp_path / "count", with_old)
    calls = []
    real_rename, real_replace = os.rename, os.replace
    os.rename = lambda *a: (calls.append(a), real_rename(*a))[1]  # type: ignore[assignment]
    os.replace = lambda *a: (calls.append(a), real_replace(*a))[1]  # type: ignore[assignment]
    try:
        _stage(run, NEW, "fp-new")
    finally:
        os.rename, os.replace = real_rename, real_replace
    return len(calls)


STATS = ShardStats(requests=1, points=2, on_tokens=3, off_branches=1, off_tokens=2, seconds=0.5)

RENAMES = {True: 10, False: 7}  # renames of a commit replacing OLD by NEW, and of a first commit of NEW


@pytest.mark.parametrize("with_old,kill_at", [(w, k) for w, n in RENAMES.items() for k in range(n)])
def test_kill_at_every_rename_of_a_publish(tmp_path: Path, monkeypatch, with_old: bool, kill_at: int) -> None:
    assert _renames_in_commit(tmp_path, with_old) == RENAMES[with_old]
    run = _base(tmp_path, with_old)
    old_state = _state(run.root)
    calls = [0]

    def counted(real):
        def f(*args):
            if calls[0] == kill_at:
                raise Killed
            calls[0] += 1
            return real(*args)
        return f

    monkeypatch.setattr(os, "rename", counted(os.rename))
    monkeypatch.setattr(os, "replace", counted(os.replace))
    with pytest.raises(Killed):
        _stage(run, NEW, "fp-new")
    monkeypatch.undo()
    fresh = RunDir(run.root)  # the next run
    fresh.recover()
    state = _state(fresh.root)
    new_state = {**UNRELATED, **NEW}
    assert state in (old_state, new_state), state
    assert not any((fresh.root / d).exists() for d in (".scratch", ".publishing", ".trash"))
    if state == new_state:
        assert fresh.done("export", "fp-new") and fresh.summary("export") == {"fp": "fp-new"}
    elif with_old:
        assert fresh.done("export", "fp-old") and fresh.summary("export") == {"fp": "fp-old"}
    else:
        assert fresh.stale("export", "fp-new") == NOT_RUN


def test_failed_stage_leaves_the_previous_outputs(tmp_path: Path) -> None:
    run = _base(tmp_path, with_old=True)
    before = digest(run.root)
    run.begin("export")
    run.out("bundle", "manifest.json").write_text("half")
    run.discard("export")  # what run_pipeline does when the stage raises
    assert digest(run.root) == before and run.done("export", "fp-old")


def test_scratch_left_by_a_killed_stage_is_dropped(tmp_path: Path) -> None:
    run = _base(tmp_path, with_old=True)
    before = digest(run.root)
    run.begin("export")
    run.out("bundle", "manifest.json").write_text("half")  # killed here: no discard
    RunDir(run.root).recover()
    assert digest(run.root) == before


def test_replacing_commit_removes_entries_the_new_outputs_lack(tmp_path: Path) -> None:
    run = _base(tmp_path, with_old=True)
    _stage(run, NEW, "fp-new")
    assert not (run.root / "plots" / "frontier_b.png").exists()
    assert (run.root / "plots" / "positive_rate_per_t.png").read_text() == "labels plot"


DAMAGE = {  # name: (damage, expected reason fragment)
    "truncated_output": (lambda r: (r / "bundle" / "heads.safetensors").write_text("new he"), "differs"),
    "deleted_output": (lambda r: (r / "bundle" / "manifest.json").unlink(), "is missing"),
    "deleted_dir": (lambda r: [p.unlink() for p in (r / "bundle").iterdir()], "is missing"),
    "same_size_edit": (lambda r: (r / "plots" / "frontier_a.png").write_text("new b"), "differs"),
    "marker_truncated": (lambda r: (r / "stages" / "export.json").write_text('{"fingerprint": "fp'), "unreadable"),
    "marker_not_utf8": (lambda r: (r / "stages" / "export.json").write_bytes(b"\xff\xfe"), "unreadable"),
    "marker_old_format": (lambda r: (r / "stages" / "export.json").write_text(
        json.dumps({"fingerprint": "fp-new", "summary": {}})), "records no output hashes"),
    "marker_deleted": (lambda r: (r / "stages" / "export.json").unlink(), NOT_RUN),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damaged_output_is_not_trusted(tmp_path: Path, case: str) -> None:
    run = _base(tmp_path, with_old=False)
    _stage(run, NEW, "fp-new")
    damage, fragment = DAMAGE[case]
    damage(run.root)
    reason = run.stale("export", "fp-new")
    assert reason is not None and fragment in reason, reason
    _stage(run, NEW, "fp-new")  # recomputing restores a consistent, verified state
    assert run.done("export", "fp-new") and _state(run.root) == {**UNRELATED, **NEW}


def test_changed_config_and_changed_input_stage(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    run.begin("sweep")
    run.out("sweep", "candidates.csv").write_text("a,b\n1,2\n")
    run.commit("sweep", "fp-sweep", {})
    run.begin("export")
    run.out("bundle", "manifest.json").write_text("{}")
    run.commit("export", "fp-export", {}, inputs=["sweep"])
    assert run.done("export", "fp-export", ["sweep"])
    assert run.stale("export", "fp-other", ["sweep"]) == CONFIG_CHANGED
    run.begin("sweep")
    run.out("sweep", "candidates.csv").write_text("a,b\n1,3\n")
    run.commit("sweep", "fp-sweep", {})
    assert "the output of stage 'sweep' changed" in run.stale("export", "fp-export", ["sweep"])


# --- labeling shards ----------------------------------------------------------------------

def _shard(tmp_path: Path) -> tuple[Path, dict[str, Path]]:
    files = {"points": tmp_path / "00000.parquet", "features": tmp_path / "00000.npy"}
    df = pd.DataFrame({"uid": ["a", "b"], "t": [0, 1], "y": [1, 0]})
    _write_shard(tmp_path / "00000.done", files, df, np.arange(8, dtype=np.float32).reshape(2, 4), STATS)
    return tmp_path / "00000.done", files


SHARD_DAMAGE = {
    "truncated_parquet": (lambda d, f: f["points"].write_bytes(f["points"].read_bytes()[:40]), "differs"),
    "truncated_npy": (lambda d, f: f["features"].write_bytes(f["features"].read_bytes()[:-4]), "differs"),
    "missing_npy": (lambda d, f: f["features"].unlink(), "differs"),
    "marker_garbage": (lambda d, f: d.write_text("3"), "unreadable"),
    "marker_missing": (lambda d, f: d.unlink(), "not labeled yet"),
}


@pytest.mark.parametrize("case", sorted(SHARD_DAMAGE))
def test_damaged_shard_is_labeled_again(tmp_path: Path, case: str) -> None:
    done, files = _shard(tmp_path)
    assert _shard_stale(done, files) is None
    damage, fragment = SHARD_DAMAGE[case]
    damage(done, files)
    reason = _shard_stale(done, files)
    assert reason is not None and fragment in reason, reason


def test_shard_killed_before_its_marker_is_not_reused(tmp_path: Path, monkeypatch) -> None:
    done, files = _shard(tmp_path)
    import labeling.labels as labels

    def killed(*args, **kwargs):
        raise Killed

    monkeypatch.setattr(labels, "write_atomic", killed)
    with pytest.raises(Killed):
        _write_shard(done, files, pd.DataFrame({"uid": ["c"], "t": [2], "y": [1]}), np.zeros((1, 4), np.float32),
                     STATS)
    assert _shard_stale(done, files) == "not labeled yet"


def test_intact_ignores_the_config_but_not_damage(tmp_path: Path) -> None:
    run = _base(tmp_path, with_old=False)
    assert run.intact("export") == NOT_RUN
    _stage(run, NEW, "fp-new")
    assert run.intact("export") is None  # whatever config the caller has now
    (run.root / "bundle" / "manifest.json").write_text("edited")
    assert "bundle/manifest.json differs" in run.intact("export")
