"""Helpers of the GPU tests: engine processes started from the checkout root."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs_gpus(n: int):
    """Skip mark for a case that needs ``n`` GPUs of one host."""
    return pytest.mark.skipif(gpu_count() < n, reason=f"needs {n} GPUs")


def run_phase(module: str, args: list[str], env: dict[str, str], log: Path, timeout_s: float,
              must_succeed: bool = True) -> None:
    """``python -m <module> <args>`` from the checkout root: one engine per process, so vLLM's
    process state and GPU memory stay separate. Fails the test with the log's tail if the process
    fails and ``must_succeed``."""
    with open(log, "w") as out:
        rc = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env, stdout=out,
                            stderr=subprocess.STDOUT, timeout=timeout_s).returncode
    if rc != 0 and must_succeed:
        pytest.fail(f"{module} {' '.join(args)} exited with {rc}:\n{log.read_text()[-6000:]}")
