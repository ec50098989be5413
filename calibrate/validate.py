"""Validate every input the config names before any work starts.

:func:`validate` runs before the first stage (and so before any model loads). It checks:

- the task's local data files (JSON lines or a JSON array): each line valid UTF-8 and strict,
  bounded JSON (no duplicate keys, lone surrogates, NaN, integers beyond int64, nesting past
  32 levels, lines past 16 MiB), an object with the task's fields of the right type, each
  field of one type across rows, and what the task itself asks of a row (a GSM8K answer's
  reference is not a special number such as NaN or Infinity); each part of a mix task so;
- Spider's databases: every database the splits name exists and reads as SQLite (opened
  read-only and immutable, so nothing is ever written next to it);
- every adapter against the backbone (:func:`labeling.adapters.validate_adapter`), that the
  backbone's configured source exists (:func:`labeling.backbone.resolve_backbone_dir`), and that
  the task's ``max_new_tokens`` lies below the backbone's context (every generation is bounded);
- that the run directory and the run's inputs (data files, databases, adapters, the backbone's
  local source) are disjoint, compared by identity (:func:`serve_bridge.safe_write.inside`): the
  run never writes over, deletes or adds to an input;
- the engines the run will use, against this machine (:mod:`calibrate.engine_check`).

The config's own values are checked earlier: Hydra checks keys and types while composing, and
each config dataclass its values when the :class:`~calibrate.context.Context` builds it
(:func:`calibrate.config.check_config`). A problem raises a :data:`calibrate.errors.UserError`
whose message is one line naming the setting or ``file:line`` and the fix; nothing is written
anywhere.
"""
from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

from calibrate.context import Context
from calibrate.engine_check import check_engine
from calibrate.rundir_access import RunDirError
from labeling.backbone import backbone_source
from labeling.tasks import TaskError
from labeling.tasks.mix import MixTask
from labeling.tasks.sources import load_official, local_source, official_file
from labeling.tasks.spider import SCHEMA_SQL, SpiderTask, database_path
from serve_bridge.safe_write import inside
from serve_bridge.strict_json import StrictJSONError, loads_strict

SQLITE_MAGIC = b"SQLite format 3\x00"
MAX_LINE_BYTES = 16 << 20  # one row of a JSON-lines file


def validate(ctx: Context) -> None:
    """Check the inputs ``ctx``'s config names and the engines it will use; raise a UserError on
    the first problem. Prints what the backbone loads from."""
    check_engine("engine=vllm", ctx.engine_options, ctx.facts)
    if ctx.cfg.agreement or "agreement" in ctx.cfg.stages:
        check_engine("agreement=true", ctx.agreement_options, ctx.facts)
    validate_task_data(ctx.task)
    check_disjoint(ctx.run.root, run_inputs(ctx))
    ctx.check_adapters()
    ctx.check_response_limit()
    print(f"backbone {ctx.backbone_spec.name}: {backbone_source(ctx.backbone_spec)}", flush=True)


# --- data ---------------------------------------------------------------------------------

def _json_type(v: Any) -> str:
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(v), "null")


