"""Validate the whole config and every input before any work starts.

:func:`validate` runs before the first stage (and so before any model loads). It checks:

- every config value the pipeline uses: types, ranges and names (stages, task options and
  split sizes, backbone, engine, labeling points, predictor, sweep, export rule and budget);
- the task's local data files (JSON lines or a JSON array): each line valid UTF-8 and JSON,
  an object with the task's fields of the right type, each field of one type across rows;
- Spider's databases: every database the splits name exists and reads as SQLite (opened
  read-only and immutable, so nothing is ever written next to it);
- every adapter against the backbone (:func:`labeling.adapters.validate_adapter`).

A problem raises a :data:`calibrate.errors.UserError` whose message is one line naming the
setting or ``file:line`` and the fix; nothing is written anywhere.
"""
from __future__ import annotations

import inspect
import json
import math
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from calibrate.context import Context
from calibrate.errors import ConfigError
from labeling.backbone import DTYPES
from labeling.tasks.spider import database_path
from labeling.tasks import REGISTRY, SPLITS, MixTask, TaskError, build_task
from labeling.tasks.sources import load_official, local_source, official_file
from labeling.tasks.spider import SCHEMA_SQL, SpiderTask
from predictors.frontier import POLICIES, parse_rule

SQLITE_MAGIC = b"SQLite format 3\x00"
ENGINES = ("auto", "hf", "vllm")
VLLM_DTYPES = ("bfloat16", "float16", "float32", "auto")


def validate(ctx: Context) -> None:
    """Check ``ctx``'s config and inputs; raise a UserError on the first problem."""
    validate_config(ctx.cfg)
    validate_task_data(ctx.task)
    ctx.check_adapters()


# --- config -------------------------------------------------------------------------------

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _need(ok: bool, key: str, value: Any, wanted: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r}: {wanted}.")


def positive_int(key: str, v: Any) -> None:
    _need(_is_int(v) and v >= 1, key, v, "use a positive integer")


def nonneg_int(key: str, v: Any) -> None:
    _need(_is_int(v) and v >= 0, key, v, "use a non-negative integer")


def optional_positive_int(key: str, v: Any) -> None:
    _need(v is None or (_is_int(v) and v >= 1), key, v, "use a positive integer or null")


def any_int(key: str, v: Any) -> None:
    _need(_is_int(v), key, v, "use an integer")


def positive_number(key: str, v: Any) -> None:
    _need(_is_number(v) and v > 0, key, v, "use a positive number")


def boolean(key: str, v: Any) -> None:
    _need(isinstance(v, bool), key, v, "use true or false")


def text(key: str, v: Any) -> None:
    _need(isinstance(v, str) and v.strip() != "", key, v, "use a non-empty string")


def optional_text(key: str, v: Any) -> None:
    _need(v is None or (isinstance(v, str) and v.strip() != ""), key, v, "use a non-empty string or null")


def int_list(key: str, v: Any) -> None:
    """A non-empty list of non-negative integers."""
    _need(isinstance(v, list) and len(v) > 0 and all(_is_int(x) and x >= 0 for x in v), key, v,
          "use a non-empty list of non-negative integers")


def one_of(choices: tuple[str, ...]) -> Callable[[str, Any], None]:
    def check(key: str, v: Any) -> None:
        _need(v in choices, key, v, f"use one of {list(choices)}")
    return check


def at_most_one(key: str, v: Any) -> None:
    _need(_is_number(v) and 0 < v <= 1, key, v, "use a number in (0, 1]")


# Known task options and their rule (the task classes take them as keyword arguments).
TASK_OPTIONS: dict[str, Callable[[str, Any], None]] = {
    "max_new_tokens": positive_int, "seed": any_int, "val_size": nonneg_int, "timeout_s": positive_number,
    "source": text, "db_dir": optional_text, "test_split": text, "hub_config": optional_text, "extractor": text,
}
ENGINE_OPTIONS: dict[str, dict[str, Callable[[str, Any], None]]] = {
    "auto": {"progress": boolean},
    "hf": {"device": text, "batch_size": positive_int, "progress": boolean},
    "vllm": {"dtype": one_of(VLLM_DTYPES), "gpu_memory_utilization": at_most_one,
             "max_num_seqs": optional_positive_int, "max_num_batched_tokens": optional_positive_int,
             "max_model_len": optional_positive_int, "tensor_parallel_size": positive_int,
             "data_parallel_size": positive_int, "enforce_eager": boolean,
             "max_cudagraph_capture_size": optional_positive_int, "progress": boolean, "pipeline": boolean,
             "prefix_caching": boolean},
}


def _section(cfg: DictConfig, name: str) -> dict[str, Any]:
    if name not in cfg or not isinstance(cfg[name], DictConfig):
        raise ConfigError(f"config group {name!r} is missing; pick one with {name}=<option> (see conf/{name}/).")
    return OmegaConf.to_container(cfg[name], resolve=True)  # type: ignore[return-value]


