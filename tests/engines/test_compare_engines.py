"""benchmarks/engines/compare_engines.py refuses, before any engine runs, an earlier result of
other requests (a 128-request hf result next to a 512-request vLLM run cost a GPU run)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.engines import compare_engines


def _write(out: Path, name: str, requests: int, limit: int | None) -> None:
    data = {"requests": requests, "results": []} | ({} if limit is None else {"limit": limit})
    (out / f"{name}.json").write_text(json.dumps(data))


def test_without_the_other_result_only_this_engine_runs(tmp_path: Path) -> None:
    assert not compare_engines.check_earlier(tmp_path, ["hf"], 512)  # hf now, vLLM in a later call
    assert compare_engines.check_earlier(tmp_path, ["hf", "vllm"], 128)  # both run now: nothing to check


def test_earlier_result_of_other_requests_is_refused(tmp_path: Path) -> None:
    _write(tmp_path, "hf", 128, 128)
    with pytest.raises(SystemExit, match="holds 128 requests .*asks for --limit 512: pass --limit 128"):
        compare_engines.check_earlier(tmp_path, ["vllm"], 512)
    assert compare_engines.check_earlier(tmp_path, ["vllm"], 128)


def test_results_without_a_recorded_limit(tmp_path: Path) -> None:
    _write(tmp_path, "hf", 128, None)  # written before the limit was recorded
    with pytest.raises(SystemExit, match="holds 128 requests"):
        compare_engines.check_earlier(tmp_path, ["vllm"], 512)
    assert compare_engines.check_earlier(tmp_path, ["vllm"], 128)
    assert compare_engines.check_earlier(tmp_path, ["vllm"], 0)  # all requests: the count cannot be checked up front
