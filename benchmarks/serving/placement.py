"""Where the modes of a serving table run (``--gpus``): one after another on the GPU vLLM picks, or
at once, one GPU each, so that a table whose servers do not fit one call one after another (the chat
benchmark's five, each an estimated 200-260 s of start-up under vLLM's default compilation) fits one
call on a machine with as many GPUs.

Semantics: each GPU takes the next mode of ``--modes`` once its previous mode has ended, while
``--min-mode-s`` of the call's budget is left (else the table notes the mode as not run). A mode on
a named GPU sees only that GPU (``CUDA_VISIBLE_DEVICES``, for its server and the processes it
prepares with) and compiles into that GPU's vLLM cache (``VLLM_CACHE_ROOT`` under ``--work``):
vLLM 0.33.0 writes its compile cache's index in place (``compilation/backends.py:233-237``) under a
key that the lorazor and gridtrim modes share (the same traced files and config,
``backends.py:1060-1098``), so two of them starting at once must not read each other's half-written
file (vLLM puts Inductor's and Triton's caches there too: docs/vllm_integration.md §12c). Modes on
one GPU run one after another, so they share its cache: a mode whose key an earlier mode (or an
earlier table with the same ``--work``) compiled starts from the cache, as a restarted server does.
The clients (``vllm bench serve``) use no GPU and are not placed. Every server keeps vLLM's defaults, including
its share of the GPU's memory, whatever runs on the other GPUs.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from serve_bridge.command_line import fail

ALL = "all"
# Held while a table's document gains a key or is written: modes that run at once fill their entries
# while another thread writes the table, and a dict that gains a key during json's walk breaks it.
TABLE = threading.RLock()
Gpu = str | None  # a CUDA_VISIBLE_DEVICES entry, or None: whatever the harness's environment gives
F = TypeVar("F", bound=Callable[..., Any])


class GpuList(argparse.Action):
    """``--gpus all`` or ``--gpus ID [ID ...]`` (non-negative integers as nvidia-smi numbers the GPUs,
    each once); anything else is the parser's one-line error."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if values != [ALL]:
            bad = next((v for v in values if not v.isdigit()), None)
            if bad is not None:
                parser.error(f"argument {option_string}: {bad!r}: give 'all' alone or GPU numbers (0, 1, ...)")
            if len(set(values)) != len(values):
                parser.error(f"argument {option_string}: {' '.join(values)}: each GPU once")
        setattr(namespace, self.dest, values)


def add_argument(ap: argparse.ArgumentParser) -> None:
    """``--gpus`` (:class:`GpuList`); default: the modes one after another, not placed."""
    ap.add_argument("--gpus", nargs="+", action=GpuList, default=None, metavar="ID",
                    help="GPUs to run the modes on at once, one server per GPU: numbers as nvidia-smi gives them, "
                         "or 'all' (those visible); default: one mode after another on the GPU vLLM picks")


def visible_gpus(environ: Mapping[str, str]) -> list[str]:
    """The GPUs a process started with ``environ`` may use: ``CUDA_VISIBLE_DEVICES``'s entries when it
    is set, else the indices ``nvidia-smi`` lists (none without it)."""
    if "CUDA_VISIBLE_DEVICES" in environ:
        return [g.strip() for g in environ["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    if shutil.which("nvidia-smi") is None:
        return []
    out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True)
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def resolve(gpus: Sequence[str] | None, port: int, environ: Mapping[str, str]) -> list[Gpu]:
    """The GPUs of ``--gpus`` (``all``: :func:`visible_gpus`, ``[None]`` when there are none);
    ``[None]`` without it. A fixed ``--port`` with more than one GPU is refused (one line, exit 2):
    servers that run at once need ports of their own."""
    placed: list[Gpu] = list(visible_gpus(environ) if gpus == [ALL] else gpus or [])
    if len(placed) > 1 and port:
        fail(f"--port={port}: names one server's port; with --gpus of {len(placed)} GPUs the servers run at once, "
             "leave --port out")
    return placed or [None]


def compile_cache(work: Path, name: str) -> dict[str, str]:
    """A vLLM cache of its own (``work/vllm-cache/<name>``) for a vLLM process that starts beside
    others of the same configuration (module doc)."""
    return {"VLLM_CACHE_ROOT": str(work / "vllm-cache" / name)}


def env(gpu: Gpu, work: Path) -> dict[str, str]:
    """The environment a mode's processes add on ``gpu`` (module doc): that GPU alone and its compile
    cache; nothing when not placed."""
    return {} if gpu is None else {"CUDA_VISIBLE_DEVICES": gpu} | compile_cache(work, f"gpu{gpu}")


def serialized(fn: F) -> F:
    """``fn`` called under :data:`TABLE` (a table written by the modes that run at once)."""
    def call(*args: Any, **kwargs: Any) -> Any:
        with TABLE:
            return fn(*args, **kwargs)

    return call  # type: ignore[return-value]


def run_modes(doc: dict[str, Any], args: argparse.Namespace, gpus: Sequence[Gpu], start: float, deadline: float,
              run: Callable[[str, dict[str, Any], Gpu], None], flush: Callable[[], None]) -> int:
    """Each of ``args.modes`` on the next free one of ``gpus`` (module doc), its fresh entry of
    ``doc`` filled by ``run(mode, entry, gpu)``; the table flushed last. 1 when a mode stopped with
    an error, else 0. An exception that is not a mode's error (a harness bug) is raised."""
    queue, ran = list(args.modes), []

    def worker(gpu: Gpu) -> None:
        while True:
            with TABLE:
                if not queue:
                    return
                mode, left = queue.pop(0), deadline - time.monotonic()
                if left < args.min_mode_s:
                    doc["notes"].append(f"{mode}: not run, {left:.0f} s of the {args.budget_s:.0f} s budget left")
                    continue
                entry = doc["modes"][mode] = {"facts": [] if gpu is None else [f"GPU {gpu}"], "rows": [],
                                              "error": None}
                ran.append(entry)
            where = "" if gpu is None else f" on GPU {gpu}"
            print(f"[{time.monotonic() - start:5.0f} s] {mode}: starting{where} ({left:.0f} s left)", flush=True)
            run(mode, entry, gpu)

    if len(gpus) == 1:
        worker(gpus[0])
    else:
        with ThreadPoolExecutor(len(gpus)) as pool:
            for done in [pool.submit(worker, g) for g in gpus]:
                done.result()
    flush()
    return int(any(entry["error"] is not None for entry in ran))


def concurrent_servers(gpus: Sequence[Gpu], modes: Sequence[str], with_lora: Callable[[str], bool]) -> int:
    """The most servers with adapters that run at once: one per GPU, at most one per such mode."""
    return max(1, min(len(gpus), sum(map(with_lora, modes))))