def validate_config(cfg: DictConfig) -> None:
    """Check every config value the pipeline uses; raise ConfigError (TaskError for an unknown task)."""
    try:
        sections = {name: _section(cfg, name) for name in
                    ("task", "backbone", "adapter", "engine", "labeling", "predictor", "sweep", "export")}
    except OmegaConfBaseException as err:  # an interpolation that does not resolve, e.g. ${oops}
        raise ConfigError(f"the config does not resolve: {str(err).splitlines()[0]}") from err
    stages = cfg.get("stages")
    _need(OmegaConf.is_list(stages) and len(stages) > 0 and all(isinstance(s, str) for s in stages),
          "stages", stages, "use a non-empty list of stage names")
    boolean("agreement", cfg.get("agreement", False))
    any_int("seed", cfg.get("seed", 0))
    _validate_task(sections["task"])
    _validate_backbone(sections["backbone"])
    _validate_adapters(sections["adapter"])
    _validate_engine(sections["engine"])
    lab = sections["labeling"]
    int_list("labeling.points", lab.get("points"))
    task_points = lab.get("task_points") or {}
    _need(isinstance(task_points, dict), "labeling.task_points", task_points,
          "use a mapping of task names to lists of release points")
    for name, points in task_points.items():
        int_list(f"labeling.task_points.{name}", points)
    shard = lab.get("shard_requests", "auto")
    _need(shard == "auto" or (str(shard).isdigit() and int(shard) >= 1), "labeling.shard_requests", shard,
          "use a positive integer or auto")
    positive_number("predictor.lam", sections["predictor"].get("lam"))
    sweep = sections["sweep"]
    positive_int("sweep.n_tau", sweep.get("n_tau"))
    int_list("sweep.ks", sweep.get("ks"))
    _validate_export(sections["export"])


def _validate_task(task: dict[str, Any]) -> None:
    name = task.get("name")
    if name == MixTask.name:
        _validate_mix(task)
        return
    if name not in REGISTRY:
        build_task(str(name))  # raises the TaskError that names the known tasks
    options = task.get("options") or {}
    _need(isinstance(options, dict), "task.options", options, "use a mapping of option names to values")
    accepted = set(inspect.signature(REGISTRY[name].__init__).parameters) - {"self", "sizes"}
    for key, value in options.items():
        if key not in accepted:
            raise ConfigError(f"task.options.{key}: task {name!r} has no such option; it takes "
                              f"{sorted(accepted)}.")
        if key in TASK_OPTIONS:
            TASK_OPTIONS[key](f"task.options.{key}", value)
    sizes = task.get("sizes") or {}
    _need(isinstance(sizes, dict), "task.sizes", sizes, "use a mapping split → size")
    for key, value in sizes.items():
        if key not in SPLITS:
            raise ConfigError(f"task.sizes.{key}: no such split; use {list(SPLITS)}.")
        _need(value is None or (_is_int(value) and value >= 0), f"task.sizes.{key}", value,
              "use a positive integer (the split's first rows) or null (all rows)")
        if value == 0:
            raise TaskError(f"task.sizes.{key}=0: split '{key}' would be empty; use a positive integer or null.")


def _validate_mix(task: dict[str, Any]) -> None:
    """A mix task: no sizes of its own, only ``parts``, each part a registered task's own config."""
    options = task.get("options") or {}
    _need(isinstance(options, dict), "task.options", options, "use a mapping with `parts`")
    unknown = sorted(set(options) - {"parts"})
    if unknown:
        raise ConfigError(f"task.options.{unknown[0]}: task 'mix' takes only `parts`.")
    parts = options.get("parts") or {}
    _need(isinstance(parts, dict) and len(parts) > 0, "task.options.parts", parts,
          "name at least one task, e.g. parts: {arith: {}, counter: {}} (conf/task/demo.yaml)")
    for part, spec in parts.items():
        spec = spec or {}
        _need(isinstance(spec, dict) and set(spec) <= {"options", "sizes"}, f"task.options.parts.{part}", spec,
              "use a mapping with `options` and `sizes`")
        if part == MixTask.name:
            raise ConfigError("task.options.parts.mix: a part cannot itself be a mix.")
        _validate_task({"name": part, "options": spec.get("options"), "sizes": spec.get("sizes")})
    if any(v is not None for v in (task.get("sizes") or {}).values()):
        raise ConfigError("task.sizes: task 'mix' takes sizes per part (task.options.parts.<part>.sizes).")


def _validate_backbone(b: dict[str, Any]) -> None:
    text("backbone.name", b.get("name"))
    _need(b.get("dtype", "float32") in DTYPES, "backbone.dtype", b.get("dtype"), f"use one of {sorted(DTYPES)}")
    for key in ("hf_id", "gguf_package", "gguf_file", "gguf_dir"):
        optional_text(f"backbone.{key}", b.get(key))
    if b.get("gguf_package") or b.get("gguf_dir"):
        text("backbone.gguf_file", b.get("gguf_file"))
    elif not b.get("hf_id"):
        raise ConfigError(f"backbone {b.get('name')!r}: set backbone.hf_id (hub id or local directory) "
                          f"or backbone.gguf_package with backbone.gguf_file.")
    stops = b.get("extra_stop_tokens") or []
    _need(isinstance(stops, list) and all(isinstance(s, str) and s for s in stops), "backbone.extra_stop_tokens",
          stops, "use a list of token strings")


