"""Run-directory layout and atomic stage commits.

Layout (all paths relative to the run directory)::

    .hydra/                 the composed config, as Hydra records it (written by calibrate/__main__.py)
    engine.json             the engine the run resolved to (engine=auto's choice) and why
    stages/<stage>.json     completion marker: {"fingerprint", "finished_at", "summary", "outputs"}
    data/<split>.jsonl      the examples each split resolved to (uid, question, reference)
    labels/shards/NNNNN.*   labeling shards (resumable), merged into
    labels/points.parquet   one row per (request, t): uid, adapter, t, y, q_on, q_off, lengths
    labels/features.npy     h_t per row of points.parquet, float32 [N, H]
    heads/heads.safetensors heads/heads.json
    sweep/trees.parquet     release trees of the validation pass
    sweep/*.csv             candidates, frontier, k table, selection, budget comparison
    bundle/                 the policy bundle (manifest.json, heads.safetensors)
    plots/*.png             frontier, k curves, positive rate per t, release histogram
    test/*.csv              realized test skip/accuracy of the exported policy
    agreement/agreement.csv with agreement=true: predicted vs realized on vLLM (plots/agreement.png)
    .lock                   the PID of the run holding the directory's lock (calibrate/rundir_access.py)
    .scratch/<stage>/       a running stage's outputs, laid out like the run directory
    .publishing/<stage>/    a finished stage's outputs while they are moved into place
    .trash/<stage>/         the outputs they replace, deleted once the move is complete

A stage is done when its marker exists with the current fingerprint (a hash of the config
it depends on, chained with its upstream stages' fingerprints), the marker lists every output
the stage must write (``required``) and every output it lists still has the sha256 recorded
there, and its input stages' outputs are those it read (the marker records a digest of them). Changing e.g. the label points re-runs labels
and everything after it; re-running a finished command is a no-op; an output changed or
truncated since it was written re-runs its stage.

Commit protocol: a stage writes only into ``.scratch/<stage>/``. When it returns, the
marker and the list of entries it replaces are written into the scratch directory, which
is then renamed to ``.publishing/<stage>/`` — the commit point. Publishing removes the old
marker, moves each replaced entry to ``.trash/``, renames each new entry into place and
renames the marker last. Every step is a rename that can be repeated, so :meth:`RunDir.recover`
finishes an interrupted publish on the next start, and a stage killed or failing before
its commit leaves the previous complete state (its scratch directory is discarded).
An entry is a top-level file or directory of the stage's output (``data``, ``bundle``…),
or one file of a directory that several stages share (``labels``, ``plots``).

Only the holder of the directory's lock (:meth:`RunDir.locked`) may begin, commit or recover
stages; ``run_pipeline`` takes it before anything else touches the directory.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from calibrate.rundir_access import acquire, release
from serve_bridge.bundle import file_sha256
from serve_bridge.safe_write import remove, write_atomic

SHARED_DIRS = ("labels", "plots")
SCRATCH, PUBLISHING, TRASH = ".scratch", ".publishing", ".trash"
MARKER, REPLACES = ".marker.json", ".replaces.json"
NOT_RUN, CONFIG_CHANGED = "not run yet", "its configuration changed"
# entries that must be directories where they exist (checked before a run starts)
LAYOUT_DIRS = ("stages", SCRATCH, PUBLISHING, TRASH, ".hydra", *SHARED_DIRS)


def fingerprint(*parts: Any) -> str:
    """A stable short hash of JSON-serializable parts."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def tree_hashes(root: Path) -> dict[str, str]:
    """sha256 of every regular file under ``root``, keyed by its path relative to ``root``."""
    return {p.relative_to(root).as_posix(): file_sha256(p) for p in sorted(root.rglob("*")) if p.is_file()}


def changed_file(root: Path, hashes: dict[str, str]) -> str | None:
    """The first file of ``hashes`` (relative to ``root``) that is missing or differs, else None."""
    for rel, digest in hashes.items():
        p = root / rel
        if not p.is_file():
            return f"{rel} is missing"
        if file_sha256(p) != digest:
            return f"{rel} differs from the sha256 its marker recorded"
    return None


def entries_of(outputs: dict[str, str]) -> list[str]:
    """The publish entries of a stage's output files (see the module docstring)."""
    out = set()
    for rel in outputs:
        parts = rel.split("/")
        out.add("/".join(parts[:2]) if parts[0] in SHARED_DIRS and len(parts) > 1 else parts[0])
    return sorted(out)


