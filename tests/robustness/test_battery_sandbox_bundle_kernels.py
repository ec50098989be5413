"""Bad inputs and faults for the SQL sandbox, the bundle reader and the kernel entry points.

Every case ends either in the correct result or in one clear error of the documented type
(a sqlite3 error from the sandbox, a BundleError, a ValueError/TypeError naming the argument),
and leaves the user's files (databases, bundles) and input tensors unchanged.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import sqlite3
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save

from labeling.evaluators.sql import QueryTimeout, ResultTooLarge, SqlSandbox, execution_match
from serve_bridge.bundle import HEADS_FILE, MANIFEST, AdapterEntry, BundleError, load_bundle, write_bundle
from serve_bridge.steptrim import K_LIMIT, StepTrim
from tests.robustness.helpers import make_database


def snapshot(root: Path) -> dict[str, str]:
    """Every entry under ``root`` (links not followed): a file's sha256, a link's target, else its kind."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = p.relative_to(root).as_posix()
            if p.is_symlink():
                out[rel] = "link:" + os.readlink(p)
            elif p.is_file():
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                out[rel] = "dir" if p.is_dir() else "special"
    return out


# --------------------------------------------------------------------------- SQL sandbox
SINGERS = [("Ann", 34), ("Ben", 28), ("Cara", 41)]  # ids 1, 2, 3


def make_db(path: Path, wal: bool = False) -> Path:
    return make_database(path, wal, SINGERS)


@pytest.fixture(scope="module")
def sandbox() -> SqlSandbox:
    box = SqlSandbox(memory_bytes=512 << 20)
    yield box
    box.stop()


DENIED = [
    "DROP TABLE singer", "INSERT INTO singer VALUES (9, 'Eve', 50)", "UPDATE singer SET age = 1", "DELETE FROM singer",
    "REPLACE INTO singer VALUES (1, 'X', 1)", "CREATE TABLE t (x)", "CREATE TEMP TABLE t (x)",
    "CREATE VIEW v AS SELECT 1", "CREATE INDEX i ON singer(age)",
    "CREATE TRIGGER tr AFTER INSERT ON singer BEGIN SELECT 1; END", "ALTER TABLE singer ADD COLUMN z",
    "PRAGMA writable_schema=1", "PRAGMA journal_mode=WAL", "VACUUM", "BEGIN", "SAVEPOINT a", "REINDEX", "ANALYZE",
    "ATTACH DATABASE '/tmp/lorazor-battery-evil.sqlite' AS evil", "DETACH DATABASE main",
    "SELECT load_extension('/nonexistent/evil')",
]


@pytest.mark.parametrize("sql", DENIED)
def test_sql_denied_statement_is_one_error(tmp_path: Path, sandbox: SqlSandbox, sql: str) -> None:
    db = make_db(tmp_path / "db" / "concert.sqlite")
    before = snapshot(db.parent)
    with pytest.raises(sqlite3.DatabaseError):
        sandbox.execute(db, [sql])
    assert execution_match(sql, "SELECT 1 WHERE 0", db) == 0
    assert snapshot(db.parent) == before
    assert not Path("/tmp/lorazor-battery-evil.sqlite").exists()


MALFORMED = [
    ("SELEC name FRM singer", sqlite3.OperationalError),
    ("", None),  # no statement: no rows
    ("-- only a comment", None),
    ("SELECT 1; SELECT 2", sqlite3.DatabaseError),
    ("SELECT '\ud800'", sqlite3.DatabaseError),  # a lone surrogate cannot be encoded for SQLite
    ("SELECT 1\x00", sqlite3.DatabaseError),
    ("SELECT " + "1 + " * 5000 + "1", sqlite3.DatabaseError),  # expression tree too deep
    ("SELECT nope FROM singer", sqlite3.OperationalError),
    ("SELECT char(55296)", sqlite3.OperationalError),  # a surrogate: not valid UTF-8 text
    ("SELECT CAST(x'ff' || randomblob(20000) AS TEXT)", sqlite3.OperationalError),  # its message is cut
    ("SELECT * FROM missing_table", sqlite3.OperationalError),
]