def _validate_adapters(a: dict[str, Any]) -> None:
    adapters = a.get("adapters")
    _need(isinstance(adapters, list), "adapter.adapters", adapters, "use a list of {name, path}")
    for i, entry in enumerate(adapters):
        _need(isinstance(entry, dict) and {"name", "path"} <= set(entry), f"adapter.adapters[{i}]", entry,
              "use {name: <serving name>, path: <peft directory>}")
        text(f"adapter.adapters[{i}].name", entry["name"])
        text(f"adapter.adapters[{i}].path", entry["path"])


def _validate_engine(e: dict[str, Any]) -> None:
    name = e.get("name")
    _need(name in ENGINES, "engine", name, "use engine=auto (the default), engine=hf (transformers + peft) or engine=vllm (GPU)")
    for key, check in ENGINE_OPTIONS[name].items():
        if key in e:
            check(f"engine.{key}", e[key])
    if name == "vllm":
        rank = e.get("max_lora_rank", "auto")
        _need(rank == "auto" or (_is_int(rank) and rank >= 1), "engine.max_lora_rank", rank,
              "use a positive integer or auto")


def _validate_export(ex: dict[str, Any]) -> None:
    _need(_is_number(ex.get("budget")) and ex["budget"] >= 0, "export.budget", ex.get("budget"),
          "use a non-negative number of accuracy points")
    rule = ex.get("rule")
    _need(isinstance(rule, str), "export.rule", rule, "use P<percent> (e.g. P50) or budget")
    if rule != "budget":
        try:
            parse_rule(rule)
        except ValueError as err:
            raise ConfigError(f"export.rule={rule!r}: use P<percent> with 0 < percent ≤ 100 (e.g. P50) or "
                              f"budget (the largest skip within export.budget points).") from err
    _need(ex.get("policy") in POLICIES, "export.policy", ex.get("policy"), f"use one of {list(POLICIES)}")
    if "table_format" in ex:
        _need(ex["table_format"] == "csv", "export.table_format", ex["table_format"], "use csv")


# --- data ---------------------------------------------------------------------------------

def _json_type(v: Any) -> str:
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(v), "null")


def _rows(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) of a JSON-lines file, or of each element of a JSON array file."""
    data = path.read_bytes()
    if path.suffix == ".json" and data.lstrip()[:1] == b"[":
        try:
            doc = json.loads(data.decode("utf-8"))
        except UnicodeDecodeError as err:
            line = data[:err.start].count(b"\n") + 1
            raise TaskError(f"{path}:{line}: not valid UTF-8 ({err.reason}).") from err
        except json.JSONDecodeError as err:
            raise TaskError(f"{path}:{err.lineno}: not valid JSON ({err.msg}).") from err
        yield from ((1, row) for row in doc)
        return
    for lineno, raw in enumerate(data.split(b"\n"), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise TaskError(f"{path}:{lineno}: not valid UTF-8 ({err.reason} at byte {err.start}).") from err
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as err:
            raise TaskError(f"{path}:{lineno}: not valid JSON ({err.msg} at column {err.colno}).") from err


def check_rows_file(task: str, path: Path, fields: dict[str, tuple[type, ...]]) -> list[dict[str, Any]]:
    """The rows of a local split file, each checked (see the module docstring); TaskError naming
    ``file:line`` on the first bad one."""
    rows, first_type = [], {}
    for lineno, row in _rows(path):
        where = f"{path}:{lineno}"
        if not isinstance(row, dict):
            raise TaskError(f"{where}: a JSON {_json_type(row)}, expected an object with fields {sorted(fields)}.")
        for key, types in fields.items():
            if row.get(key) is None:
                raise TaskError(f"{where}: missing field {key!r}; task '{task}' needs {sorted(fields)}.")
            if not isinstance(row[key], types) or (isinstance(row[key], bool) and bool not in types):
                raise TaskError(f"{where}: field {key!r} is a JSON {_json_type(row[key])}, expected "
                                f"{' or '.join(_json_type(t()) for t in types)}.")
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


def validate_task_data(task: Any) -> None:
    """Check a task's local split files and, for Spider, every database its splits name."""
    root = local_source(task.source) if hasattr(task, "source") else None  # arith generates its rows
    rows: list[dict[str, Any]] = []
    if root is not None:
        for official in ("train", getattr(task, "test_split", "test")):
            rows += check_rows_file(task.name, Path(official_file(task.name, root, official)), task.required_fields)
    if isinstance(task, SpiderTask):
        if root is None:
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
