"""Where a serving table's modes run (benchmarks/serving/placement.py): ``--gpus`` as parsed and
resolved, each mode's environment on its GPU, and the modes taken by the GPUs: each once, one at a
time per GPU, at once across GPUs, within the budget."""
from __future__ import annotations

import argparse
import os
import threading
import time
from pathlib import Path

import pytest

from benchmarks.serving import placement
from serve_bridge.command_line import Parser


def _parse(argv: list[str]) -> list[str] | None:
    ap = Parser(prog="bench")
    placement.add_argument(ap)
    return ap.parse_args(argv).gpus


def test_gpus_option():
    assert _parse([]) is None
    assert _parse(["--gpus", "all"]) == ["all"]
    assert _parse(["--gpus", "0", "3"]) == ["0", "3"]


@pytest.mark.parametrize("argv, says", [(["--gpus", "all", "1"], "'all': give 'all' alone or GPU numbers"),
                                        (["--gpus", "-1"], "'-1': give 'all' alone"),
                                        (["--gpus", "1", "1"], "1 1: each GPU once")])
def test_bad_gpus_are_one_line(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        _parse(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err and err.count("\n") == 1


def test_visible_gpus(tmp_path, monkeypatch):
    assert placement.visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 5"}) == ["2", "5"]
    assert placement.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf '0\\n1\\n2\\n'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert placement.visible_gpus({}) == ["0", "1", "2"]
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    assert placement.visible_gpus({}) == []


def test_resolve(capsys):
    assert placement.resolve(None, 8000, {}) == [None]
    assert placement.resolve(["all"], 0, {"CUDA_VISIBLE_DEVICES": "4,6"}) == ["4", "6"]
    assert placement.resolve(["all"], 0, {"CUDA_VISIBLE_DEVICES": ""}) == [None]  # no GPU: as before
    assert placement.resolve(["3"], 8000, {}) == ["3"]
    with pytest.raises(SystemExit) as e:
        placement.resolve(["0", "1"], 8000, {})
    assert e.value.code == 2 and "--port=8000: names one server's port" in capsys.readouterr().err


def test_env_of_a_placed_mode():
    """A placed mode sees its GPU alone and compiles into that GPU's cache, which the modes placed
    on it one after another share and a mode on another GPU never writes."""
    assert placement.env(None, Path("/w")) == {}
    assert placement.env("3", Path("/w")) == {"CUDA_VISIBLE_DEVICES": "3", "VLLM_CACHE_ROOT": "/w/vllm-cache/gpu3"}
    assert placement.env("0", Path("/w"))["VLLM_CACHE_ROOT"] != placement.env("1", Path("/w"))["VLLM_CACHE_ROOT"]


def test_concurrent_servers():
    def lora(m: str) -> bool:
        return m != "nolora"
    assert placement.concurrent_servers([None], ["stock", "gridtrim"], lora) == 1
    assert placement.concurrent_servers(["0", "1", "2"], ["stock", "gridtrim", "nolora"], lora) == 2
    assert placement.concurrent_servers(["0", "1"], ["stock", "gridtrim", "both"], lora) == 2
    assert placement.concurrent_servers(["0", "1"], ["nolora"], lora) == 1


def _args(modes: list[str], budget_s: float = 100.0, min_mode_s: float = 0.0) -> argparse.Namespace:
    return argparse.Namespace(modes=modes, budget_s=budget_s, min_mode_s=min_mode_s)


def test_gpus_take_the_modes_in_order_one_at_a_time_each_at_once_across():
    doc: dict = {"modes": {}, "notes": []}
    running: dict[str, int] = {"0": 0, "1": 0}
    log: list[tuple[str, str]] = []
    both = threading.Barrier(2, timeout=30)  # the first two modes must run at the same time
    lock = threading.Lock()

    def run(mode: str, entry: dict, gpu: str | None) -> None:
        with lock:
            running[gpu] += 1
            assert running[gpu] == 1, f"GPU {gpu} runs two modes"
            log.append((mode, gpu))
        if mode in ("a", "b"):
            both.wait()
        time.sleep(0.05)
        entry["error"] = "failed" if mode == "c" else None
        with lock:
            running[gpu] -= 1

    flushed = []
    now = time.monotonic()
    rc = placement.run_modes(doc, _args(["a", "b", "c", "d", "e"]), ["0", "1"], now, now + 100, run,
                             lambda: flushed.append(1))
    assert rc == 1 and flushed == [1]  # mode c's error; the table written once at the end
    assert sorted(m for m, _ in log) == ["a", "b", "c", "d", "e"] and {g for _, g in log} == {"0", "1"}
    assert [m for m, _ in log][:2] in (["a", "b"], ["b", "a"])  # taken in --modes order
    # entries are made as the modes are taken, in --modes order (the log has the threads' order: b may log first)
    assert list(doc["modes"]) == ["a", "b", "c", "d", "e"]
    assert all(doc["modes"][m]["facts"] == [f"GPU {g}"] for m, g in log)


def test_one_gpu_runs_the_modes_in_turn_and_stops_at_the_budget(monkeypatch):
    """Each mode takes 0.3 s of a clock the test keeps (placement's own, nothing else's): a starts
    with 1.0 s left, b with 0.7, c would start with 0.4, under the 0.5 a mode needs."""
    doc: dict = {"modes": {}, "notes": []}
    order: list[str] = []
    clock = [1000.0]
    monkeypatch.setattr(placement, "time", argparse.Namespace(monotonic=lambda: clock[0]))

    def run(mode: str, entry: dict, gpu: str | None) -> None:
        order.append(mode)
        assert gpu is None and threading.current_thread() is threading.main_thread()
        clock[0] += 0.3

    rc = placement.run_modes(doc, _args(["a", "b", "c"], budget_s=1.0, min_mode_s=0.5), [None], 1000.0, 1001.0, run,
                             lambda: None)
    assert rc == 0 and order == ["a", "b"] and doc["modes"]["a"]["facts"] == []
    assert doc["notes"] == [doc["notes"][0]] and doc["notes"][0].startswith("c: not run, ")


def test_a_harness_bug_in_a_mode_is_raised():
    def run(mode: str, entry: dict, gpu: str | None) -> None:
        raise KeyError(mode)

    now = time.monotonic()
    with pytest.raises(KeyError):
        placement.run_modes({"modes": {}, "notes": []}, _args(["a", "b"]), ["0", "1"], now, now + 100, run,
                            lambda: None)


def test_serialized_lets_one_thread_in_at_a_time():
    inside, peak = [0], [0]

    @placement.serialized
    def write(i: int) -> int:
        inside[0] += 1
        peak[0] = max(peak[0], inside[0])
        time.sleep(0.01)
        inside[0] -= 1
        return i

    threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert write(3) == 3 and peak == [1]
