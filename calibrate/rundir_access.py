"""One writer per run directory, and a directory checked before a run writes anything there.

:func:`acquire` is the first thing a run does to its directory (docs/design.md §3): it creates
the directory if needed, checks that it can be used (a directory, not under a file, on a file
system with storage, writable, its bookkeeping entries directories and its lock record not one,
:data:`FREE_SPACE_FLOOR` bytes free for the stages' scratch output), then takes an exclusive
``flock`` on the run directory itself and records its PID in ``<run>/.lock``; :func:`release`
records that nobody holds it (an empty ``.lock``) and drops the lock. The lock is a property of
the directory, not of the file at ``.lock``: the record is replaced by a rename, never written
into, so a ``.lock`` that is a hard link (a ``cp -al`` copy of a run directory shares it with the
original), a symbolic link or a FIFO is replaced and the file it shared an inode with is left as
it was, and a copy is locked independently of its original. The kernel drops the lock when the
process exits or is killed, so a killed run never leaves a stale lock (only its PID in the
record, which the next holder replaces). A second run on the same directory does not wait: it
stops with one line naming the holder's PID. Every problem is a :class:`RunDirError` (one line,
exit code 2 on the command line).
"""
from __future__ import annotations

import errno
import fcntl
import os
import shutil
import stat
import time
from collections.abc import Iterable
from pathlib import Path

from serve_bridge.safe_write import without_storage, write_atomic

LOCK_FILE = ".lock"
FREE_SPACE_FLOOR = 64 << 20  # bytes a run needs free before it starts (scratch output, markers, shards)
PID_WAIT_S = 2.0  # how long a refused run waits for the holder to finish writing its PID
# errnos of a file system that cannot take the run's writes (full, over quota, read-only): a user's
# environment, not a bug, wherever they happen; and those of a directory this process may not write
STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)
DENIED_ERRNOS = (errno.EACCES, errno.EPERM)
PATH_ERRNOS = (errno.ENAMETOOLONG, errno.ELOOP)  # a hydra.run.dir that cannot name a directory


class RunDirError(ValueError):
    """A run directory that cannot be used (a file, read-only, full, in use by another run)."""


def storage_error(err: OSError, doing: str) -> RunDirError:
    """``err`` (one of :data:`STORAGE_ERRNOS`, :data:`DENIED_ERRNOS` or :data:`PATH_ERRNOS`) while
    ``doing`` as one line with the fix."""
    where = f" ({err.filename})" if err.filename else ""
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = "free some space"
    elif err.errno in PATH_ERRNOS:
        fix = "choose another hydra.run.dir"
    else:
        fix = "choose a writable hydra.run.dir, or copy the run directory to a writable place"
    return RunDirError(f"{doing}: {err.strerror or err}{where}; {fix} and run again (finished stages are kept).")


def make_run_dir(root: Path) -> None:
    """Create ``root`` (and its parents) if missing; RunDirError naming the file in the way, a
    file system without storage (a pseudo-file system), or why it cannot be created."""
    for p in (root, *root.parents):
        if os.path.lexists(p) and not os.path.isdir(p):
            kind = "a file" if os.path.exists(p) else "a symbolic link to nothing (or a loop of them)"
            what = f"is {kind}" if p == root else f"is under {p}, which is {kind}"
            raise RunDirError(f"run directory {root} {what}; choose another hydra.run.dir or move the file away.")
    if without_storage(root):
        raise RunDirError(f"run directory {root} is on a file system without storage (a pseudo-file system such as "
                          f"/proc or /sys); choose another hydra.run.dir.")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        if err.errno not in (*STORAGE_ERRNOS, *DENIED_ERRNOS, *PATH_ERRNOS):
            raise
        raise storage_error(err, f"run directory {root} cannot be created") from None


def check_usable(root: Path, dirs: Iterable[str], need_bytes: int = FREE_SPACE_FLOOR) -> None:
    """RunDirError unless ``root`` is a directory whose entries ``dirs`` are directories (or
    absent) and whose lock record is not one, with ``need_bytes`` free on its file system;
    creates ``root`` if missing."""
    make_run_dir(root)
    for name in dirs:
        p = root / name
        if os.path.lexists(p) and (p.is_symlink() or not p.is_dir()):
            raise RunDirError(f"{p} is not a directory, but the run keeps its {name} there; move it away "
                              f"or choose another hydra.run.dir.")
    record = root / LOCK_FILE
    if record.is_dir() and not record.is_symlink():
        raise RunDirError(f"{record} is a directory, but the run keeps its lock record there; move it away "
                          f"or choose another hydra.run.dir.")
    free = shutil.disk_usage(root).free
    if free < need_bytes:
        raise RunDirError(f"run directory {root}: only {free >> 20} MiB free on its file system, a run needs "
                          f"{need_bytes >> 20} MiB for its scratch output; free some space or choose another "
                          f"hydra.run.dir.")


def _read_record(record: Path) -> str:
    """The text of the lock record (at most 32 bytes); "" where it is missing or not a regular file."""
    try:
        fd = os.open(record, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return ""
    try:
        return os.read(fd, 32).decode("ascii", "replace").strip() if stat.S_ISREG(os.fstat(fd).st_mode) else ""
    finally:
        os.close(fd)


def _holder_unless_freed(fd: int, record: Path) -> str | None:
    """The PID the lock's holder recorded (it records it right after locking), waiting up to
    :data:`PID_WAIT_S` for it; None where the holder let go meanwhile (a short run ends, writing an
    empty record) and this process took the lock on ``fd``."""
    deadline = time.monotonic() + PID_WAIT_S
    while True:
        text = _read_record(record)
        if text.isdigit():
            return f"PID {text}"
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return None
        except BlockingIOError:
            pass
        if time.monotonic() > deadline:
            return "a process that has not written its PID"
        time.sleep(0.05)


def acquire(root: Path, dirs: Iterable[str] = (), need_bytes: int = FREE_SPACE_FLOOR) -> int:
    """Check ``root`` (:func:`check_usable`), lock it for this process and record this process's PID
    in its ``.lock``; return the locked directory's file descriptor (closing it releases the lock).
    RunDirError if another process holds it, naming its PID; a holder that lets go while this waits
    for that PID (:data:`PID_WAIT_S`) hands the lock over instead."""
    check_usable(root, dirs, need_bytes)
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as err:
        if err.errno not in DENIED_ERRNOS:
            raise
        raise storage_error(err, f"run directory {root} cannot be opened") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        if (holder := _holder_unless_freed(fd, root / LOCK_FILE)) is not None:
            os.close(fd)
            raise RunDirError(f"run directory {root} is in use by another run ({holder}); wait for it to finish, "
                              f"or choose another hydra.run.dir.") from None
    try:
        write_atomic(root / LOCK_FILE, f"{os.getpid()}\n")
    except OSError as err:
        os.close(fd)
        if err.errno not in (*STORAGE_ERRNOS, *DENIED_ERRNOS):
            raise
        raise storage_error(err, f"run directory {root} is not writable") from None
    return fd


def release(root: Path, fd: int) -> None:
    """Record that nobody holds ``root`` (an empty ``.lock``; left as it is where the file system no
    longer takes writes) and drop the lock that :func:`acquire` returned ``fd`` for."""
    try:
        write_atomic(root / LOCK_FILE, "")
    except OSError as err:
        if err.errno not in (*STORAGE_ERRNOS, *DENIED_ERRNOS):
            raise
    finally:
        os.close(fd)
