"""Spider execution match: correctness, read-only guarantees, timeout, missing database."""
from __future__ import annotations

import hashlib
import sqlite3
import time
from pathlib import Path

import pytest

from labeling.evaluators.sql import (
    QueryTimeout,
    ResultTooLarge,
    SqlSandbox,
    execute_readonly,
    execution_match,
    extract_sql,
)
from labeling.evaluators.sql_worker import connect_readonly
from labeling.tasks.base import TaskError
from labeling.tasks.spider import database_path

ROWS = [(1, "Ann", 34, "France"), (2, "Ben", 28, "Spain"), (3, "Cara", 41, "France"), (4, "Dan", 22, "Peru")]
GOLD = "SELECT name FROM singer WHERE age > 30"
EMPTY_GOLD = "SELECT name FROM singer WHERE age > 1000"


def make_db(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE singer (id INTEGER PRIMARY KEY, name TEXT, age INTEGER, country TEXT)")
    conn.executemany("INSERT INTO singer VALUES (?, ?, ?, ?)", ROWS)
    conn.commit()
    conn.close()
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def rows_of(path: Path) -> list[tuple]:
    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT * FROM singer ORDER BY id").fetchall()
    finally:
        conn.close()


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return make_db(tmp_path / "database" / "concert" / "concert.sqlite")


@pytest.mark.parametrize("response, expected", [
    ("```sql\nSELECT name FROM singer;\n```\nThis lists the names.", "SELECT name FROM singer"),
    ("Here:\n```SQL\nSELECT 1\n```", "SELECT 1"),
    ("```\nSELECT 2;\n```", "SELECT 2"),
    ("SELECT name\nFROM singer\n\nThis query lists names.", "SELECT name\nFROM singer"),
    ("SELECT 1; DROP TABLE singer", "SELECT 1"),
    ("SELECT name FROM singer WHERE name = 'a;b'; SELECT 2", "SELECT name FROM singer WHERE name = 'a;b'"),
    ("   ", None),
    ("```sql\n\n```", None),
])
def test_extract_sql(response: str, expected: str | None) -> None:
    assert extract_sql(response) == expected


def test_correct_query_scores_1(db: Path) -> None:
    assert execution_match("```sql\nSELECT name FROM singer WHERE 30 < age\n```", GOLD, db) == 1
    assert execution_match("SELECT name FROM singer WHERE age >= 34;", GOLD, db) == 1


def test_wrong_query_scores_0(db: Path) -> None:
    assert execution_match("SELECT name FROM singer WHERE age < 30", GOLD, db) == 0
    assert execution_match("SELECT name, age FROM singer WHERE age > 30", GOLD, db) == 0  # extra column


def test_order_insensitive_without_order_by(db: Path) -> None:
    assert execution_match("SELECT name FROM singer WHERE age > 30 ORDER BY name DESC", GOLD, db) == 1


def test_order_sensitive_with_gold_order_by(db: Path) -> None:
    gold = "SELECT name FROM singer ORDER BY age"
    assert execution_match("SELECT name FROM singer ORDER BY age ASC", gold, db) == 1
    assert execution_match("SELECT name FROM singer ORDER BY age DESC", gold, db) == 0


def test_results_compared_as_multisets(db: Path) -> None:
    gold = "SELECT country FROM singer"  # France twice
    assert execution_match("SELECT country FROM singer ORDER BY id DESC", gold, db) == 1
    assert execution_match("SELECT DISTINCT country FROM singer", gold, db) == 0


@pytest.mark.parametrize("response", ["SELEC name FRM singer", "SELECT nope FROM singer", "", "I cannot answer."])
def test_malformed_or_missing_sql_scores_0(db: Path, response: str) -> None:
    assert execution_match(response, GOLD, db) == 0


def test_failing_gold_scores_0(db: Path) -> None:
    assert execution_match("SELECT name FROM singer", "SELECT name FROM missing_table", db) == 0


WRITES = [
    "DROP TABLE singer",
    "INSERT INTO singer VALUES (9, 'Eve', 50, 'Chad')",
    "UPDATE singer SET age = 99",
    "DELETE FROM singer",
    "CREATE TABLE evil (x)",
    "CREATE TEMP TABLE evil (x)",
    "PRAGMA writable_schema=1",
    "ALTER TABLE singer RENAME TO s2",
    "VACUUM",
    "BEGIN",
]


@pytest.mark.parametrize("write", WRITES)
def test_writes_score_0_and_leave_the_database_unchanged(db: Path, write: str) -> None:
    before_hash, before_rows = sha256(db), rows_of(db)
    # the gold result is empty, like a write's: only the authorizer makes these score 0
    assert execution_match(f"```sql\n{write}\n```", EMPTY_GOLD, db) == 0
    assert execution_match(write, GOLD, db) == 0
    with pytest.raises(sqlite3.DatabaseError):
        execute_readonly(db, write)
    assert sha256(db) == before_hash
    assert rows_of(db) == before_rows


def test_attach_is_denied(db: Path, tmp_path: Path) -> None:
    before = sha256(db)
    evil = tmp_path / "evil.sqlite"
    assert execution_match(f"ATTACH DATABASE '{evil}' AS evil", EMPTY_GOLD, db) == 0
    with pytest.raises(sqlite3.DatabaseError, match="not authorized"):
        execute_readonly(db, f"ATTACH DATABASE '{evil}' AS evil")
    assert not evil.exists()
    assert sha256(db) == before


def test_load_extension_is_denied(db: Path) -> None:
    with pytest.raises(sqlite3.DatabaseError, match="not authorized"):
        execute_readonly(db, "SELECT load_extension('/nonexistent/evil')")


def test_readonly_connection_denies_writes_even_on_the_original(db: Path) -> None:
    before = sha256(db)
    conn = connect_readonly(db)
    try:
        assert conn.execute("SELECT count(*) FROM singer").fetchone() == (len(ROWS),)
        for write in WRITES:
            with pytest.raises(sqlite3.DatabaseError):
                conn.execute(write)
    finally:
        conn.close()
    assert sha256(db) == before
    assert rows_of(db) == ROWS


def test_mode_ro_blocks_writes_without_the_authorizer(db: Path) -> None:
    conn = connect_readonly(db)
    conn.set_authorizer(None)  # first line of defence alone: the file is opened read-only
    try:
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            conn.execute("DELETE FROM singer")
    finally:
        conn.close()
    assert rows_of(db) == ROWS


def dir_state(directory: Path) -> dict[str, str]:
    """File name → sha256 of every file in ``directory``."""
    return {p.name: sha256(p) for p in sorted(directory.iterdir())}


def make_wal_db(path: Path, keep_wal: bool) -> Path:
    """A WAL-mode copy of the singer database at ``path``; with ``keep_wal`` its last rows live
    only in a ``-wal`` file beside it (copied while the writer still had it open)."""
    src = make_db(path.parents[1] / "build" / "src.sqlite")
    path.parent.mkdir(parents=True)
    conn = sqlite3.connect(src)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA wal_autocheckpoint=0")
    conn.execute("INSERT INTO singer VALUES (5, 'Eve', 60, 'Chad')")
    conn.commit()
    if keep_wal:
        path.write_bytes(src.read_bytes())
        path.with_name(path.name + "-wal").write_bytes(src.with_name("src.sqlite-wal").read_bytes())
    conn.close()
    if not keep_wal:
        path.write_bytes(src.read_bytes())
    return path


@pytest.mark.parametrize("keep_wal", [False, True])
def test_wal_database_is_read_from_a_private_copy(tmp_path: Path, keep_wal: bool) -> None:
    from labeling.tasks.spider import read_schema

    db = make_wal_db(tmp_path / "database" / "concert" / "concert.sqlite", keep_wal)
    before = dir_state(db.parent)
    assert execute_readonly(db, "SELECT name FROM singer WHERE age > 50") == [("Eve",)]  # the -wal's row
    assert execution_match("SELECT name FROM singer WHERE age > 30", "SELECT name FROM singer WHERE age >= 34",
                           db) == 1
    assert "CREATE TABLE singer" in read_schema(db)
    assert dir_state(db.parent) == before  # no -wal/-shm created, nothing rewritten


def test_slow_builtin_is_killed_within_its_timeout(db: Path) -> None:
    """One replace() over 100 MB runs as a single VM instruction: the worker's interrupt cannot
    stop it, so the parent kills the worker; the next query gets a new one."""
    sandbox = SqlSandbox()
    slow = "SELECT length(replace(printf('%.*c', 100000000, 'a'), 'a', 'bc'))"
    assert sandbox.execute(db, ["SELECT 1"]) == [[(1,)]]
    start = time.monotonic()
    with pytest.raises(QueryTimeout, match="worker was killed"):
        sandbox.execute(db, [slow], timeout_s=0.1, max_bytes=1 << 27)
    assert time.monotonic() - start < 3.0
    assert sandbox.execute(db, ["SELECT count(*) FROM singer"]) == [[(len(ROWS),)]]
    assert sandbox.starts == 2
    sandbox.stop()


def test_worker_is_reused_across_queries(db: Path) -> None:
    sandbox = SqlSandbox()
    for _ in range(5):
        assert sandbox.execute(db, [GOLD, "SELECT 1 WHERE 0"]) == [[("Ann",), ("Cara",)], []]
        with pytest.raises(sqlite3.OperationalError, match="no such table"):
            sandbox.execute(db, ["SELECT * FROM nope"])
    assert sandbox.starts == 1
    sandbox.stop()


def test_dead_worker_is_replaced(db: Path) -> None:
    sandbox = SqlSandbox()
    assert sandbox.execute(db, ["SELECT 1"]) == [[(1,)]]
    sandbox._proc.kill()
    sandbox._proc.wait()
    assert sandbox.execute(db, ["SELECT 2"]) == [[(2,)]]
    assert sandbox.starts == 2
    sandbox.stop()


@pytest.mark.parametrize("sql", [
    "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 20000) SELECT printf('%.40c', 'x') FROM c",
    "SELECT printf('%.*c', 5000, 'x')",
    "SELECT randomblob(5000)",
])
def test_byte_cap_stops_the_result_in_the_worker(db: Path, sql: str) -> None:
    sandbox = SqlSandbox()
    with pytest.raises((ResultTooLarge, sqlite3.DataError, sqlite3.OperationalError), match="bytes|too big"):
        sandbox.execute(db, [sql], max_bytes=4000)
    assert sandbox.last_reply_bytes < 4000  # only the error reply reached this process
    assert execution_match(sql, sql, db, max_bytes=4000) == 0
    assert len(sandbox.execute(db, [sql], max_bytes=1 << 24)[0]) >= 1  # within a larger cap it runs
    sandbox.stop()


def test_values_round_trip_through_the_worker(db: Path) -> None:
    q = "SELECT 1, 1.5, 'é ✓\n', x'00ff', NULL, 9223372036854775807, 1e999"
    assert execute_readonly(db, q) == [(1, 1.5, "é ✓\n", b"\x00\xff", None, 2**63 - 1, float("inf"))]


def test_memory_cap_fails_the_query_not_the_process(db: Path) -> None:
    sandbox = SqlSandbox(memory_bytes=256 << 20)
    with pytest.raises(sqlite3.DatabaseError):
        sandbox.execute(db, ["SELECT length(randomblob(400000000))"], max_bytes=1 << 30)
    assert sandbox.execute(db, ["SELECT 3"]) == [[(3,)]]
    sandbox.stop()


def test_corrupt_database_is_a_query_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.sqlite"
    bad.write_bytes(b"SQLite format 3\x00" + b"\x07" * 2000)
    with pytest.raises(sqlite3.DatabaseError):
        execute_readonly(bad, "SELECT 1 FROM sqlite_master")
    assert execution_match("SELECT 1", "SELECT 1", bad) == 0


def test_slow_query_times_out_and_scores_0(db: Path) -> None:
    endless = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"
    start = time.monotonic()
    assert execution_match(endless, GOLD, db, timeout_s=0.3) == 0
    assert time.monotonic() - start < 3.0
    start = time.monotonic()
    with pytest.raises(sqlite3.OperationalError, match="interrupted"):
        execute_readonly(db, endless, timeout_s=0.3)
    assert time.monotonic() - start < 3.0


def test_recursive_cte_within_limits_is_allowed(db: Path) -> None:
    q = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 3) SELECT x FROM c"
    assert execute_readonly(db, q) == [(1,), (2,), (3,)]


