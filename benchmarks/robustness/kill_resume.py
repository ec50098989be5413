"""Kill `python -m calibrate` at seeded random points of each stage, re-run it, and compare every
output with an uninterrupted run of the same command.

  OMP_NUM_THREADS=1 python -m benchmarks.robustness.kill_resume --kills 36 --per-stage 2 --seed 0

1. Reference: one uninterrupted run; each stage's duration is taken from when its
   ``[stage] running`` line appeared.
2. Chains: the same command in a fresh run directory, killed with SIGKILL ``--per-stage`` times
   in each stage in turn (data, labels, heads, sweep, export, test), each time ``u × the stage's
   reference duration`` after its ``[stage] running`` line (u uniform in [0, 1), seeded), and
   started again; after the chain's last kill it runs to the end. ``--kills`` kills make
   ``ceil(kills / (6 × per-stage))`` chains.
3. Every file of each chain's run directory is compared with the reference: byte-identical,
   except the stage and shard markers, compared without their finish time and durations
   (``seconds``, ``*_seconds``).
   Hydra's ``.hydra/`` (the last command's config) is not compared. No ``.scratch``,
   ``.publishing`` or ``.trash`` directory may remain.

A target whose stage is already cached when the restarted run reaches it (data and heads take
well under a second, so their kill often lands in the next stage), or whose run ends before the
delay, gets no kill. Prints one row per kill (the stage it targeted, the stage the process was in
when killed, the delay) and one verdict per chain; exits 1 if any chain's outputs differ.
``OMP_NUM_THREADS=1`` keeps torch from oversubscribing a shared CPU (every run of one invocation
uses the same setting, so outputs stay comparable).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from serve_bridge.command_line import Parser, number

ROOT = Path(__file__).resolve().parents[2]
STAGE_ORDER = ("data", "labels", "heads", "sweep", "export", "test")
KILL_CONFIG = ["task=arith", "adapter=arith_demo", "task.sizes.train=3", "task.sizes.validation=1", "task.sizes.test=1",
               "task.options.max_new_tokens=10", "labeling.points=[0,2]", "labeling.shard_requests=1",
               "sweep.n_tau=4", "sweep.ks=[0,1,2,4]", "engine.progress=false"]
BOOKKEEPING = (".scratch", ".publishing", ".trash")


class Calibrate:
    """One `python -m calibrate` process whose stdout lines are collected with their arrival time."""

    def __init__(self, run_dir: Path, overrides: list[str]) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "calibrate", f"hydra.run.dir={run_dir}", *overrides],
                                     cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[tuple[float, str]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def wait_for_stage(self, stage: str) -> str | None:
        """Block until ``stage`` starts (``running`` / ``recomputing``) or is ``cached``, or the process ends;
        return ``running``, ``cached`` or None."""
        seen = 0
        while True:
            upto = len(self.lines)  # the reader thread appends meanwhile: scan a fixed prefix
            for _, line in self.lines[seen:upto]:
                if line.startswith(f"[{stage}] "):
                    return "cached" if line == f"[{stage}] cached" else "running"
            seen = upto
            if self.proc.poll() is not None:
                self.reader.join()
                if len(self.lines) == seen:
                    return None
            time.sleep(0.02)

    def current_stage(self) -> str:
        started = [line[1:].split("]")[0] for _, line in self.lines if line.startswith("[") and "]" in line]
        return started[-1] if started else "start-up"

    def finish(self) -> int:
        rc = self.proc.wait()
        self.reader.join()
        return rc

    def kill(self) -> bool:
        """SIGKILL; True iff the process was still running."""
        alive = self.proc.poll() is None
        if alive:
            self.proc.send_signal(signal.SIGKILL)
        self.finish()
        return alive


def stage_durations(lines: list[tuple[float, str]], end: float) -> dict[str, float]:
    """Seconds from each ``[stage] running`` line to the next stage's line (or ``end``)."""
    starts = [(t, line[1:].split("]")[0]) for t, line in lines if line.startswith("[") and line.endswith("running")]
    return {s: (starts[i + 1][0] if i + 1 < len(starts) else end) - t for i, (t, s) in enumerate(starts)}


def _without_timing(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _without_timing(v) for k, v in obj.items()
                if k not in ("finished_at", "seconds") and not k.endswith("_seconds")}
    if isinstance(obj, list):
        return [_without_timing(v) for v in obj]
    return obj


def run_contents(run_dir: Path) -> dict[str, str]:
    """What is compared of a run directory: sha256 per file, stage and shard markers without timing."""
    out = {}
    for p in sorted(run_dir.rglob("*")):
        rel = p.relative_to(run_dir).as_posix()
        if not p.is_file() or rel.startswith(".hydra/") or rel.endswith(".log"):
            continue
        data = p.read_bytes()
        if rel.startswith("stages/") or rel.endswith(".done"):
            data = json.dumps(_without_timing(json.loads(data)), sort_keys=True).encode()
        out[rel] = hashlib.sha256(data).hexdigest()
    return out