@pytest.mark.parametrize("sql, error", MALFORMED)
def test_sql_malformed_query_is_one_error(tmp_path: Path, sandbox: SqlSandbox, sql: str, error: type) -> None:
    db = make_db(tmp_path / "db" / "concert.sqlite")
    before = snapshot(db.parent)
    if error is None:
        assert sandbox.execute(db, [sql]) == [[]]
    else:
        with pytest.raises(error):
            sandbox.execute(db, [sql])
    assert sandbox.execute(db, ["SELECT count(*) FROM singer"]) == [[(3,)]]  # the worker still serves
    assert snapshot(db.parent) == before


RUNAWAY = [
    ("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c", QueryTimeout, {}),
    ("SELECT length(replace(printf('%.*c', 100000000, 'a'), 'a', 'bc'))", QueryTimeout, {"max_bytes": 1 << 27}),
    ("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT x FROM c", ResultTooLarge, {}),
    ("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 500) SELECT x FROM c",
     ResultTooLarge, {"max_rows": 499}),
    ("SELECT printf('%.*c', 100000, 'x')", ResultTooLarge, {"max_bytes": 50000}),
    ("SELECT randomblob(100000)", ResultTooLarge, {"max_bytes": 50000}),
    ("SELECT length(randomblob(800000000))", sqlite3.DatabaseError, {"max_bytes": 1 << 30}),  # > memory cap
]


@pytest.mark.parametrize("sql, error, caps", RUNAWAY)
def test_sql_runaway_query_is_stopped(tmp_path: Path, sandbox: SqlSandbox, sql: str, error: type,
                                      caps: dict) -> None:
    db = make_db(tmp_path / "db" / "concert.sqlite")
    before = snapshot(db.parent)
    with pytest.raises(error):
        sandbox.execute(db, [sql], timeout_s=0.3, **{"max_rows": 100_000, "max_bytes": 1 << 16} | caps)
    assert sandbox.last_reply_bytes <= caps.get("max_bytes", 1 << 16) + 4096
    assert sandbox.execute(db, ["SELECT name FROM singer WHERE id = 2"]) == [[("Ben",)]]
    assert snapshot(db.parent) == before


def _corrupt(path: Path) -> None:
    path.write_bytes(b"SQLite format 3\x00" + b"\x07" * 3000)


def _truncated(path: Path) -> None:
    make_db(path)
    path.write_bytes(path.read_bytes()[:100])


def _text(path: Path) -> None:
    path.write_text("name,age\nAnn,34\n")


def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _directory(path: Path) -> None:
    path.mkdir()


def _missing(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)


DATABASE_FAULTS = [(_corrupt, sqlite3.DatabaseError), (_truncated, sqlite3.DatabaseError),
                   (_text, sqlite3.DatabaseError), (_empty, sqlite3.OperationalError), (_directory, OSError),
                   (_missing, OSError)]


@pytest.mark.parametrize("fault, error", DATABASE_FAULTS, ids=lambda f: getattr(f, "__name__", ""))
def test_sql_broken_database_is_one_error(tmp_path: Path, sandbox: SqlSandbox, fault: Callable, error: type) -> None:
    db = tmp_path / "db" / "concert.sqlite"
    db.parent.mkdir(parents=True)
    fault(db)
    before = snapshot(db.parent)
    with pytest.raises(error):
        sandbox.execute(db, ["SELECT name FROM singer"])
    assert execution_match("SELECT name FROM singer", "SELECT name FROM singer", db) == 0
    assert snapshot(db.parent) == before


@pytest.mark.parametrize("wal", [False, True])
def test_sql_correct_result_and_original_untouched(tmp_path: Path, sandbox: SqlSandbox, wal: bool) -> None:
    db = make_db(tmp_path / "db" / "concert.sqlite", wal=wal)
    before = snapshot(db.parent)
    assert sandbox.execute(db, ["SELECT name FROM singer WHERE age > 30 ORDER BY id"]) == [[("Ann",), ("Cara",)]]
    assert execution_match("SELECT name FROM singer WHERE age >= 34", "SELECT name FROM singer WHERE age > 30", db) == 1
    assert snapshot(db.parent) == before


