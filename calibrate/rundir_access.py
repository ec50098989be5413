"""One writer per run directory, and a directory checked before a run writes anything there.

:func:`acquire` is the first thing a run does to its directory (docs/design.md §3): it creates
the directory if needed, checks that it can be used (a directory, not under a file, writable,
its bookkeeping entries directories, :data:`FREE_SPACE_FLOOR` bytes free for the stages'
scratch output), then takes an exclusive ``flock`` on ``<run>/.lock`` and writes its PID
there; :func:`release` empties the file again and drops the lock. The kernel drops the lock
when the process exits or is killed, so a killed run never leaves a stale lock (only its PID
in the file, which the next holder overwrites); the file itself stays. A second
run on the same directory does not wait: it stops with one line naming the holder's PID.
Every problem is a :class:`RunDirError` (one line, exit code 2 on the command line).
"""
from __future__ import annotations

import errno
import fcntl
import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

LOCK_FILE = ".lock"
FREE_SPACE_FLOOR = 64 << 20  # bytes a run needs free before it starts (scratch output, markers, shards)
PID_WAIT_S = 2.0  # how long a refused run waits for the holder to finish writing its PID
# errnos of a file system that cannot take the run's writes (full, over quota, read-only): a user's
# environment, not a bug, wherever they happen; and those of a directory this process may not write
STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)
DENIED_ERRNOS = (errno.EACCES, errno.EPERM)


class RunDirError(ValueError):
    """A run directory that cannot be used (a file, read-only, full, in use by another run)."""


def storage_error(err: OSError, doing: str) -> RunDirError:
    """``err`` (one of :data:`STORAGE_ERRNOS` or :data:`DENIED_ERRNOS`) while ``doing`` as one line
    with the fix."""
    where = f" ({err.filename})" if err.filename else ""
    fix = ("free some space" if err.errno in (errno.ENOSPC, errno.EDQUOT)
           else "choose a writable hydra.run.dir, or copy the run directory to a writable place")
    return RunDirError(f"{doing}: {err.strerror or err}{where}; {fix} and run again (finished stages are kept).")


def make_run_dir(root: Path) -> None:
    """Create ``root`` (and its parents) if missing; RunDirError naming the file in the way, or
    why it cannot be created."""
    for p in (root, *root.parents):
        if p.exists() and not p.is_dir():
            what = "is a file" if p == root else f"is under {p}, which is a file"
            raise RunDirError(f"run directory {root} {what}; choose another hydra.run.dir or move the file away.")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        if err.errno not in (*STORAGE_ERRNOS, *DENIED_ERRNOS):
            raise
        raise storage_error(err, f"run directory {root} cannot be created") from None


def check_usable(root: Path, dirs: Iterable[str], need_bytes: int = FREE_SPACE_FLOOR) -> None:
    """RunDirError unless ``root`` is a directory whose entries ``dirs`` are directories (or
    absent), with ``need_bytes`` free on its file system; creates ``root`` if missing."""
    make_run_dir(root)
    for name in dirs:
        p = root / name
        if os.path.lexists(p) and (p.is_symlink() or not p.is_dir()):
            raise RunDirError(f"{p} is not a directory, but the run keeps its {name} there; move it away "
                              f"or choose another hydra.run.dir.")
    free = shutil.disk_usage(root).free
    if free < need_bytes:
        raise RunDirError(f"run directory {root}: only {free >> 20} MiB free on its file system, a run needs "
                          f"{need_bytes >> 20} MiB for its scratch output; free some space or choose another "
                          f"hydra.run.dir.")


def _holder(fd: int) -> str:
    """The PID the lock's holder wrote into the lock file (it writes it right after locking)."""
    deadline = time.monotonic() + PID_WAIT_S
    while True:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        if text.isdigit() or time.monotonic() > deadline:
            return f"PID {text}" if text.isdigit() else "a process that has not written its PID"
        time.sleep(0.05)


def acquire(root: Path, dirs: Iterable[str] = (), need_bytes: int = FREE_SPACE_FLOOR) -> int:
    """Check ``root`` (:func:`check_usable`) and lock it for this process; return the lock's file
    descriptor (closing it releases the lock). RunDirError if another process holds it."""
    check_usable(root, dirs, need_bytes)
    path = root / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as err:
        if err.errno not in (*STORAGE_ERRNOS, *DENIED_ERRNOS):
            raise
        raise storage_error(err, f"run directory {root} is not writable") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise RunDirError(f"run directory {root} is in use by another run ({holder}); wait for it to finish, "
                          f"or choose another hydra.run.dir.") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as err:
        os.close(fd)
        if err.errno not in (*STORAGE_ERRNOS, *DENIED_ERRNOS):
            raise
        raise storage_error(err, f"run directory {root} is not writable") from None
    return fd


def release(fd: int) -> None:
    """Empty the lock file (no PID: nobody holds it) and drop the lock taken by :func:`acquire`."""
    try:
        os.ftruncate(fd, 0)
    finally:
        os.close(fd)