def compare(reference: dict[str, str], run_dir: Path) -> list[str]:
    """Differences between a chain's run directory and the reference contents (empty: identical)."""
    got = run_contents(run_dir)
    diffs = [f"missing {k}" for k in sorted(set(reference) - set(got))]
    diffs += [f"extra {k}" for k in sorted(set(got) - set(reference))]
    diffs += [f"differs {k}" for k in sorted(set(got) & set(reference)) if got[k] != reference[k]]
    diffs += [f"left {d}/" for d in BOOKKEEPING if (run_dir / d).exists()]
    return diffs


@dataclass
class Chain:
    """One chain's kills, as (target stage, stage killed in, delay in s) rows, and its verdict."""

    kills: list[tuple[str, str, float]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    returncode: int = 0
    diffs: list[str] = field(default_factory=list)


def kill_chain(run_dir: Path, overrides: list[str], targets: list[tuple[str, float]],
               durations: dict[str, float], reference: dict[str, str]) -> Chain:
    """Kill a run of ``overrides`` in ``run_dir`` once per (stage, u) of ``targets``, ``u × durations[stage]``
    after the stage starts; restart after each kill; then run to the end and compare with ``reference``."""
    chain = Chain()
    proc = Calibrate(run_dir, overrides)
    for stage, u in targets:
        if proc.wait_for_stage(stage) != "running":
            chain.skipped.append(stage)  # cached after the previous kill, or the run already ended
            continue
        delay = u * durations.get(stage, 1.0)
        time.sleep(delay)
        at = proc.current_stage()
        if proc.kill():
            chain.kills.append((stage, at, delay))
        else:
            chain.skipped.append(stage)
        proc = Calibrate(run_dir, overrides)
    chain.returncode = proc.finish()
    chain.diffs = compare(reference, run_dir) if chain.returncode == 0 else ["the final run failed"]
    return chain


def reference_run(run_dir: Path, overrides: list[str]) -> tuple[dict[str, str], dict[str, float]]:
    """Contents and per-stage durations of an uninterrupted run."""
    proc = Calibrate(run_dir, overrides)
    if proc.finish() != 0:
        raise SystemExit("the reference run failed:\n" + "\n".join(line for _, line in proc.lines[-30:]))
    return run_contents(run_dir), stage_durations(proc.lines, time.monotonic())


def main() -> None:
    ap = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=number("positive_int"), default=36,
                    help="kill targets over all chains (default 36)")
    ap.add_argument("--per-stage", type=number("positive_int"), default=2,
                    help="kills per stage in one chain (default 2)")
    ap.add_argument("--seed", type=number("seed"), default=0)
    ap.add_argument("--work", type=Path, default=None, help="where run directories go (default: a temp dir)")
    ap.add_argument("overrides", nargs="*", default=KILL_CONFIG, help="calibrate overrides (default: a tiny run)")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    work = args.work or Path(tempfile.mkdtemp(prefix="kill_resume-"))
    t0 = time.monotonic()
    reference, durations = reference_run(work / "reference", args.overrides)
    print(f"reference run: {time.monotonic() - t0:.0f} s; stage durations (s): "
          + ", ".join(f"{s} {d:.1f}" for s, d in durations.items()), flush=True)
    per_chain = len(STAGE_ORDER) * args.per_stage
    n_chains = math.ceil(args.kills / per_chain)
    print(f"{'chain':>5}  {'target':<8}{'killed in':<11}{'delay s':>8}", flush=True)
    failures, n_kills = 0, 0
    for c in range(n_chains):
        targets = [(s, rng.random()) for s in STAGE_ORDER for _ in range(args.per_stage)]
        targets = targets[: args.kills - c * per_chain]
        chain = kill_chain(work / f"chain{c}", args.overrides, targets, durations, reference)
        for stage, at, delay in chain.kills:
            print(f"{c:>5}  {stage:<8}{at:<11}{delay:>8.2f}", flush=True)
        n_kills += len(chain.kills)
        verdict = "identical to the reference" if not chain.diffs else "DIFFERS: " + "; ".join(chain.diffs[:5])
        skipped = f" (no kill for {chain.skipped}: stage cached or over)" if chain.skipped else ""
        print(f"chain {c}: {len(chain.kills)} kills, final run exit {chain.returncode}, {verdict}{skipped}", flush=True)
        failures += bool(chain.diffs)
    print(f"{n_kills} kills in {n_chains} chains, {n_chains - failures}/{n_chains} chains identical to the "
          f"uninterrupted run ({time.monotonic() - t0:.0f} s; run directories under {work})", flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
