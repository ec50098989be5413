"""Run independent batches in processes forked from this one, one torch thread each.

Semantics: ``map_batches(fn, n, workers)`` yields ``(i, fn(i))`` for every ``i < n``, each exactly
once, in the order they finish. With ``workers`` > 1 it forks ``workers - 1`` children that share
this process's memory as it is at the call (the model, the callbacks' state); this process works
too. Each index is claimed from a shared counter, computed by one process, and its value returned
to this one (pickled through a pipe between these processes; nothing is written to disk). Work a
child does to objects of this process (a callback's dict) stays in the child: ``fn`` must return
everything the caller needs. A batch's value does not depend on which process ran it, because
every process runs the same code on the same state in one thread. A child that fails or dies
fails the call with its error; children die with this process (Linux: ``PR_SET_PDEATHSIG``).
"""
from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import pickle
import signal
import traceback
from collections.abc import Callable, Iterator
from queue import Empty
from typing import Any

import torch


def available_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


AUTO_ENV = "LORAZOR_HF_WORKERS"  # a number: what engine.workers=auto means in this environment


def resolve_workers(option: str | int, device: torch.device) -> int:
    """``engine.workers``: ``auto`` is one worker per available core when torch runs on one thread
    on the CPU (``OMP_NUM_THREADS=1``, as ``make demo`` sets), else 1: torch's own threads already
    use the cores. ``LORAZOR_HF_WORKERS=N`` makes ``auto`` N (``make test`` sets 1: its pytest
    workers already fill the cores; any other value is a ValueError). A number is taken as it is.
    On a GPU there is one worker."""
    if device.type != "cpu":
        return 1
    if option == "auto":
        env = os.environ.get(AUTO_ENV)
        if env is None:
            return available_cores() if torch.get_num_threads() == 1 else 1
        if not (env.isdigit() and int(env) >= 1):
            raise ValueError(f"{AUTO_ENV}={env!r}: use a whole number of worker processes (1 or more) for "
                             "engine.workers=auto, or unset it")
        return int(env)
    return int(option)


class WorkerError(RuntimeError):
    """A forked batch worker failed or died."""


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def map_batches(fn: Callable[[int], Any], n: int, workers: int) -> Iterator[tuple[int, Any]]:
    """(module docstring)"""
    workers = max(1, min(workers, n))
    if workers == 1:
        for i in range(n):
            yield i, fn(i)
        return
    ctx = mp.get_context("fork")
    counter = ctx.Value("i", 0)
    queue = ctx.Queue()

    def claim() -> int | None:
        with counter.get_lock():
            i = counter.value
            counter.value += 1
        return i if i < n else None

    def child() -> None:
        _die_with_parent()
        torch.set_num_threads(1)
        code = 0
        try:
            while (i := claim()) is not None:
                queue.put((i, pickle.dumps(fn(i)), None))
        except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
            queue.put((None, None, traceback.format_exc()))
            code = 1
        queue.close()
        queue.join_thread()
        os._exit(code)

    procs = [ctx.Process(target=child, daemon=True) for _ in range(workers - 1)]
    for p in procs:
        p.start()
    received = 0
    try:
        while (i := claim()) is not None:
            yield i, fn(i)
            received += 1
            while not queue.empty() and received < n:
                yield _receive(queue.get())
                received += 1
        while received < n:
            try:
                item = queue.get(timeout=1.0)
            except Empty:  # is every child still alive?
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise WorkerError(f"hf batch worker {dead[0].pid} died (exit code {dead[0].exitcode})") from None
                continue
            yield _receive(item)
            received += 1
    finally:
        for p in procs:
            if p.is_alive() and received < n:
                p.kill()
            p.join()
        queue.close()


def _receive(item: tuple[int | None, bytes | None, str | None]) -> tuple[int, Any]:
    i, payload, error = item
    if error is not None:
        raise WorkerError(f"an hf batch worker failed:\n{error}")
    return i, pickle.loads(payload)  # noqa: S301 - from a child of this process, not from a file
