"""Spider execution match: run predicted and gold SQL in a sandbox on a private copy of the database.

Semantics of :func:`execution_match` (Q ∈ {0, 1}):

- The SQL is taken from the model response with :func:`extract_sql`: the first ```` ```sql ````
  fenced block (else the first bare ```` ``` ```` block), else the text up to the first blank
  line; in both cases only the first complete statement (up to its ``;``) is kept.
- Both queries run in a separate worker process (:class:`SqlSandbox`, :mod:`.sql_worker`) whose
  address space is capped, on a **private copy** of the database: the file and its ``-wal``
  are copied with plain reads into a temporary directory (SQLite never opens the original, so
  no ``-wal``/``-shm`` appears beside it), the copy's WAL is checkpointed into it, and the copy
  is opened with ``file:…?mode=ro`` and an authorizer that allows only reads (SELECT, column
  reads, scalar functions other than ``load_extension``, recursive CTEs). Every write, DDL,
  ATTACH/DETACH, PRAGMA, transaction or VACUUM is denied.
- Each query has a wall-clock timeout (default 5 s): the worker interrupts it then, and this
  process kills the worker if no reply came by 1.25× the timeout (a slow built-in function can
  outrun the interrupt). Results are capped in rows (default 100 000) and in bytes (default 32 MiB of the
  rows' UTF-8 JSON encoding, one line per row): the worker stops fetching at the cap, so no
  larger result reaches this process.
- The result rows are compared as multisets (row order ignored), unless the gold query has
  ``ORDER BY`` anywhere, in which case the row lists must be equal in order. Column order
  always matters; ``1 == 1.0`` as in Python.
- Any query failure (no SQL found, malformed SQL, denied action, timeout, cap exceeded, gold
  query failing, unreadable file) scores 0; :func:`execution_match` never raises for a bad
  response.

A prefix is decided (:func:`sql_decided`, without running anything) once its first ```` ```sql ````
block is closed or holds a complete statement: that block always wins, so no continuation
changes the SQL taken. Before that block a later one can still appear, so nothing is decided.

A missing database file is a configuration problem, not a wrong answer: the Spider task
resolves the path first (:func:`labeling.tasks.spider.database_path`, a TaskError naming the
``db_id``, the path and the fix).
"""
from __future__ import annotations

import atexit
import base64
import json
import os
import re
import select
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MAX_ROWS = 100_000  # a result larger than this is treated as a failed query
DEFAULT_MAX_BYTES = 32 << 20  # likewise for the result's encoded size (Spider's gold results are far smaller)
DEFAULT_MEMORY_BYTES = 1 << 30  # address-space cap of the worker process
KILL_AFTER = 1.25  # a query without a reply at this multiple of its timeout gets its worker killed
STARTUP_TIMEOUT_S = 10.0  # a worker that is not ready by then is an error
_REPLY_SLACK = 4096  # bytes a reply may hold beyond its byte cap (the header line)
_HEADER_MAX = 32  # bytes of a reply's length line

FENCED_SQL_RE = re.compile(r"```[ \t]*sql[^\n]*\n(.*?)(?:```|$)", re.IGNORECASE | re.DOTALL)
FENCED_ANY_RE = re.compile(r"```[^\n]*\n(.*?)(?:```|$)", re.DOTALL)
BLANK_LINE_RE = re.compile(r"\n[ \t]*\n")
ORDER_BY_RE = re.compile(r"\border\s+by\b", re.IGNORECASE)


def extract_sql(response: str) -> str | None:
    """The first SQL statement of a model response (without its ``;``), or None if there is none."""
    m = FENCED_SQL_RE.search(response) or FENCED_ANY_RE.search(response)
    text = m.group(1) if m else BLANK_LINE_RE.split(response.strip(), maxsplit=1)[0]
    sql = _first_statement(text).strip()
    return sql or None


def sql_decided(prefix: str) -> bool:
    """True only if every continuation of ``prefix`` yields the same :func:`extract_sql` (hence
    the same :func:`execution_match` score): its first ```` ```sql ```` block is closed, or the
    block so far holds a complete statement."""
    m = FENCED_SQL_RE.search(prefix)
    if m is None:
        return False
    body = m.group(1)
    return prefix.startswith("```", m.end(1)) or _first_statement(body) != body


def _first_statement(text: str) -> str:
    """Text up to the first ``;`` that ends a complete statement (``;`` inside literals is kept)."""
    for i, ch in enumerate(text):
        if ch == ";" and sqlite3.complete_statement(text[: i + 1]):
            return text[:i]
    return text


class ResultTooLarge(sqlite3.DatabaseError):
    """A query returned more rows or more bytes than its cap."""


class QueryTimeout(sqlite3.OperationalError):
    """A query ran past its timeout and was interrupted, or its worker killed."""


class SandboxError(sqlite3.DatabaseError):
    """The sandbox's worker failed: it died, broke the protocol or ran out of memory."""


