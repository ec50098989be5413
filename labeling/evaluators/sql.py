"""Spider execution match: run predicted and gold SQL on a read-only copy of the database.

Semantics of :func:`execution_match` (Q ∈ {0, 1}):

- The SQL is taken from the model response with :func:`extract_sql`: the first ```` ```sql ````
  fenced block (else the first bare ```` ``` ```` block), else the text up to the first blank
  line; in both cases only the first complete statement (up to its ``;``) is kept.
- Both queries run on a **temporary copy** of the database file, opened with
  ``file:…?mode=ro`` and an authorizer that allows only reads (SELECT, column reads, scalar
  functions other than ``load_extension``, recursive CTEs). Every write, DDL, ATTACH/DETACH,
  PRAGMA, transaction or VACUUM is denied. The original file is never opened for execution.
- Each query has a wall-clock deadline (default 5 s) enforced by a progress handler, and a
  row cap (default 100 000 rows; Spider's gold results are far smaller) so a runaway join
  cannot exhaust memory before the deadline.
- The result rows are compared as multisets (row order ignored), unless the gold query has
  ``ORDER BY`` anywhere, in which case the row lists must be equal in order. Column order
  always matters; ``1 == 1.0`` as in Python.
- Any exception (no SQL found, malformed SQL, denied action, timeout, row cap exceeded,
  gold query failing) scores 0; :func:`execution_match` never raises for a bad response.

A missing database file is a configuration problem, not a wrong answer: the Spider task
resolves the path first (:func:`labeling.tasks.spider.database_path`, a TaskError naming the
``db_id``, the path and the fix).
"""
from __future__ import annotations

import re
import shutil
import sqlite3
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MAX_ROWS = 100_000  # a result larger than this is treated as a failed query
PROGRESS_EVERY = 1000  # SQLite VM instructions between deadline checks

FENCED_SQL_RE = re.compile(r"```[ \t]*sql[^\n]*\n(.*?)(?:```|$)", re.IGNORECASE | re.DOTALL)
FENCED_ANY_RE = re.compile(r"```[^\n]*\n(.*?)(?:```|$)", re.DOTALL)
BLANK_LINE_RE = re.compile(r"\n[ \t]*\n")
ORDER_BY_RE = re.compile(r"\border\s+by\b", re.IGNORECASE)

# Authorizer allow-list: everything not listed here is denied.
_ALLOWED_ACTIONS = frozenset({
    sqlite3.SQLITE_SELECT,
    sqlite3.SQLITE_READ,
    sqlite3.SQLITE_FUNCTION,
    sqlite3.SQLITE_RECURSIVE,
})
_DENIED_FUNCTIONS = frozenset({"load_extension"})


def extract_sql(response: str) -> str | None:
    """The first SQL statement of a model response (without its ``;``), or None if there is none."""
    m = FENCED_SQL_RE.search(response) or FENCED_ANY_RE.search(response)
    text = m.group(1) if m else BLANK_LINE_RE.split(response.strip(), maxsplit=1)[0]
    sql = _first_statement(text).strip()
    return sql or None


def _first_statement(text: str) -> str:
    """Text up to the first ``;`` that ends a complete statement (``;`` inside literals is kept)."""
    for i, ch in enumerate(text):
        if ch == ";" and sqlite3.complete_statement(text[: i + 1]):
            return text[:i]
    return text


def _authorizer(action: int, arg1: str | None, arg2: str | None, db: str | None, trigger: str | None) -> int:
    if action not in _ALLOWED_ACTIONS:
        return sqlite3.SQLITE_DENY
    if action == sqlite3.SQLITE_FUNCTION and (arg2 or "").lower() in _DENIED_FUNCTIONS:
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK


def connect_readonly(path: str | Path) -> sqlite3.Connection:
    """Open ``path`` with ``mode=ro`` and the read-only authorizer installed.

    The caller still runs untrusted SQL only on a copy (see :func:`execute_readonly`); this
    connection is the second line of defence.
    """
    uri = Path(path).resolve().as_uri() + "?mode=ro"
    conn = sqlite3.connect(uri, uri=True, isolation_level=None)
    conn.set_authorizer(_authorizer)
    return conn


class ResultTooLarge(sqlite3.DatabaseError):
    """A query returned more rows than the row cap."""


def _run(conn: sqlite3.Connection, sql: str, timeout_s: float, max_rows: int) -> list[tuple[Any, ...]]:
    deadline = time.monotonic() + timeout_s
    conn.set_progress_handler(lambda: int(time.monotonic() > deadline), PROGRESS_EVERY)
    try:
        cur = conn.execute(sql)
        rows = cur.fetchmany(max_rows + 1)
        if len(rows) > max_rows:
            raise ResultTooLarge(f"query returned more than {max_rows} rows")
        return rows
    finally:
        conn.set_progress_handler(None, 0)


def execute_readonly(db_path: str | Path, sql: str, timeout_s: float = DEFAULT_TIMEOUT_S,
                     max_rows: int = DEFAULT_MAX_ROWS) -> list[tuple[Any, ...]]:
    """Rows of ``sql`` run on a temporary read-only copy of ``db_path``; raises sqlite3 errors."""
    return _execute_many(db_path, [sql], timeout_s, max_rows)[0]


def _execute_many(db_path: str | Path, sqls: list[str], timeout_s: float,
                  max_rows: int) -> list[list[tuple[Any, ...]]]:
    with tempfile.TemporaryDirectory(prefix="lorazor-sql-") as tmp:
        copy = Path(tmp) / "db.sqlite"
        shutil.copyfile(db_path, copy)
        conn = connect_readonly(copy)
        try:
            return [_run(conn, s, timeout_s, max_rows) for s in sqls]
        finally:
            conn.close()


def results_match(pred: list[tuple[Any, ...]], gold: list[tuple[Any, ...]], ordered: bool) -> bool:
    """Row lists equal in order (``ordered``) or as multisets."""
    if ordered:
        return pred == gold
    return Counter(pred) == Counter(gold)


def execution_match(response: str, gold_sql: str, db_path: str | Path,
                    timeout_s: float = DEFAULT_TIMEOUT_S, max_rows: int = DEFAULT_MAX_ROWS) -> int:
    """1 iff the response's SQL returns the same rows as ``gold_sql`` on ``db_path``; never raises.

    ``db_path`` must exist (resolve it with :func:`labeling.tasks.spider.database_path`, which raises
    the clear error); a path that vanished in between scores 0 like any other execution failure.
    """
    pred_sql = extract_sql(response)
    if pred_sql is None:
        return 0
    try:
        gold_rows, pred_rows = _execute_many(db_path, [gold_sql, pred_sql], timeout_s, max_rows)
    except Exception:  # malformed SQL, denied action, timeout, unreadable copy: wrong answer
        return 0
    return int(results_match(pred_rows, gold_rows, ordered=bool(ORDER_BY_RE.search(gold_sql))))