class RunDir:
    """A calibration run directory with verified, atomically published stage outputs."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.scratch: Path | None = None

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Check the directory and hold its exclusive lock (:func:`calibrate.rundir_access.acquire`,
        which creates it if missing) for the ``with`` block; RunDirError if it cannot be used or
        another run holds it."""
        fd = acquire(self.root, LAYOUT_DIRS)
        try:
            yield
        finally:
            release(self.root, fd)

    def path(self, *parts: str) -> Path:
        """A published path (read upstream outputs here); its parent directory exists."""
        p = self.root.joinpath(*parts)
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def out(self, *parts: str) -> Path:
        """Where the running stage writes ``parts`` (inside its scratch directory); the parent exists."""
        if self.scratch is None:
            raise RuntimeError("RunDir.out() outside a stage: call begin() first")
        p = self.scratch.joinpath(*parts)
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def _marker(self, stage: str) -> Path:
        return self.root / "stages" / f"{stage}.json"

    def _read_marker(self, stage: str) -> dict[str, Any] | None:
        try:
            return json.loads(self._marker(stage).read_text())
        except (OSError, ValueError):
            return None

    def output_digest(self, stage: str) -> str | None:
        """A hash of the output hashes ``stage``'s marker records (None without a marker)."""
        marker = self._read_marker(stage)
        return fingerprint(marker.get("outputs")) if isinstance(marker, dict) else None

    def stale(self, stage: str, fp: str, inputs: Sequence[str] = (), required: Sequence[str] = ()) -> str | None:
        """None iff ``stage`` finished with fingerprint ``fp``, its marker lists every output in
        ``required``, its outputs are intact and the outputs of its input stages ``inputs`` are
        those it read; else why not, in a few words."""
        m = self._marker(stage)
        if not m.exists():
            return NOT_RUN
        marker = self._read_marker(stage)
        if not isinstance(marker, dict) or not isinstance(marker.get("outputs"), dict):
            return f"its marker {m.relative_to(self.root)} is unreadable or records no output hashes"
        if marker.get("fingerprint") != fp:
            return CONFIG_CHANGED
        unlisted = [rel for rel in required if rel not in marker["outputs"]]
        if unlisted:
            return f"its marker records no {unlisted[0]}"
        for u in inputs:
            if (marker.get("inputs") or {}).get(u) != self.output_digest(u):
                return f"the output of stage {u!r} changed since it ran"
        return changed_file(self.root, marker["outputs"])

    def intact(self, stage: str, required: Sequence[str] = ()) -> str | None:
        """None iff ``stage`` has a marker listing ``required`` whose outputs are all intact
        (whatever its config), else why not."""
        marker = self._read_marker(stage)
        if marker is None:
            return NOT_RUN
        return self.stale(stage, marker.get("fingerprint", ""), required=required)

    def done(self, stage: str, fp: str, inputs: Sequence[str] = ()) -> bool:
        """True iff :meth:`stale` finds nothing."""
        return self.stale(stage, fp, inputs) is None

    def summary(self, stage: str) -> dict[str, Any]:
        """The summary a finished stage recorded."""
        return json.loads(self._marker(stage).read_text())["summary"]

    def begin(self, stage: str) -> Path:
        """Start ``stage``: a fresh, empty scratch directory that :meth:`out` writes into."""
        self.scratch = self.root / SCRATCH / stage
        remove(self.scratch)
        self.scratch.mkdir(parents=True)
        return self.scratch

    def discard(self, stage: str) -> None:
        """Drop the scratch output of a stage that failed or was interrupted."""
        remove(self.root / SCRATCH / stage)
        self.scratch = None
        self._tidy()

    def commit(self, stage: str, fp: str, summary: dict[str, Any], inputs: Sequence[str] = (),
               required: Sequence[str] = ()) -> None:
        """Publish the running stage's scratch output with its marker (see the module docstring),
        recording the outputs of its input stages ``inputs`` as read. A stage that did not write
        every output in ``required`` is a bug: RuntimeError, nothing published."""
        scratch, pending = self.root / SCRATCH / stage, self.root / PUBLISHING / stage
        if pending.exists():  # an earlier publish of this stage never finished: complete it first
            self._publish(stage)
        outputs = tree_hashes(scratch)
        absent = [rel for rel in required if rel not in outputs]
        if absent:
            raise RuntimeError(f"stage {stage!r} finished without writing {absent}")
        new = entries_of(outputs)
        old = self._read_marker(stage) or {}
        old_entries = entries_of(old["outputs"]) if isinstance(old.get("outputs"), dict) else []
        write_atomic(scratch / REPLACES, json.dumps(sorted(set(old_entries) - set(new))))
        write_atomic(scratch / MARKER, json.dumps(
            {"fingerprint": fp, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "summary": summary,
             "outputs": outputs, "inputs": {u: self.output_digest(u) for u in inputs}}, indent=2))
        pending.parent.mkdir(exist_ok=True)
        os.rename(scratch, pending)  # the commit point
        self.scratch = None
        self._publish(stage)

    def _publish(self, stage: str) -> None:
        """Move ``.publishing/<stage>`` into place; idempotent, so an interrupted call can be repeated."""
        pending, trash = self.root / PUBLISHING / stage, self.root / TRASH / stage
        marker = pending / MARKER
        if marker.is_file():
            self._marker(stage).unlink(missing_ok=True)
            outputs = json.loads(marker.read_text())["outputs"]
            replaced = json.loads((pending / REPLACES).read_text())
            for entry in [*replaced, *entries_of(outputs)]:
                src, dst = pending / entry, self.root / entry
                if entry in replaced or src.exists():
                    if dst.exists() or dst.is_symlink():
                        (trash / entry).parent.mkdir(parents=True, exist_ok=True)
                        remove(trash / entry)
                        os.rename(dst, trash / entry)
                if src.exists():
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    os.rename(src, dst)
            self._marker(stage).parent.mkdir(exist_ok=True)
            os.replace(marker, self._marker(stage))
        remove(pending)
        remove(trash)
        self._tidy()

    def _tidy(self) -> None:
        """Remove the bookkeeping directories once they are empty."""
        for name in (SCRATCH, PUBLISHING, TRASH):
            d = self.root / name
            if d.is_dir() and not any(d.iterdir()):
                d.rmdir()

    def recover(self) -> list[str]:
        """Finish the publishes an interrupted run left and drop unfinished scratch output;
        return the stages whose publish was completed."""
        done = []
        pending_root = self.root / PUBLISHING
        if pending_root.is_dir():
            for pending in sorted(pending_root.iterdir()):
                self._publish(pending.name)
                done.append(pending.name)
        remove(self.root / SCRATCH)
        remove(self.root / TRASH)
        self._tidy()
        return done