def test_row_cap(db: Path) -> None:
    with pytest.raises(ResultTooLarge):
        execute_readonly(db, "SELECT * FROM singer", max_rows=3)
    assert len(execute_readonly(db, "SELECT * FROM singer", max_rows=4)) == 4
    assert execution_match("SELECT name FROM singer", "SELECT name FROM singer", db, max_rows=3) == 0


def test_database_path_resolves_spider_layout(db: Path) -> None:
    assert database_path(db.parents[1], "concert") == db


def test_missing_database_is_a_clear_task_error(tmp_path: Path) -> None:
    with pytest.raises(TaskError) as err:
        database_path(tmp_path, "world_1")
    msg = str(err.value)
    assert "world_1" in msg
    assert str(tmp_path / "world_1" / "world_1.sqlite") in msg
    assert "db_dir" in msg


def test_unset_db_dir_is_a_clear_task_error() -> None:
    with pytest.raises(TaskError, match="db_dir") as err:
        database_path(None, "world_1")
    assert "world_1" in str(err.value)


@pytest.mark.parametrize("db_id", ["../concert", "a/b", "..", ""])
def test_path_like_db_id_is_rejected(db: Path, db_id: str) -> None:
    with pytest.raises(TaskError, match="db_id"):
        database_path(db.parents[1], db_id)


def test_vanished_database_scores_0_without_raising(tmp_path: Path) -> None:
    assert execution_match("SELECT 1", "SELECT 1", tmp_path / "gone.sqlite") == 0


@pytest.mark.parametrize("limits", [{"timeout_s": 0}, {"timeout_s": -1.0}, {"timeout_s": float("nan")},
                                    {"max_rows": -1}, {"max_bytes": -5}])
def test_nonsense_limits_are_a_value_error(db: Path, limits: dict) -> None:
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        SqlSandbox().execute(db, ["SELECT 1"], **limits)