_REPLY_ERRORS: dict[str, type[sqlite3.DatabaseError]] = {
    "OperationalError": sqlite3.OperationalError, "IntegrityError": sqlite3.IntegrityError,
    "ProgrammingError": sqlite3.ProgrammingError, "DataError": sqlite3.DataError,
    "NotSupportedError": sqlite3.NotSupportedError, "ResultTooLarge": ResultTooLarge,
    "SandboxError": SandboxError,
}


def _decode_value(obj: dict[str, str]) -> bytes:
    return base64.b64decode(obj["b64"])


def private_copy(db_path: str | Path, directory: Path) -> Path:
    """Copy ``db_path`` (and its ``-wal``, if any) into ``directory`` with plain file reads.

    The original is never opened by SQLite, so nothing (no ``-wal``/``-shm``) appears beside it.
    """
    src = Path(db_path)
    copy = directory / "db.sqlite"
    shutil.copyfile(src, copy)
    wal = src.with_name(src.name + "-wal")
    if wal.is_file():
        shutil.copyfile(wal, directory / "db.sqlite-wal")
    return copy


class SqlSandbox:
    """A worker process (:mod:`labeling.evaluators.sql_worker`) that runs queries for this process.

    The worker is started on first use (``python -I -S``: standard library only; its address
    space capped at ``memory_bytes``) and reused across queries, since starting one costs tens
    of milliseconds. Each query has a wall-clock ``timeout_s``: the worker interrupts it then,
    and if no reply has come at ``KILL_AFTER`` × ``timeout_s`` the worker is killed (the next
    query starts a new one, and waits for it outside its own timeout) and :class:`QueryTimeout`
    raised. A reply is read only up to the query's byte cap plus a small header: a larger one
    kills the worker. One query at a time per sandbox (a lock); a forked child starts its own.
    """

    def __init__(self, memory_bytes: int = DEFAULT_MEMORY_BYTES) -> None:
        self.memory_bytes = int(memory_bytes)
        self.starts = 0  # workers started so far
        self.last_reply_bytes = 0  # bytes read from the worker for the last query
        self.last_query_s = 0.0  # wall time of the last query, from sending it to its reply or its kill
        self._proc: subprocess.Popen | None = None
        self._dying: list[subprocess.Popen] = []  # killed, not yet reaped
        self._bytes_read = 0  # from all workers, replies of every kind
        self._ready = False
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def execute(self, db_path: str | Path, sqls: Sequence[str], timeout_s: float = DEFAULT_TIMEOUT_S,
                max_rows: int = DEFAULT_MAX_ROWS, max_bytes: int = DEFAULT_MAX_BYTES) -> list[list[tuple[Any, ...]]]:
        """Rows of each of ``sqls``, run in order on one private copy of ``db_path``.

        Raises the query's sqlite3 error, :class:`QueryTimeout`, :class:`ResultTooLarge` or
        :class:`SandboxError` at the first failure; OSError if ``db_path`` cannot be read;
        ValueError for a timeout that is not positive or a negative cap.
        """
        if not timeout_s > 0 or max_rows < 0 or max_bytes < 0:
            raise ValueError(f"SQL sandbox: timeout_s must be > 0 and the caps ≥ 0, got timeout_s={timeout_s}, "
                             f"max_rows={max_rows}, max_bytes={max_bytes}")
        with self._lock, tempfile.TemporaryDirectory(prefix="lorazor-sql-") as tmp:
            copy = private_copy(db_path, Path(tmp))
            self._call({"op": "open", "db": str(copy)}, timeout_s, 0)
            worker = self._proc
            try:
                return [self._query(sql, timeout_s, int(max_rows), int(max_bytes)) for sql in sqls]
            finally:
                if self._proc is worker:  # not killed (and replaced) meanwhile
                    try:
                        self._call({"op": "close"}, timeout_s, 0)
                    except sqlite3.DatabaseError:
                        self._kill()

    def start(self) -> None:
        """Start the worker now, if none is running, and wait until it is ready (else the first
        query does)."""
        with self._lock:
            self._worker()

    def _query(self, sql: str, timeout_s: float, max_rows: int, max_bytes: int) -> list[tuple[Any, ...]]:
        """One query on the open copy; sets :attr:`last_query_s` and :attr:`last_reply_bytes`."""
        start, read = time.monotonic(), self._bytes_read
        try:
            return self._call({"op": "query", "sql": sql, "timeout_s": timeout_s, "max_rows": max_rows,
                               "max_bytes": max_bytes}, timeout_s, max_bytes)
        finally:
            self.last_query_s = time.monotonic() - start
            self.last_reply_bytes = self._bytes_read - read

    def stop(self) -> None:
        """Kill the worker (if any) and reap every killed worker; the next query starts a new one."""
        self._kill()
        for proc in self._dying:
            proc.wait()
        self._dying.clear()

    def _kill(self) -> None:
        """Kill the worker without waiting for it: the kernel frees its memory while this process
        goes on, and it is reaped on a later call (:meth:`stop` waits)."""
        proc, self._proc = self._proc, None
        if proc is not None and self._pid == os.getpid():
            proc.kill()
            self._dying.append(proc)
        self._dying = [p for p in self._dying if p.poll() is None]

    def _spawn(self) -> None:
        """Start a worker (:meth:`_worker` then waits until it is ready)."""
        self._proc = subprocess.Popen(
            [sys.executable, "-I", "-S", str(Path(__file__).with_name("sql_worker.py")), str(self.memory_bytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
        self._ready = False
        self.starts += 1

    def _worker(self) -> subprocess.Popen:
        """The running worker, started and ready; its start does not count against a query's timeout."""
        if self._pid != os.getpid():  # a forked child: the workers belong to the parent
            self._proc, self._dying, self._pid = None, [], os.getpid()
        if self._proc is None or self._proc.poll() is not None:
            self._kill()
            self._spawn()
        if not self._ready:
            try:
                self._read_reply(self._proc, time.monotonic() + STARTUP_TIMEOUT_S, _REPLY_SLACK)
            except (QueryTimeout, SandboxError) as err:
                self._kill()
                raise SandboxError(f"the SQL sandbox's worker did not start: {err}") from None
            self._ready = True
        return self._proc

    def _call(self, request: dict[str, Any], timeout_s: float, max_bytes: int) -> list[tuple[Any, ...]]:
        """Send one request and return its rows; kill the worker on a timeout or a bad reply."""
        proc = self._worker()
        deadline = time.monotonic() + KILL_AFTER * timeout_s
        try:
            proc.stdin.write(json.dumps(request).encode() + b"\n")
            proc.stdin.flush()
            header, *lines = self._read_reply(proc, deadline, max_bytes + _REPLY_SLACK).split(b"\n")
            reply = json.loads(header)
            rows = [tuple(json.loads(r, object_hook=_decode_value)) for r in lines]
        except QueryTimeout:
            self._kill()
            raise QueryTimeout(f"interrupted: query ran past its timeout of {timeout_s:g} s; its worker was "
                               f"killed") from None
        except ResultTooLarge:
            self._kill()
            raise
        except (OSError, ValueError, KeyError, SandboxError) as err:
            self._kill()
            raise SandboxError(f"the SQL sandbox failed: {err}") from None
        if "error" in reply:
            message = reply["message"]
            if message == "interrupted":
                raise QueryTimeout(f"interrupted: query ran past its timeout of {timeout_s:g} s")
            raise _REPLY_ERRORS.get(reply["error"], sqlite3.DatabaseError)(message)
        return rows

    def _read_reply(self, proc: subprocess.Popen, deadline: float, limit: int) -> bytes:
        """One reply frame (``<length>\\n<body>``), read before ``deadline`` and at most ``limit`` bytes."""
        fd = proc.stdout.fileno()
        buf = bytearray()
        size = None
        while size is None or len(buf) < size:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise QueryTimeout("no reply in time")
            chunk = os.read(fd, _HEADER_MAX - len(buf) if size is None else min(1 << 16, size - len(buf)))
            if not chunk:
                raise SandboxError(f"worker exited (status {proc.poll()})")
            self._bytes_read += len(chunk)
            buf += chunk
            if size is None and b"\n" in buf:
                head, rest = bytes(buf).split(b"\n", 1)
                size, buf = int(head), bytearray(rest)
                if size > limit:
                    raise ResultTooLarge(f"query result exceeds {limit} bytes")
            elif size is None and len(buf) >= _HEADER_MAX:
                raise SandboxError("malformed reply")
        return bytes(buf)


_SANDBOX = SqlSandbox()
atexit.register(_SANDBOX.stop)


def execute_readonly(db_path: str | Path, sql: str, timeout_s: float = DEFAULT_TIMEOUT_S,
                     max_rows: int = DEFAULT_MAX_ROWS, max_bytes: int = DEFAULT_MAX_BYTES) -> list[tuple[Any, ...]]:
    """Rows of ``sql`` run in the sandbox on a private copy of ``db_path``; raises sqlite3 errors."""
    return _SANDBOX.execute(db_path, [sql], timeout_s, max_rows, max_bytes)[0]


def results_match(pred: list[tuple[Any, ...]], gold: list[tuple[Any, ...]], ordered: bool) -> bool:
    """Row lists equal in order (``ordered``) or as multisets."""
    if ordered:
        return pred == gold
    return Counter(pred) == Counter(gold)


def execution_match(response: str, gold_sql: str, db_path: str | Path, timeout_s: float = DEFAULT_TIMEOUT_S,
                    max_rows: int = DEFAULT_MAX_ROWS, max_bytes: int = DEFAULT_MAX_BYTES) -> int:
    """1 iff the response's SQL returns the same rows as ``gold_sql`` on ``db_path``; never raises.

    ``db_path`` must exist (resolve it with :func:`labeling.tasks.spider.database_path`, which raises
    the clear error); a path that vanished in between scores 0 like any other execution failure.
    """
    pred_sql = extract_sql(response)
    if pred_sql is None:
        return 0
    try:
        gold_rows, pred_rows = _SANDBOX.execute(db_path, [gold_sql, pred_sql], timeout_s, max_rows, max_bytes)
    except (sqlite3.Error, OSError):  # malformed SQL, denied action, timeout, cap, unreadable file: wrong answer
        return 0
    return int(results_match(pred_rows, gold_rows, ordered=bool(ORDER_BY_RE.search(gold_sql))))
