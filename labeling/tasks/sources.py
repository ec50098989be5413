"""Split loading through `datasets`: hub ids or local JSON/JSONL, with the paper's splits.

Validation is carved from the official train split with a fixed seed; the official test
split is kept as is. ``source`` is either a hub id (``openai/gsm8k``) or a local directory
holding ``train.jsonl`` / ``test.jsonl`` (``.json`` also accepted).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from labeling.options import CheckedOptions
from labeling.tasks.base import SPLITS, TaskError


def local_source(source: str) -> Path | None:
    """``source`` as a local directory path if it names one (or looks like a path), else None (a hub id)."""
    looks_local = bool(source) and (source.startswith((".", "/", "~")) or Path(source).expanduser().exists())
    return Path(source).expanduser() if looks_local else None


def official_file(task: str, root: Path, official: str) -> str:
    """The local file of official split ``official`` under ``root`` (``.jsonl`` or ``.json``)."""
    if not root.is_dir():
        raise TaskError(f"task '{task}': local dataset path {root} does not exist. Fix task.source.")
    for ext in (".jsonl", ".json"):
        f = root / f"{official}{ext}"
        if f.is_file():
            return str(f)
    raise TaskError(
        f"task '{task}': local dataset {root} has no {official}.jsonl or {official}.json. "
        f"Point task.source at a directory holding the official splits, or at a hub id."
    )


def load_official(task: str, source: str, official: str, hub_config: str | None = None) -> list[dict[str, Any]]:
    """Rows of one official split (``train`` or ``test`` / ``validation``) as dicts."""
    import datasets

    root = local_source(source)
    if root is not None:
        path = official_file(task, root, official)
        if not Path(path).read_text().strip():  # datasets' json builder fails obscurely on empty files
            return []
        ds = datasets.load_dataset("json", data_files={official: path}, split=official)
    else:
        try:
            ds = datasets.load_dataset(source, hub_config, split=official)
        except Exception as e:  # network, auth, unknown id: one message, cause kept
            raise TaskError(
                f"task '{task}': could not load hub dataset '{source}' split '{official}': {e}. "
                f"Offline? Download it once or set task.source to a local directory."
            ) from e
    return [dict(r) for r in ds]


def carve_validation(rows: list[dict[str, Any]], split: str, val_size: int, seed: int) -> list[dict[str, Any]]:
    """Deterministically split official train rows into our train / validation."""
    import random

    if split not in ("train", "validation"):
        raise ValueError(f"carve_validation handles train/validation, not {split!r}")
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    val_size = min(val_size, len(rows))
    picked = order[:val_size] if split == "validation" else sorted(order[val_size:])
    return [rows[i] for i in (sorted(picked) if split == "validation" else picked)]


@dataclass
class PaperSplitOptions(CheckedOptions):
    """The options of a task split by :func:`paper_split`: ``val_size`` rows of the official train
    split become the validation split, chosen with ``seed``. Each subclass declares the task's
    ``source`` (hub id or local directory) and ``max_new_tokens`` with their defaults."""

    rules = {"source": "text", "max_new_tokens": "positive_int", "val_size": "non_negative_int", "seed": "integer"}

    val_size: int = 500
    seed: int = 1234


def paper_split(task: str, source: str, split: str, val_size: int, seed: int, test_split: str = "test",
                hub_config: str | None = None,
                keep: Callable[[dict[str, Any]], bool] | None = None) -> list[dict[str, Any]]:
    """Rows of ``split`` as the paper splits them: ``test`` is the official ``test_split``;
    ``train``/``validation`` are carved from the official train split (fixed ``seed``).
    ``keep`` filters rows before the carve (e.g. ScienceQA's text-only rows)."""
    check_split(split)
    rows = load_official(task, source, test_split if split == "test" else "train", hub_config=hub_config)
    if keep is not None:
        rows = [r for r in rows if keep(r)]
    return rows if split == "test" else carve_validation(rows, split, val_size, seed)


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {SPLITS}")
