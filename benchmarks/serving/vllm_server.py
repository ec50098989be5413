"""A ``vllm serve`` process of the serving benchmarks and GPU tests: started in a process group of its
own, waited for until it serves every adapter, warmed up, asked for the plugin's counters over
``POST /collective_rpc``, and stopped with everything it started."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

WARMUP_PROMPT = " ".join(f"t{1000 + i}" for i in range(16))  # 16 tokens of the word tokenizer


class HarnessError(RuntimeError):
    """A mode that cannot be measured further; the message says why (with the log's tail)."""


def tail(path: Path, chars: int = 4000) -> str:
    """The end of a log file."""
    return path.read_text(errors="replace")[-chars:] if path.exists() else f"({path} not written)"


def http_json(url: str, body: dict[str, Any] | None = None, timeout_s: float = 60) -> Any:
    """GET ``url``, or POST ``body`` as JSON; the decoded answer (None when empty)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        raw = resp.read()
    return json.loads(raw) if raw else None


def free_port() -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """``cmd`` in a process group of its own (the API server and its engine core), output to ``log``."""
    with open(log, "w") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def stop_server(server: subprocess.Popen, timeout_s: float = 60) -> None:
    """SIGTERM to the server's process group, SIGKILL to what is left after ``timeout_s``."""
    try:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass
    except ProcessLookupError:
        return
    try:
        os.killpg(server.pid, signal.SIGKILL)  # the engine core, should it outlive the API server
    except ProcessLookupError:
        pass
    server.wait()


def wait_ready(base_url: str, server: subprocess.Popen, log: Path, timeout_s: float, served: Sequence[str]) -> float:
    """Seconds until ``GET /health`` answers and ``GET /v1/models`` lists every name in ``served``;
    an error with the log's tail if the server exits or ``timeout_s`` passes first."""
    t0 = time.monotonic()
    while True:
        if server.poll() is not None:
            raise HarnessError(f"vllm serve exited with {server.returncode} before it was ready; {log} ends:\n"
                               + tail(log))
        try:
            http_json(base_url + "/health", timeout_s=5)
            listed = {m["id"] for m in http_json(base_url + "/v1/models", timeout_s=30)["data"]}
        except OSError:  # not listening yet, or 503 while starting
            listed = None
        if listed is not None:
            missing = sorted(set(served) - listed)
            if missing:
                raise HarnessError(f"vllm serve does not serve {len(missing)} adapters, e.g. {missing[:3]}")
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise HarnessError(f"vllm serve was not ready after {timeout_s:.0f} s; {log} ends:\n" + tail(log))
        time.sleep(2)


def warm_up(base_url: str, models: Sequence[str], prompts: Sequence[str] | None = None, workers: int = 32) -> float:
    """One 4-token completion per name in ``models`` (of ``prompts[i]`` for ``models[i]``, default
    :data:`WARMUP_PROMPT`), ``workers`` at a time; the seconds taken."""
    def one(model: str, prompt: str) -> Any:
        return http_json(base_url + "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 4,
                                                        "ignore_eos": True}, timeout_s=300)

    t0 = time.monotonic()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, models, prompts or [WARMUP_PROMPT] * len(models)))
    return time.monotonic() - t0


def counters(base_url: str) -> dict[str, Any]:
    """The StepTrim counters of the server's worker (``lorazor_counters`` over ``POST /collective_rpc``)."""
    return http_json(base_url + "/collective_rpc", {"method": "lorazor_counters"})["results"][0]
