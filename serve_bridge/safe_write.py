"""Writing a command's outputs without writing over its inputs or over a file it did not create.

- :func:`same_file` and :func:`inside` compare paths by identity (device and inode), so a hard
  link, a symbolic link or another spelling of a path is still that path.
- :func:`check_output` refuses, before anything is written, an output path that is an input,
  lies inside an input directory or holds an input; one that already exists unless the user
  asked to replace it; and one whose place cannot take it (under a file, not writable, on a file
  system without storage such as /proc). Each refusal is an OptionError naming the argument.
- :func:`write_atomic` writes a file under a temporary name beside it, created afresh, and renames
  it into place: readers never see half a file, and a hard link or symbolic link at the path (or at
  the temporary name, left by an interrupted write) is replaced, never written through.
  :func:`scratch_dir_for` and :func:`publish_dir` do the same for a directory.
- :func:`own_file` gives a file that shares its inode with another name a copy of its own, so
  that appending to it changes nothing outside.
"""
from __future__ import annotations

import os
import shutil
import stat
import uuid
from collections.abc import Iterable
from pathlib import Path

from serve_bridge.values import OptionError


def _identity(path: str | os.PathLike[str]) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def same_file(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Whether ``a`` and ``b`` both exist and are the same file or directory (device and inode)."""
    ia = _identity(a)
    return ia is not None and ia == _identity(b)


def inside(path: str | os.PathLike[str], root: str | os.PathLike[str]) -> bool:
    """Whether ``path`` (existing or not) is ``root`` or lies below it, by identity: each of its
    ancestors, symbolic links resolved, is compared with ``root``'s device and inode. A path whose
    links loop leads nowhere, so into no ``root``."""
    target = _identity(root)
    if target is None:
        return False
    try:
        p = Path(path).resolve()
    except (OSError, RuntimeError):  # a loop of symbolic links (RuntimeError before Python 3.13)
        return False
    return any(_identity(a) == target for a in (p, *p.parents))


def existing_ancestor(path: Path) -> Path:
    """``path`` itself if it exists, else its nearest existing ancestor."""
    p = Path(os.path.abspath(path))
    return next(a for a in (p, *p.parents) if os.path.lexists(a))


def without_storage(path: Path) -> bool:
    """Whether ``path`` (or, where it does not exist yet, its nearest existing ancestor) is on a file
    system that has no storage at all (a pseudo-file system such as /proc, /sys or cgroups)."""
    try:
        return os.statvfs(existing_ancestor(path)).f_blocks == 0
    except OSError:
        return False


def check_output(key: str, path: Path, inputs: Iterable[Path], *, directory: bool, replace: bool) -> None:
    """Refuse output ``path`` (the value of argument ``key``; a directory if ``directory``) with an
    OptionError unless it is disjoint from every input, new or ``replace``-able, and writable."""
    value = os.fspath(path)
    for source in inputs:
        if inside(path, source):
            where = "is" if same_file(path, source) else "lies inside"
            raise OptionError(key, value, f"{where} the command's input {os.fspath(source)}; write the output elsewhere")
        if inside(source, path):
            raise OptionError(key, value, f"holds the command's input {os.fspath(source)}; write the output elsewhere")
    if os.path.lexists(path):
        is_dir = path.is_dir() and not path.is_symlink()
        if is_dir != directory:
            raise OptionError(key, value, "is a directory; name a file" if is_dir else "exists and is not a directory")
        if not replace:
            raise OptionError(key, value, "exists; choose a new path, or pass --replace to replace it")
    parent = existing_ancestor(path.parent)
    if not parent.is_dir():
        raise OptionError(key, value, f"is under {os.fspath(parent)}, which is not a directory")
    if without_storage(parent):
        raise OptionError(key, value, f"is on a file system without storage ({os.fspath(parent)}); write it elsewhere")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OptionError(key, value, f"cannot be written: {os.fspath(parent)} is not writable")


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` under the temporary name ``.<name>.tmp`` beside it, created afresh
    (what an interrupted write left there is unlinked first), then rename it into place (creating
    the parent directories)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def remove(path: Path) -> None:
    """Delete ``path``: a directory with its contents, or a file or symbolic link (not its target)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def scratch_dir_for(path: Path) -> Path:
    """A new, empty directory beside ``path`` to assemble it in (then :func:`publish_dir`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_name(f".{path.name}.partial-{uuid.uuid4().hex[:8]}")
    scratch.mkdir()
    return scratch


def publish_dir(scratch: Path, path: Path) -> None:
    """Rename the assembled directory ``scratch`` to ``path``; an existing ``path`` (one the user
    asked to replace, :func:`check_output`) is moved aside first and deleted afterwards."""
    old = None
    if os.path.lexists(path):
        old = path.with_name(f".{path.name}.replaced-{uuid.uuid4().hex[:8]}")
        os.rename(path, old)
    os.rename(scratch, path)
    if old is not None:
        remove(old)


def publish_first(scratch: Path, path: Path) -> bool:
    """Rename the assembled directory ``scratch`` to ``path`` where nothing is there yet; where
    another process published ``path`` first (a non-empty directory), delete ``scratch`` and keep
    theirs. True iff this call published it."""
    try:
        os.rename(scratch, path)
        return True
    except OSError:
        if not path.is_dir():
            raise
        remove(scratch)
        return False


def own_file(path: Path) -> None:
    """If ``path`` is a regular file with more than one name (a hard link, e.g. in a ``cp -al``
    copy), replace it with a copy of its own (:func:`write_atomic`), so that writing to it changes
    no other name's file."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
        write_atomic(path, path.read_bytes())
