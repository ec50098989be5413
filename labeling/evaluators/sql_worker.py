"""The SQL sandbox's worker process: runs read-only queries on private database copies.

Started by :class:`labeling.evaluators.sql.SqlSandbox` as ``python -I -S <this file>``: the
standard library only, no site packages, no environment. Before reading any request it caps
its own address space (``RLIMIT_AS``, first argument, bytes), disables core dumps and
replies once (ready).

Protocol, one request per line on stdin (JSON), one reply per request on stdout::

    {"op": "open", "db": path, "timeout_s": s}      -> prepare and open the copy at ``path``
    {"op": "query", "sql": text, "timeout_s": s,
     "max_rows": n, "max_bytes": b}                  -> run it on the open copy
    {"op": "close"}                                  -> close the copy

A reply is ``<length>\\n`` followed by that many bytes of UTF-8: a JSON object header line
(``{"ok": true}`` or ``{"error": class name, "message": text}``), then for a query one JSON
array per row. Values are JSON numbers, strings and nulls; a blob is ``{"b64": base64}``.

"open" checkpoints a WAL copy into its main file and switches the copy to a rollback journal,
so the read-only connection needs no ``-shm``/``-wal`` files; then it opens the copy with
``mode=ro`` and the read-only authorizer. A query streams rows one at a time and stops as soon
as the encoded rows would exceed ``max_bytes`` or ``max_rows``: nothing past the cap is sent
(a row whose strings and blobs alone exceed the cap is not even encoded). A progress handler interrupts a
query at its ``timeout_s`` (the parent kills the worker if that is not enough).
"""
from __future__ import annotations

import base64
import json
import resource
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

PROGRESS_EVERY = 1000  # SQLite VM instructions between deadline checks
MAX_MESSAGE = 500  # characters of an error message in a reply

# Authorizer allow-list: everything not listed here is denied.
_ALLOWED_ACTIONS = frozenset({
    sqlite3.SQLITE_SELECT,
    sqlite3.SQLITE_READ,
    sqlite3.SQLITE_FUNCTION,
    sqlite3.SQLITE_RECURSIVE,
})
_DENIED_FUNCTIONS = frozenset({"load_extension"})
_ERROR_CLASSES = ("OperationalError", "IntegrityError", "ProgrammingError", "DataError", "NotSupportedError",
                  "InterfaceError", "DatabaseError", "ResultTooLarge", "SandboxError")


def _authorizer(action: int, arg1: str | None, arg2: str | None, db: str | None, trigger: str | None) -> int:
    if action not in _ALLOWED_ACTIONS:
        return sqlite3.SQLITE_DENY
    if action == sqlite3.SQLITE_FUNCTION and (arg2 or "").lower() in _DENIED_FUNCTIONS:
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK


def connect_readonly(path: str | Path) -> sqlite3.Connection:
    """Open ``path`` with ``mode=ro`` and the read-only authorizer installed.

    Used only on private copies (a ``mode=ro`` open of a WAL database may still create its
    ``-shm`` file); the authorizer is the second line of defence after ``mode=ro``.
    """
    uri = Path(path).resolve().as_uri() + "?mode=ro"
    conn = sqlite3.connect(uri, uri=True, isolation_level=None)
    conn.set_authorizer(_authorizer)
    return conn


def checkpoint_copy(path: str | Path) -> None:
    """Fold a copied ``-wal`` into ``path`` and make it a rollback-journal database (a copy only)."""
    conn = sqlite3.connect(str(path), isolation_level=None)
    try:
        if conn.execute("PRAGMA journal_mode").fetchone()[0].lower() == "wal":
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            conn.execute("PRAGMA journal_mode=DELETE")
    finally:
        conn.close()


class _Stop(Exception):
    """A cap was hit: (class name, message) for the reply."""


def _deadline_handler(timeout_s: float):
    deadline = time.monotonic() + timeout_s
    return lambda: int(time.monotonic() > deadline)


def _encode(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"b64": base64.b64encode(value).decode("ascii")}
    return value


def _rows(conn: sqlite3.Connection, req: dict[str, Any]) -> list[bytes]:
    max_rows, max_bytes = int(req["max_rows"]), int(req["max_bytes"])
    conn.set_progress_handler(_deadline_handler(float(req["timeout_s"])), PROGRESS_EVERY)
    out: list[bytes] = []
    size = 0
    try:
        for row in conn.execute(req["sql"]):
            if len(out) >= max_rows:
                raise _Stop("ResultTooLarge", f"query returned more than {max_rows} rows")
            if size + sum(len(v) for v in row if isinstance(v, (str, bytes))) > max_bytes:  # before encoding it
                raise _Stop("ResultTooLarge", f"query result exceeds {max_bytes} bytes")
            line = json.dumps([_encode(v) for v in row], ensure_ascii=False).encode("utf-8")
            size += len(line) + 1
            if size > max_bytes:
                raise _Stop("ResultTooLarge", f"query result exceeds {max_bytes} bytes")
            out.append(line)
    finally:
        conn.set_progress_handler(None, 0)
    return out


def _reply(header: dict[str, Any], rows: list[bytes] = ()) -> None:
    body = b"\n".join([json.dumps(header).encode("utf-8"), *rows])
    sys.stdout.buffer.write(b"%d\n" % len(body) + body)
    sys.stdout.buffer.flush()


def _error(err: BaseException) -> dict[str, str]:
    if isinstance(err, _Stop):
        return {"error": err.args[0], "message": err.args[1]}
    if isinstance(err, MemoryError):
        return {"error": "SandboxError", "message": "query ran out of the sandbox's memory"}
    name = type(err).__name__
    message = str(err)  # SQLite's messages are short; Python's may quote a value: cut it
    return {"error": name if name in _ERROR_CLASSES else "DatabaseError",
            "message": message if len(message) <= MAX_MESSAGE else message[:MAX_MESSAGE] + "..."}


def serve(lines) -> None:
    """Answer each request line until stdin closes."""
    conn: sqlite3.Connection | None = None
    for line in lines:
        try:
            req = json.loads(line)
            if req["op"] == "open":
                if conn is not None:
                    conn.close()
                conn = None
                checkpoint_copy(req["db"])
                conn = connect_readonly(req["db"])
                _reply({"ok": True})
            elif req["op"] == "query":
                if conn is None:
                    raise _Stop("SandboxError", "no database is open")
                _reply({"ok": True}, _rows(conn, req))
            elif req["op"] == "close":
                if conn is not None:
                    conn.close()
                conn = None
                _reply({"ok": True})
            else:
                raise _Stop("SandboxError", f"unknown request {str(req['op'])[:40]!r}")
        except Exception as err:  # every failure is a reply; the parent decides what it means
            _reply(_error(err))


def main() -> None:
    limit = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    _reply({"ok": True})  # ready
    serve(sys.stdin.buffer)


if __name__ == "__main__":
    main()