# --------------------------------------------------------------------------- bundle reader
H = 8
SHA = "cd" * 32


def valid_bundle(root: Path) -> Path:
    w = np.linspace(-1, 1, H, dtype=np.float32)
    return write_bundle(root / "bundle", backbone="m", hidden_size=H, config_fingerprint="c", adapters=[
        AdapterEntry("a", SHA, "learned", tau=0.25, weight=w, bias=-0.5, stats={"val_skip": 0.4}),
        AdapterEntry("b", SHA, "profiled", k=8), AdapterEntry("c", SHA, "none")])


def _manifest(path: Path) -> dict:
    return json.loads((path / MANIFEST).read_text())


def _set_manifest(path: Path, m: dict) -> None:
    (path / MANIFEST).write_text(json.dumps(m))


def _edit(**changes) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        _set_manifest(path, _manifest(path) | changes)
    return edit


def _edit_adapter(i: int, **changes) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        m = _manifest(path)
        m["adapters"][i] |= changes
        _set_manifest(path, m)
    return edit


def _raw_manifest(text: str | bytes) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        (path / MANIFEST).write_bytes(text.encode() if isinstance(text, str) else text)
    return edit


def _replace_in_manifest(old: str, new: str) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        text = (path / MANIFEST).read_text()
        assert old in text
        (path / MANIFEST).write_text(text.replace(old, new, 1))
    return edit


def _heads(tensors: dict | bytes) -> Callable[[Path], None]:
    """Replace the heads file (and its listed sha256, so only the content is wrong)."""
    def edit(path: Path) -> None:
        data = tensors if isinstance(tensors, bytes) else save(tensors)
        (path / HEADS_FILE).write_bytes(data)
        m = _manifest(path)
        m["files"][HEADS_FILE] = hashlib.sha256(data).hexdigest()
        _set_manifest(path, m)
    return edit


def _bf16_heads(path: Path) -> None:
    from safetensors.torch import save as save_torch

    _heads(save_torch({"a.weight": torch.zeros(H, dtype=torch.bfloat16),
                       "a.bias": torch.zeros((), dtype=torch.bfloat16)}))(path)


def _symlink_manifest(path: Path) -> None:
    outside = path.parent / "outside.json"
    (path / MANIFEST).rename(outside)
    (path / MANIFEST).symlink_to(outside)


def _symlink_heads(path: Path) -> None:
    outside = path.parent / "outside.safetensors"
    (path / HEADS_FILE).rename(outside)
    (path / HEADS_FILE).symlink_to(outside)


def _fifo_heads(path: Path) -> None:
    (path / HEADS_FILE).unlink()
    os.mkfifo(path / HEADS_FILE)


def _extra(name: str, directory: bool = False) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        (path / name).mkdir() if directory else (path / name).write_bytes(b"x")
    return edit


def _extra_link(path: Path) -> None:
    (path / "extra.safetensors").symlink_to("/etc/hostname")


def _deep_stats(depth: int) -> Callable[[Path], None]:
    return _replace_in_manifest('"stats": {\n', '"stats": {"deep": ' + "[" * depth + "]" * depth + ",\n")


def _huge_manifest(path: Path) -> None:
    m = _manifest(path)
    m["adapters"][2]["stats"] = {"pad": "x" * (9 << 20)}
    _set_manifest(path, m)


def _not_a_dir(path: Path) -> None:
    import shutil

    shutil.rmtree(path)
    path.write_text("not a bundle")


def _listed_extra(data: bytes) -> Callable[[Path], None]:
    """An extra file ``extra.safetensors`` holding ``data``, listed in 'files' with its true sha256."""
    def edit(path: Path) -> None:
        (path / "extra.safetensors").write_bytes(data)
        m = _manifest(path)
        m["files"]["extra.safetensors"] = hashlib.sha256(data).hexdigest()
        _set_manifest(path, m)
    return edit


class _Unpickled:
    """Unpickling this raises: a loader that unpickles a bundle file fails loudly."""

    def __reduce__(self):
        return (exec, ("raise SystemExit('a bundle file was unpickled')",))


