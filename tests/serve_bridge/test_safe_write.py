"""Publishing files and directories under a run or a cache (serve_bridge/safe_write.py) and its users
that write shards and conversions: a whole result or none, and never through a planted link."""
from __future__ import annotations

import multiprocessing
from dataclasses import fields
from pathlib import Path

import numpy as np
import pandas as pd

from labeling import labels
from serve_bridge.safe_write import publish_first, scratch_dir_for


def _assemble(path: Path, text: str) -> Path:
    scratch = scratch_dir_for(path)
    (scratch / "part").write_text(text)
    (scratch / "done").write_text(text)
    return scratch


def test_publish_first_renames_into_a_free_place(tmp_path: Path) -> None:
    path = tmp_path / "cache" / "model"
    scratch = _assemble(path, "a")
    assert publish_first(scratch, path)
    assert (path / "part").read_text() == "a" and not scratch.exists()


def test_publish_first_keeps_what_another_process_published(tmp_path: Path) -> None:
    path = tmp_path / "model"
    assert publish_first(_assemble(path, "first"), path)
    second = _assemble(path, "second")
    assert not publish_first(second, path)
    assert (path / "part").read_text() == "first" and not second.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no scratch left


def _race(path: str, text: str) -> bool:
    return publish_first(_assemble(Path(path), text), Path(path))


def test_processes_publishing_at_once_leave_one_whole_directory(tmp_path: Path) -> None:
    path = tmp_path / "model"
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        won = pool.starmap(_race, [(str(path), str(i)) for i in range(8)])
    assert sum(won) == 1
    assert (path / "part").read_text() == (path / "done").read_text() == str(won.index(True))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_labeling_shard_never_writes_through_a_planted_link(tmp_path: Path) -> None:
    """Links at the shard's files and at any temporary name beside them are replaced, and the file
    they point at is left as it was."""
    user = tmp_path / "user.txt"
    user.write_text("mine")
    shard_dir = tmp_path / "shards"
    shard_dir.mkdir()
    files = labels._shard_files(shard_dir, 0)
    names = {name for path in files.values()
             for name in (path.name, path.name + ".tmp", f".{path.name}.tmp", path.with_suffix(".tmp.npy").name)}
    for name in names:
        (shard_dir / name).symlink_to(user)
    df = pd.DataFrame({"t": [0, 1], "label": [1, 0]})
    h = np.arange(6, dtype=np.float32).reshape(2, 3)
    stats = labels.ShardStats(**{f.name: 0 for f in fields(labels.ShardStats)})
    labels._write_shard(shard_dir / "00000.done", files, df, h, stats)
    assert user.read_text() == "mine"
    assert pd.read_parquet(files["points"]).equals(df) and np.array_equal(np.load(files["features"]), h)
    assert labels._shard_stale(shard_dir / "00000.done", files) is None