def _rows(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) of a JSON-lines file, or of each element of a JSON array file,
    parsed strictly and bounded (:func:`serve_bridge.strict_json.loads_strict`: integers fit
    int64, as ``datasets`` stores them) with lines of at most :data:`MAX_LINE_BYTES`."""
    data = path.read_bytes()
    if path.suffix == ".json" and data.lstrip()[:1] == b"[":
        try:
            doc = loads_strict(data.decode("utf-8"), int_bits=63)
        except UnicodeDecodeError as err:
            line = data[:err.start].count(b"\n") + 1
            raise TaskError(f"{path}:{line}: not valid UTF-8 ({err.reason}).") from err
        except StrictJSONError as err:
            raise TaskError(f"{path}:{err.lineno or 1}: not valid JSON ({err}).") from err
        yield from ((1, row) for row in doc)
        return
    for lineno, raw in enumerate(data.split(b"\n"), 1):
        if len(raw) > MAX_LINE_BYTES:
            raise TaskError(f"{path}:{lineno}: a line of {len(raw)} bytes, more than the {MAX_LINE_BYTES} a row "
                            f"may take; one JSON object per line.")
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise TaskError(f"{path}:{lineno}: not valid UTF-8 ({err.reason} at byte {err.start}).") from err
        if not line.strip():
            continue
        try:
            yield lineno, loads_strict(line, int_bits=63)
        except StrictJSONError as err:
            at = f" at column {err.colno}" if err.colno else ""
            raise TaskError(f"{path}:{lineno}: not valid JSON ({err}{at}).") from err


def check_rows_file(what: str, path: Path, fields: dict[str, tuple[type, ...]],
                    row_problem: Callable[[dict[str, Any]], str | None] | None = None) -> list[dict[str, Any]]:
    """The rows of a local data file that ``what`` (e.g. "task 'gsm8k'") reads, each checked (see
    the module docstring; ``row_problem`` says what else is wrong with a row, or None); TaskError
    naming ``file:line`` on the first bad one."""
    rows, first_type = [], {}
    for lineno, row in _rows(path):
        where = f"{path}:{lineno}"
        if not isinstance(row, dict):
            raise TaskError(f"{where}: a JSON {_json_type(row)}, expected an object with fields {sorted(fields)}.")
        for key, types in fields.items():
            if row.get(key) is None:
                raise TaskError(f"{where}: missing field {key!r}; {what} needs {sorted(fields)}.")
            if not isinstance(row[key], types) or (isinstance(row[key], bool) and bool not in types):
                raise TaskError(f"{where}: field {key!r} is a JSON {_json_type(row[key])}, expected "
                                f"{' or '.join(_json_type(t()) for t in types)}.")
        problem = row_problem(row) if row_problem is not None else None
        if problem:
            raise TaskError(f"{where}: {problem}.")
        for key, value in row.items():
            kind = _json_type(value)
            if kind == "null":
                continue
            seen = first_type.setdefault(key, (kind, lineno))
            if seen[0] != kind:
                raise TaskError(f"{where}: field {key!r} is a JSON {kind} here but a {seen[0]} on line {seen[1]}; "
                                f"a field must have one type in every row.")
        rows.append(row)
    return rows


def _split_files(task: Any) -> list[Path]:
    """The local official split files a task reads (none for a generated task or a hub id)."""
    root = local_source(task.source) if hasattr(task, "source") else None  # arith generates its rows
    if root is None:
        return []
    return [Path(official_file(task.name, root, official)) for official in ("train", getattr(task, "test_split", "test"))]


def task_inputs(task: Any) -> list[Path]:
    """The local files and directories a task reads: its split files and Spider's database folder,
    each part's for a mix task."""
    if isinstance(task, MixTask):
        return [p for part in task.parts.values() for p in task_inputs(part)]
    db_dir = task.db_dir if isinstance(task, SpiderTask) else None
    return _split_files(task) + ([Path(db_dir)] if db_dir else [])


def run_inputs(ctx: Context) -> list[Path]:
    """Every local input of the run: the task's (:func:`task_inputs`), the adapters, and the
    backbone's GGUF folder or local model directory."""
    b = ctx.backbone_spec
    backbone = [Path(b.gguf_dir)] if b.gguf_dir else [Path(b.hf_id)] if b.hf_id and local_source(b.hf_id) else []
    return task_inputs(ctx.task) + [Path(a.path) for a in ctx.adapters] + backbone


def check_disjoint(root: Path, inputs: list[Path]) -> None:
    """RunDirError unless the run directory ``root`` and every input lie apart (by identity): an
    input inside the run directory would be replaced by the run's outputs, and a run directory
    inside an input would add the run's files to it."""
    for source in inputs:
        if inside(source, root):
            raise RunDirError(f"{source} is an input of the run but lies inside its run directory {root}, whose "
                              f"entries the run replaces; move the input out, or choose another hydra.run.dir.")
        if inside(root, source):
            raise RunDirError(f"run directory {root} lies inside {source}, an input of the run; choose a "
                              f"hydra.run.dir outside the run's inputs.")


def validate_task_data(task: Any) -> None:
    """Check a task's local split files and, for Spider, every database its splits name; each
    part's for a mix task."""
    if isinstance(task, MixTask):
        for part in task.parts.values():
            validate_task_data(part)
        return
    files, rows = _split_files(task), []
    for path in files:
        rows += check_rows_file(f"task '{task.name}'", path, task.required_fields, task.row_problem)
    if isinstance(task, SpiderTask):
        if not files:
            rows = [r for official in ("train", task.test_split)
                    for r in load_official(task.name, task.source, official, hub_config=task.hub_config)]
        for db_id in sorted({str(r.get("db_id")) for r in rows}):
            check_database(database_path(task.db_dir, db_id))


def check_database(path: Path) -> None:
    """TaskError unless ``path`` is an intact SQLite database; reads it immutably (no journal files)."""
    with open(path, "rb") as f:
        if f.read(len(SQLITE_MAGIC)) != SQLITE_MAGIC:
            raise TaskError(f"task 'spider': {path} is not an SQLite database (bad header); restore it from the "
                            f"Spider release.")
    try:
        conn = sqlite3.connect(f"file:{quote(str(path))}?mode=ro&immutable=1", uri=True)
        try:
            check = conn.execute("PRAGMA quick_check").fetchone()
            conn.execute(SCHEMA_SQL).fetchall()
        finally:
            conn.close()
    except sqlite3.DatabaseError as err:
        raise TaskError(f"task 'spider': {path} is a corrupt SQLite database ({err}); restore it from the "
                        f"Spider release.") from err
    if check is None or check[0] != "ok":
        raise TaskError(f"task 'spider': {path} fails SQLite's integrity check ({check[0] if check else '?'}); "
                        f"restore it from the Spider release.")