W, B = np.linspace(-1, 1, H, dtype=np.float32), np.array(-0.5, np.float32)
BUNDLE_FAULTS = [
    (_symlink_manifest, "symbolic link"),
    (_symlink_heads, "symbolic link"),
    (_fifo_heads, "not a regular file"),
    (_extra_link, "not listed"),
    (_extra("sub", directory=True), "not listed"),
    (_extra("notes.txt"), "not listed"),
    (_huge_manifest, "more than"),
    (_deep_stats(100_000), "not valid JSON"),
    (_deep_stats(40), "deeper than 32"),
    (_replace_in_manifest('"hidden_size": 8', '"hidden_size": ' + "9" * 5000), "not valid JSON"),
    (_replace_in_manifest('"k": 8', '"k": ' + "9" * 40), "0 ≤ k < 2"),
    (_edit_adapter(1, k=K_LIMIT), "0 ≤ k < 2"),
    (_edit_adapter(1, k=-1), "0 ≤ k < 2"),
    (_edit_adapter(1, k=8.0), "0 ≤ k < 2"),
    (_edit_adapter(1, k=True), "0 ≤ k < 2"),
    (_replace_in_manifest('"tau": 0.25', '"tau": NaN'), "NaN is not a JSON number"),
    (_replace_in_manifest('"tau": 0.25', '"tau": Infinity'), "Infinity is not a JSON number"),
    (_replace_in_manifest('"tau": 0.25', '"tau": 1e39'), "float32"),
    (_replace_in_manifest('"tau": 0.25', '"tau": 1e400'), "not valid JSON|float32"),
    (_replace_in_manifest('"tau": 0.25', '"tau": ' + "7" * 400), "float32"),
    (_edit_adapter(0, tau="0.25"), "finite 'tau'"),
    (_edit_adapter(0, tau=True), "finite 'tau'"),
    (_edit_adapter(0, tau=None), "finite 'tau'"),
    (_bf16_heads, "BF16, expected F32"),
    (_heads({"a.weight": W.astype(np.float64), "a.bias": B}), "F64, expected F32"),
    (_heads({"a.weight": W.astype(np.int32), "a.bias": B}), "I32, expected F32"),
    (_heads({"a.weight": np.zeros(H + 1, np.float32), "a.bias": B}), "must be"),
    (_heads({"a.weight": W, "a.bias": np.zeros(1, np.float32)}), "must be"),
    (_heads({"a.weight": W.reshape(2, H // 2), "a.bias": B}), "must be"),
    (_heads({"a.weight": np.full(H, np.nan, np.float32), "a.bias": B}), "finite float32"),
    (_heads({"a.weight": W, "a.bias": np.array(np.inf, np.float32)}), "finite float32"),
    (_heads({"a.weight": W, "a.bias": B, "stray": W}), "belongs to no learned adapter"),
    (_heads({"a.weight": W}), "not in"),
    (_heads(b"\x00" * 64), "not a valid safetensors"),
    (_heads(struct.pack("<Q", 1 << 60) + b"{}"), "bad header length"),
    (_heads(struct.pack("<Q", 2) + b"[]"), "header is not an object"),
    (_heads(struct.pack("<Q", 60) + b'{"a.weight":{"dtype":"F32","shape":[8],"data_offsets":[0,999]}}'[:60]),
     "not valid JSON|not a valid safetensors"),
    (_replace_in_manifest('"schema_version": 2', '"schema_version": 2, "schema_version": 2'), "duplicate key"),
    (_raw_manifest(b"\xff\xfe{}"), "not valid JSON"),
    (_raw_manifest("[]"), "expected a JSON object"),
    (_raw_manifest(""), "not valid JSON"),
    (_edit(hidden_size=0), "'hidden_size' must be an integer in 1"),
    (_edit(hidden_size=-8), "'hidden_size' must be an integer in 1"),
    (_edit(hidden_size=1 << 21), "'hidden_size' must be an integer in 1"),
    (_edit(schema_version=True), "'schema_version' has type bool"),
    (_edit(adapters={"a": 1}), "'adapters' has type dict"),
    (_edit(files=[HEADS_FILE]), "'files' has type list"),
    (_edit(files={HEADS_FILE: 5}), "expected a 64-hex sha256"),
    (_edit(files={HEADS_FILE: "AB" * 32}), "expected a 64-hex sha256"),
    (_edit(files={"h\x00.safetensors": "ab" * 32}), "plain .safetensors"),
    (_edit(files={"../heads.safetensors": "ab" * 32}), "plain .safetensors"),
    (_edit(files={}), "not listed"),
    (_edit_adapter(0, weights_sha256="CD" * 32), "64-hex sha256"),
    (_edit_adapter(0, head=None), "'head' has type NoneType"),
    (_edit_adapter(0, head={"weight": ["a.weight"], "bias": "a.bias"}), "head tensor"),
    (_edit_adapter(1, policy="best"), "'policy' is 'best'"),
    (_edit_adapter(2, stats=[1, 2]), "'stats' has type list"),
    (_edit_adapter(2, name="a"), "appears twice"),
    (_edit_adapter(2, name=""), "'name' must be a non-empty string"),
    (_edit_adapter(2, tau=0.5), "belong to learned policies only"),
    (_not_a_dir, "not a policy bundle"),
    # every listed file is parsed as what it is; schema 1 lists only the heads file
    (_listed_extra(pickle.dumps(_Unpickled())), "'files' lists 'extra.safetensors'; a bundle holds only"),
    (_listed_extra(bytes(range(256)) * 4), "'files' lists 'extra.safetensors'; a bundle holds only"),
    (_listed_extra(save({"x": np.arange(H, dtype=np.int64)})), "'files' lists 'extra.safetensors'"),
    (_listed_extra(save({"x": W})), "'files' lists 'extra.safetensors'"),
    # records the runtime would misread
    (_edit_adapter(2, policy="learned", tau=0.1, head={"weight": "a.weight", "bias": "a.bias"}),
     r"adapter 'c': head tensors \['a.weight', 'a.bias'\] are not the adapter's own \['c.weight', 'c.bias'\]"),
    (_edit_adapter(0, head={"weight": "a.weight", "bias": "a.weight"}), "are not the adapter's own"),
    (_edit_adapter(1, head={"weight": "a.weight", "bias": "a.bias"}), "a 'profiled' adapter has a 'head'"),
    (_edit_adapter(2, head={"weight": "a.weight", "bias": "a.bias"}), "a 'none' adapter has a 'head'"),
    (_edit_adapter(1, head={}), "a 'profiled' adapter has a 'head'"),
    # strict JSON beyond Python's json
    (_replace_in_manifest('"stats": {\n', '"stats": {"s": "\\ud800",\n'), "lone UTF-16 surrogate"),
    (_replace_in_manifest('"stats": {\n', '"stats": {"\\udfff": 1,\n'), "lone UTF-16 surrogate"),
    (_replace_in_manifest('"tau": 0.25', '"tau": 1e999'), "overflows a 64-bit float"),
]


@pytest.mark.parametrize("fault, message", BUNDLE_FAULTS, ids=[str(i) for i in range(len(BUNDLE_FAULTS))])
def test_bundle_fault_is_one_bundle_error(tmp_path: Path, fault: Callable, message: str) -> None:
    path = valid_bundle(tmp_path)
    fault(path)
    before = snapshot(tmp_path)
    with pytest.raises(BundleError, match=message):
        load_bundle(path, expected_hidden_size=H)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("k", [0, 1, K_LIMIT - 1])
def test_bundle_edge_values_load_and_the_runtime_accepts_them(tmp_path: Path, k: int) -> None:
    path = valid_bundle(tmp_path)
    _edit_adapter(1, k=k)(path)
    before = snapshot(tmp_path)
    b = load_bundle(path, expected_hidden_size=H, known_adapters=["a", "b", "c"])
    assert b.policies["b"].k == k
    st = StepTrim([b.policies[n] for n in sorted(b.policies)], H)
    fires = st.fires(torch.tensor([1, 1]), torch.tensor([k, k - 1]), torch.zeros(2, H))
    assert fires.tolist() == [True, k - 1 >= k]
    assert snapshot(tmp_path) == before


# --------------------------------------------------------------------------- kernel entry points
def _meta(mapping: list[int], max_loras: int = 4):
    from lora_kernels.metadata import build_metadata

    return build_metadata(torch.tensor(mapping, dtype=torch.int32), max_loras)


def _with(meta, **changes):
    from dataclasses import replace

    return replace(meta, **changes)


def _allocate(tokens: int, slots: int):
    from lora_kernels.worklist import RowTileWorklist

    return RowTileWorklist.allocate(tokens, slots, "cpu")


BASE = [0, 0, 1, -1, 2, 2, 2, 3] * 5  # 40 tokens over 4 adapters


def k_worklist_too_small():
    meta = _meta(BASE)
    _allocate(8, meta.num_slots).update(meta)


def k_worklist_too_few_slots():
    meta = _meta(BASE)
    _allocate(len(BASE), 2).update(meta)


def k_worklist_other_device():
    meta = _meta(BASE)
    from lora_kernels.worklist import RowTileWorklist

    RowTileWorklist.allocate(len(BASE), meta.num_slots, "meta").update(meta)


def k_meta_int64():
    meta = _meta(BASE)
    _allocate(len(BASE), meta.num_slots).update(_with(meta, num_tokens_per_slot=meta.num_tokens_per_slot.long()))


def k_meta_short_counts():
    meta = _meta(BASE)
    _allocate(len(BASE), meta.num_slots).update(_with(meta, num_tokens_per_slot=meta.num_tokens_per_slot[:-1]))


def k_meta_short_order():
    meta = _meta(BASE)
    _allocate(len(BASE), meta.num_slots).update(_with(meta, token_indices_sorted=meta.token_indices_sorted[:-1]))


def k_meta_2d():
    meta = _meta(BASE)
    _allocate(len(BASE), meta.num_slots).update(_with(meta, slot_lora_ids=meta.slot_lora_ids[None]))


def k_meta_not_tensor():
    meta = _meta(BASE)
    _allocate(len(BASE), meta.num_slots).update(_with(meta, slot_start_loc=[0, 1]))


def k_plan_fewer_slots():
    from lora_kernels.gridtrim import plan_gridtrim

    plan_gridtrim(_meta(BASE), len(BASE), 3)  # slot 3 (adapter 2) holds tokens


def k_plan_more_slots():
    from lora_kernels.gridtrim import plan_gridtrim

    plan_gridtrim(_meta(BASE), len(BASE), 9)


def k_plan_negative_slots():
    from lora_kernels.gridtrim import plan_gridtrim

    plan_gridtrim(_meta(BASE), len(BASE), -1)


def k_plan_too_few_tokens():
    from lora_kernels.gridtrim import plan_gridtrim

    plan_gridtrim(_meta([0] * 40), 20, 5)


def k_build_float():
    from lora_kernels.metadata import build_metadata

    build_metadata(torch.zeros(4), 2)


def k_build_bool():
    from lora_kernels.metadata import build_metadata

    build_metadata(torch.zeros(4, dtype=torch.bool), 2)


def k_build_2d():
    from lora_kernels.metadata import build_metadata

    build_metadata(torch.zeros(2, 2, dtype=torch.int32), 2)


def k_build_negative_loras():
    from lora_kernels.metadata import build_metadata

    build_metadata(torch.zeros(4, dtype=torch.int32), -1)


def k_host_tiles_small():
    from lora_kernels.worklist import RowTileWorklist, host_tiles

    meta = _meta(BASE)
    out = np.zeros(RowTileWorklist.block_size(2), np.int32)
    host_tiles(meta.num_tokens_per_slot.numpy(), meta.slot_lora_ids.numpy(), meta.slot_start_loc.numpy(),
               meta.token_indices_sorted.numpy(), 16, out)


def k_host_tiles_int64():
    from lora_kernels.worklist import RowTileWorklist, host_tiles

    meta = _meta(BASE)
    out = np.zeros(RowTileWorklist.block_size(64), np.int64)
    host_tiles(meta.num_tokens_per_slot.numpy(), meta.slot_lora_ids.numpy(), meta.slot_start_loc.numpy(),
               meta.token_indices_sorted.numpy(), 16, out)


def k_in_block_size():
    from lora_kernels.worklist import RowTileWorklist

    RowTileWorklist.in_block(torch.zeros(100, dtype=torch.int32), 8)


def k_in_block_dtype():
    from lora_kernels.worklist import RowTileWorklist

    RowTileWorklist.in_block(torch.zeros(RowTileWorklist.block_size(8), dtype=torch.int64), 8)


def _layer(m: int = len(BASE), k: int = 64, rank: int = 8, n: int = 32, loras: int = 4):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    a = torch.randn(loras, rank, k, generator=g).to(torch.bfloat16)
    b = torch.randn(loras, n, rank, generator=g).to(torch.bfloat16)
    y = torch.zeros(m, n, dtype=torch.bfloat16)
    part = torch.zeros(1, 1, m, rank)
    return x, a, b, y, part


def _full_worklist(meta):
    return _allocate(len(BASE), meta.num_slots)


def _plan(slots: int, dtype: torch.dtype = torch.int32):
    from lora_kernels.gridtrim import GridTrimPlan

    return lambda meta: GridTrimPlan(slots, 16, torch.arange(slots, dtype=dtype), None)


def _shrink(m: int = len(BASE), x_of: Callable = lambda x: x, part_of: Callable = lambda p: p,
            schedule: Callable = _full_worklist) -> None:
    """lora_shrink on a fresh layer of ``m`` tokens (metadata: BASE), with x and the partials passed
    through ``x_of`` / ``part_of`` and the schedule ``schedule(meta)``."""
    from lora_kernels.shrink import lora_shrink

    x, a, _, _, part = _layer(m=m)
    meta = _meta(BASE)
    lora_shrink(x_of(x), [a], part_of(part), meta, schedule(meta))


def _expand(part_of: Callable = lambda p: p, y_of: Callable = lambda y: y, schedule: Callable = _full_worklist,
            offset_start: int = 0) -> None:
    """lora_expand on a fresh layer (metadata: BASE), with the partials and y passed through
    ``part_of`` / ``y_of``, the schedule ``schedule(meta)`` and ``offset_start``."""
    from lora_kernels.expand import lora_expand

    _, _, b, y, part = _layer()
    meta = _meta(BASE)
    lora_expand(part_of(part), [b], y_of(y), meta, schedule(meta), offset_start=offset_start)


def k_shrink_worklist_too_small():
    _shrink(schedule=lambda meta: _allocate(8, meta.num_slots))


def k_shrink_meta_more_tokens_than_x():
    _shrink(m=20)


def k_shrink_plan_over_more_slots():
    _shrink(schedule=_plan(9))


def k_shrink_plan_int64_slots():
    _shrink(schedule=_plan(5, torch.int64))


def k_shrink_x_float32():
    _shrink(x_of=lambda x: x.float())


def k_shrink_x_1d():
    _shrink(x_of=lambda x: x[0])


def k_shrink_partials_fp16():
    _shrink(part_of=lambda p: p.half())


def k_expand_partials_fp16():
    _expand(part_of=lambda p: p.half())


def k_expand_y_1d():
    _expand(y_of=lambda y: y[:, 0])


def k_expand_negative_offset():
    _expand(offset_start=-4)


def k_expand_worklist_too_small():
    _expand(schedule=lambda meta: _allocate(4, 2))


def k_expand_plan_fewer_metadata_slots():
    _expand(schedule=_plan(6))


def k_punica_mapping_too_long():
    from serve_bridge.punica_meta import HostPunicaMetadata
    from tests.serve_bridge.test_punica_meta import SLOTS, T, VOCAB, wrapper

    HostPunicaMetadata(wrapper([])).update([1] * (T + 1), [1], list(range(1, SLOTS + 1)), SLOTS + 1, VOCAB)


def k_punica_too_many_slots():
    from serve_bridge.punica_meta import HostPunicaMetadata
    from tests.serve_bridge.test_punica_meta import SLOTS, VOCAB, wrapper

    HostPunicaMetadata(wrapper([])).update([1, 2], [1], list(range(1, SLOTS + 2)), SLOTS + 2, VOCAB)


KERNEL_FAULTS = [
    (k_worklist_too_small, ValueError, "RowTileWorklist holds"),
    (k_worklist_too_few_slots, ValueError, "RowTileWorklist holds"),
    (k_worklist_other_device, ValueError, "RowTileWorklist on meta"),
    (k_meta_int64, TypeError, "num_tokens_per_slot must be int32"),
    (k_meta_short_counts, ValueError, "start offsets"),
    (k_meta_short_order, ValueError, "token_indices_sorted has"),
    (k_meta_2d, ValueError, "slot_lora_ids must be 1-D"),
    (k_meta_not_tensor, TypeError, "slot_start_loc must be a tensor"),
    (k_plan_fewer_slots, ValueError, "num_slots=3 but slot 3"),
    (k_plan_more_slots, ValueError, "num_slots=9"),
    (k_plan_negative_slots, ValueError, "num_slots=-1"),
    (k_plan_too_few_tokens, ValueError, "maps 40 tokens but the batch has 20"),
    (k_build_float, TypeError, "token_lora_mapping must be an integer tensor"),
    (k_build_bool, TypeError, "token_lora_mapping must be an integer tensor"),
    (k_build_2d, ValueError, "token_lora_mapping must be 1-D"),
    (k_build_negative_loras, ValueError, "max_loras"),
    (k_host_tiles_small, ValueError, "holds"),
    (k_host_tiles_int64, ValueError, "int32 block"),
    (k_in_block_size, ValueError, "block has 100 entries"),
    (k_in_block_dtype, TypeError, "1-D int32"),
    (k_shrink_worklist_too_small, ValueError, "RowTileWorklist holds"),
    (k_shrink_meta_more_tokens_than_x, ValueError, "maps 40 tokens but the batch has 20"),
    (k_shrink_plan_over_more_slots, ValueError, "GridTrimPlan covers 9 slots"),
    (k_shrink_plan_int64_slots, TypeError, "all_slots must be int32"),
    (k_shrink_x_float32, ValueError, "fp16/bf16"),
    (k_shrink_x_1d, ValueError, "x of shape"),
    (k_shrink_partials_fp16, ValueError, "float32"),
    (k_expand_partials_fp16, ValueError, "float32"),
    (k_expand_y_1d, ValueError, "y of shape"),
    (k_expand_negative_offset, ValueError, "offset"),
    (k_expand_worklist_too_small, ValueError, "RowTileWorklist holds"),
    (k_expand_plan_fewer_metadata_slots, ValueError, "GridTrimPlan covers 6 slots"),
    (k_punica_mapping_too_long, ValueError, "index_mapping"),
    (k_punica_too_many_slots, ValueError, "lora_index_to_id"),
]


@pytest.mark.parametrize("case, error, message", KERNEL_FAULTS, ids=[c[0].__name__ for c in KERNEL_FAULTS])
def test_kernel_entry_point_rejects_a_broken_contract(case: Callable, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        case()


def test_kernel_metadata_does_not_alias_the_mapping() -> None:
    from lora_kernels.metadata import build_metadata

    mapping = torch.tensor(BASE, dtype=torch.int32)
    meta = build_metadata(mapping, 4)
    assert meta.token_lora_mapping.data_ptr() != mapping.data_ptr()
    mapping.fill_(-1)  # the caller reuses its buffer
    assert meta.token_lora_mapping.tolist() == BASE


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int16])
def test_kernel_valid_inputs_pass_the_checks_unchanged(dtype: torch.dtype) -> None:
    from lora_kernels.gridtrim import plan_gridtrim
    from lora_kernels.metadata import build_metadata

    mapping = torch.tensor(BASE, dtype=dtype)
    copy = mapping.clone()
    meta = build_metadata(mapping, 4)
    wl = _allocate(len(BASE), meta.num_slots)
    wl.update(meta)
    assert int(wl.num_tiles) == 4  # 10 tokens per adapter: one tile each
    plan = plan_gridtrim(meta, len(BASE), meta.num_slots)
    plan.check(meta, len(BASE))
    assert plan.row_bound == 16
    assert torch.equal(mapping, copy)
