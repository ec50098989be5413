"""Timed runs of several live engines, taken in turns, so that a drift of the machine falls on every mode alike.

Engines started one after another see the host at different minutes: on one H200 the same engine's
runs of the same workload moved by 5-8% from one minute to the next
(benchmarks/results/2026-12-04-suite-goodput.md §2), the size of the differences between modes.
Interleaving keeps every mode's engine alive in its own subprocess and runs round r = 1..R, in
each round every mode once, one engine at a time, every other round in the reverse order
(:func:`round_order`, which ``bench.schedule`` uses for passes too); a ratio taken within a round
compares runs a minute apart at most. Engines of several vLLM installs (one interpreter each)
take turns the same way, so two vLLM lines are compared within one run too.

Semantics of the protocol, one line per message over two inherited pipes per engine: the engine
says ``ready`` once warm; the orchestrator says ``run``; the engine answers ``done <seconds>``
after the timed run. End of file on either side ends the exchange: the orchestrator closes its end
after the last round, or before a round that would end past the budget's deadline (every engine has
then run the same rounds), and the engine then writes its result and exits.
"""
from __future__ import annotations

import os
import select
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO


class Turns:
    """The engine's side: announce readiness, wait for each turn, report each run's time."""

    def __init__(self, read_fd: int, write_fd: int) -> None:
        self._in = os.fdopen(read_fd, "r")
        self._out = os.fdopen(write_fd, "w")

    @classmethod
    def from_arg(cls, spec: str) -> Turns:
        """``"R,W"``: the inherited descriptors to read turns from and to write answers to."""
        read_fd, write_fd = (int(x) for x in spec.split(","))
        return cls(read_fd, write_fd)

    def _say(self, line: str) -> None:
        self._out.write(line + "\n")
        self._out.flush()

    def ready(self) -> None:
        self._say("ready")

    def wait(self) -> bool:
        """Block until the orchestrator gives this engine its turn (True) or ends the rounds (False,
        end of file)."""
        line = self._in.readline().strip()
        if line not in ("run", ""):
            raise RuntimeError(f"expected a turn from the orchestrator, got {line!r}")
        return line == "run"

    def done(self, seconds: float) -> None:
        self._say(f"done {seconds:.6f}")


@dataclass
class Engine:
    """The orchestrator's side of one engine subprocess. ``error`` is set once it fails; it then
    takes no further turn. ``line``: the vLLM version it runs where engines of several vLLM installs
    take turns (None: the one installed)."""

    mode: str
    proc: subprocess.Popen
    to_engine: IO[str]
    from_engine: IO[str]
    runs: list[float] = field(default_factory=list)
    error: str | None = None
    line: str | None = None

    @property
    def name(self) -> str:
        """How rounds and notes name it: the mode, with its vLLM version where there are several."""
        return self.mode if self.line is None else f"{self.mode} (vLLM {self.line})"


def spawn(mode: str, argv: Sequence[str], env: dict[str, str], log: IO, line: str | None = None) -> Engine:
    """Start ``argv`` + ``--turns R,W`` with stdout and stderr to ``log``; R and W are pipe ends the
    child inherits."""
    to_r, to_w = os.pipe()
    from_r, from_w = os.pipe()
    proc = subprocess.Popen([*argv, "--turns", f"{to_r},{from_w}"], env=env, stdout=log,
                            stderr=subprocess.STDOUT, pass_fds=(to_r, from_w))
    os.close(to_r)
    os.close(from_w)
    return Engine(mode, proc, os.fdopen(to_w, "w"), os.fdopen(from_r, "r"), line=line)


def _read_line(engine: Engine, deadline: float) -> str | None:
    """The engine's next line; ``""`` at end of file (the engine exited), None once ``deadline``
    (time.time()) passes."""
    left = deadline - time.time()
    if left <= 0 or not select.select([engine.from_engine], [], [], left)[0]:
        return None
    return engine.from_engine.readline().strip()


def _fail(engine: Engine, why: str) -> None:
    engine.error = why
    engine.proc.kill()


def await_ready(engines: Sequence[Engine], deadline: float) -> None:
    """Wait for every engine's ``ready``; one that exits or is not ready by ``deadline`` fails."""
    for e in engines:
        line = _read_line(e, deadline)
        if line != "ready":
            _fail(e, "exited before it was ready" if line == "" else
                  "not ready within the budget" if line is None else f"said {line!r} instead of ready")


def round_order(modes: Sequence[str], r: int) -> list[str]:
    """Round ``r``'s order (0-based): ``modes`` as given in even rounds, reversed in odd ones."""
    return list(modes) if r % 2 == 0 else list(modes)[::-1]


@dataclass
class Rounds:
    """What :func:`run_rounds` ran: each round's order of the engines that ran in it and its wall
    seconds; ``stopped`` says why rounds were left out, if any were."""

    orders: list[list[str]] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    stopped: str | None = None


def run_rounds(engines: Sequence[Engine], rounds: int, deadline: float) -> Rounds:
    """``rounds`` rounds of one timed run per live engine, one engine at a time; each run's time
    goes to its engine's ``runs``. A round is started only if the longest round so far would end
    by ``deadline``, so a short budget leaves every engine with the same rounds instead of failing
    the engine whose turn falls past it. An engine that does not answer by ``deadline`` or exits
    fails and the others go on."""
    by_name = {e.name: e for e in engines}
    done = Rounds()
    for r in range(rounds):
        left = deadline - time.time()
        if done.seconds and max(done.seconds) > left:
            which = f"round {rounds}" if r + 1 == rounds else f"rounds {r + 1}-{rounds}"
            done.stopped = (f"{which} not run: a round took up to {max(done.seconds):.0f} s, "
                            f"{max(left, 0):.0f} s of the budget left")
            break
        t = time.time()
        ran = []
        for name in round_order(list(by_name), r):
            e = by_name[name]
            if e.error:
                continue
            try:
                e.to_engine.write("run\n")
                e.to_engine.flush()
            except BrokenPipeError:
                _fail(e, "exited before its turn")
                continue
            line = _read_line(e, deadline)
            if not (line or "").startswith("done "):
                _fail(e, f"no answer to its turn in round {r + 1}: " + (
                    "it exited" if line == "" else "out of time" if line is None else f"it said {line!r}"))
                continue
            e.runs.append(float(line.split()[1]))
            ran.append(name)
        done.orders.append(ran)
        done.seconds.append(time.time() - t)
    return done


def finish(engines: Sequence[Engine], timeout_s: float) -> dict[str, int | str]:
    """Close every turn pipe, so each engine writes its result and exits; each engine's exit code by
    :attr:`Engine.name`, or ``"timeout"`` for one still running after ``timeout_s`` (then killed)."""
    for e in engines:
        try:
            e.to_engine.close()
        except BrokenPipeError:
            pass
    codes: dict[str, int | str] = {}
    end = time.time() + timeout_s
    for e in engines:
        try:
            codes[e.name] = e.proc.wait(timeout=max(1.0, end - time.time()))
        except subprocess.TimeoutExpired:
            e.proc.kill()
            e.proc.wait()
            codes[e.name] = "timeout"
        e.from_engine.close()
    return codes


def round_ratios(engines: Sequence[Engine], name: str, other: str) -> list[float]:
    """``other``'s run time over ``name``'s, round by round (``name``'s speed relative to ``other``'s),
    for the rounds both ran (engines by :attr:`Engine.name`)."""
    by_name = {e.name: e for e in engines}
    a, b = by_name[name].runs, by_name[other].runs
    return [y / x for x, y in zip(a, b)]
