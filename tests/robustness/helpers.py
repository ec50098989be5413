"""Builders and checks shared by the robustness battery: small adapters, Spider data, tree digests,
the one-line contract of a command and a time limit for work that must be bounded."""
from __future__ import annotations

import hashlib
import json
import signal
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

HIDDEN = 576  # the embedded backbone's hidden size
BACKBONE_NAMES = ["smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "/cache/lorazor/backbones/smollm2"]
PREFIX = "base_model.model.model.layers.0.self_attn"


def digest(root: Path, skip: tuple[str, ...] = (".hydra",)) -> dict[str, str]:
    """sha256 of every file under ``root`` (relative paths), skipping top-level names in ``skip``
    and Hydra's job logs."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if p.is_file() and rel.parts[0] not in skip and p.suffix != ".log":
            out[rel.as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def make_adapter(d: Path, *, r: int = 4, hidden: int = HIDDEN, config: dict[str, Any] | None = None,
                 tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """A peft-style LoRA directory (q_proj and v_proj of layer 0) with ``config`` merged into its config."""
    d.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
           "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct", **(config or {})}
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors is None:
        g = torch.Generator().manual_seed(0)
        tensors = {f"{PREFIX}.{m}.lora_{ab}.weight": torch.randn(*shape, generator=g)
                   for m in ("q_proj", "v_proj") for ab, shape in (("A", (r, hidden)), ("B", (hidden, r)))}
    save_file(tensors, str(d / "adapter_model.safetensors"))
    return d


def make_database(path: Path, wal: bool = False, singers: list[tuple[str, int]] | None = None) -> Path:
    """A small SQLite database with two tables (optionally in WAL mode): ``singers`` as the
    (name, age) rows of ``singer`` (ids 1, 2, …; names unique, so it has an index), by default 200
    made-up ones; ``concert`` empty."""
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path)
    if wal:
        conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE singer (id INTEGER PRIMARY KEY, name TEXT UNIQUE, age INTEGER)")
    conn.execute("CREATE TABLE concert (id INTEGER PRIMARY KEY, singer_id INTEGER, year INTEGER)")
    rows = [(f"s{i}", 20 + i) for i in range(200)] if singers is None else singers
    conn.executemany("INSERT INTO singer (name, age) VALUES (?, ?)", rows)
    conn.commit()
    conn.close()
    return path


def spider_rows(n: int, db_id: str = "concert_singer") -> list[dict[str, Any]]:
    return [{"db_id": db_id, "query": "SELECT count(*) FROM singer", "question": f"How many singers? ({i})"}
            for i in range(n)]


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def exit_code(call: Callable[[], int | None]) -> int:
    """What a command's ``main`` ends with: its return value, or the code it exits with."""
    try:
        return call() or 0
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else 1


def assert_one_error_line(err: str, fragment: str) -> None:
    """``err`` (a command's stderr) is exactly one line, ``error: …`` holding ``fragment``."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], err


class Overran(Exception):
    """Raised into a block that ran past its :func:`time_limit`."""


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Stop the block with a TimeoutError once it has run ``seconds`` (SIGALRM: main thread only)."""
    def expire(signum: int, frame: Any) -> None:
        raise Overran

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    except Overran:
        raise TimeoutError(f"still running after {seconds} s") from None  # where it stopped says nothing
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
