"""Slot hand-back on the GPU: policy off ≡ stock on 320 requests, and profiled and learned
policies give the same tokens (up to numerical near-ties) and release points with and without
hand-back (``benchmarks/serving/check_slots.py``, three engines in subprocesses). Skipped without CUDA
or a supported vLLM; ``vllm_env`` (conftest.py) gives the engines the plugin's entry point."""
from __future__ import annotations

import importlib.util

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None,
                                 reason="needs an NVIDIA GPU and vLLM")]


def test_slot_hand_back_changes_tokens_only_at_near_ties(tmp_path, vllm_env, monkeypatch):
    from benchmarks.serving import check_slots

    for name in ("PYTHONPATH", "VLLM_USE_V2_MODEL_RUNNER"):  # the runner switch: unset on vLLM 0.34, its only runner
        if name in vllm_env:
            monkeypatch.setenv(name, vllm_env[name])
        else:
            monkeypatch.delenv(name, raising=False)

    rc = check_slots.main(["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--requests", "320",
                           "--budget-s", "900"])
    report = (tmp_path / "out" / "check_slots.md").read_text()
    assert rc == 0, report
    assert report.count("| PASS |") == check_slots.N_CHECKS
