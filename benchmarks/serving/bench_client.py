"""``vllm bench serve``, one process for every rate of a server: vLLM is imported once, while the
server starts, instead of once per rate.

A ``vllm bench serve`` process per rate cost about 21 s a rate beyond its requests beside the
H200's servers (wall less duration in chat512's rows, 2026-12-05) and 10.5 s on the 2-core
development CPU against a local endpoint (importing vLLM 7.6 s); in one process the same rates
cost 1.1–1.7 s each there (vLLM 0.33.0, 1212 requests at 80.8 req/s, 2026-12-05). Each rate's
options go through vLLM's own parser and entry point, as the command line does
(``vllm/entrypoints/cli/benchmark/serve.py``: ``add_cli_args`` then ``main(args)`` of
``vllm/benchmarks/serve.py``, the same names in 0.26.0, 0.33.0 and 0.34.0), so a rate is the
command ``vllm bench serve OPTIONS`` would be, seeded the same way (``main_async`` seeds
``random`` and numpy from ``--seed`` on every call).

:class:`BenchClient` starts ``python -m benchmarks.serving.bench_client`` (:func:`serve`): it
reads one JSON line per rate, ``{"options": [...], "log": PATH}``, runs it with its standard
output and error in that log (its first line is the command; its last the seconds the rate took
in the process, which less the result's ``duration`` is vLLM's own overhead), and answers one JSON
line, ``{"rc": N}``, on the standard output it had when it started. Anything printed outside a
rate goes to the client's own log.
"""
from __future__ import annotations

import json
import os
import select
import shlex
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from benchmarks.serving.vllm_server import HarnessError, tail
from serve_bridge.command_line import Parser, fail

ROOT = Path(__file__).resolve().parents[2]
CHILD = [sys.executable, "-m", "benchmarks.serving.bench_client"]


class BenchClient:
    """The client process of one server (environment ``env``, its own output in ``log``)."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.log = log
        self._log = open(log, "w")
        self._proc = subprocess.Popen(CHILD, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=env,
                                      cwd=ROOT, text=True, bufsize=1)

    def run(self, options: Sequence[str], log: Path, timeout_s: float) -> int:
        """``vllm bench serve OPTIONS`` with its output in ``log``: its exit code. A run past
        ``timeout_s`` (the process is stopped) or a client that has exited is a HarnessError."""
        assert self._proc.stdin is not None and self._proc.stdout is not None
        try:
            self._proc.stdin.write(json.dumps({"options": list(options), "log": str(log)}) + "\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            raise self._gone() from None
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout_s)
        if not ready:
            self._proc.kill()  # mid-rate: it would not end at the end of its input
            self.close()
            raise HarnessError(f"vllm bench serve ran past the budget; {log} ends:\n" + tail(log))
        line = self._proc.stdout.readline()
        if not line:
            raise self._gone()
        return int(json.loads(line)["rc"])

    def _gone(self) -> HarnessError:
        code = self._proc.wait()
        self._log.flush()
        return HarnessError(f"the vllm bench serve process exited ({code}); {self.log} ends:\n" + tail(self.log))

    def close(self) -> None:
        """Stop the process (it ends at the end of its input; stopped if it is still running a rate)."""
        if self._proc.poll() is None:
            try:
                assert self._proc.stdin is not None
                self._proc.stdin.close()
                self._proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        self._log.close()

    def __enter__(self) -> BenchClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _rate(run: Callable[[list[str]], Any], options: list[str], log: str) -> int:
    """One rate with file descriptors 1 and 2 on ``log``: 0, or the exit code it raised (1 for an error)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log, "w") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        start = time.monotonic()
        try:
            print("vllm bench serve " + shlex.join(options), flush=True)
            run(options)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except Exception:
            traceback.print_exc()
            code = 1
        finally:
            print(f"bench_client: {time.monotonic() - start:.1f} s in vllm bench serve", flush=True)
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
    return code


def serve(make_runner: Callable[[], Callable[[list[str]], Any]], requests: IO[str] = sys.stdin) -> None:
    """Answer each request line with the outcome of ``make_runner()``'s runner (module doc) until
    ``requests`` ends. Standard output is moved to the client's log first, so that nothing printed
    outside a rate (importing vLLM included) reaches the answers."""
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    run = make_runner()
    for line in requests:
        request = json.loads(line)
        reply.write(json.dumps({"rc": _rate(run, request["options"], request["log"])}) + "\n")


def vllm_runner() -> Callable[[list[str]], Any]:
    """``vllm bench serve``'s parser and entry point; one line and exit code 2 without vLLM's."""
    try:
        from vllm.benchmarks.serve import add_cli_args, main
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError as e:
        fail(f"vllm bench serve is not importable here ({e}): pip install -e \".[vllm]\"")

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    return lambda options: main(parser.parse_args(options))


if __name__ == "__main__":
    Parser(description="The harnesses' vllm bench serve process (module doc); it takes no options").parse_args()
    serve(vllm_runner)
