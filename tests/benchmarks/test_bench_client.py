"""benchmarks/serving/bench_client.py: one client process answers rate after rate, each rate's output
(Python's and the file descriptors') in its own log, its exit code back; a stuck or dead client is
one HarnessError. The process is real; its runner stands in for vLLM's `bench serve` (the symbol test
checks vLLM's parser and entry point where vLLM is installed)."""
from __future__ import annotations

import importlib.util
import os
import sys
import time

import pytest

from benchmarks.serving import bench_client
from benchmarks.serving.vllm_server import HarnessError

RUNNER = r'''
import os, sys, time
sys.path.insert(0, sys.argv[1])
from benchmarks.serving.bench_client import serve


def runner():
    print("imported")  # outside a rate (vLLM's import): the client's log, never an answer
    return run


def run(options):
    what = options[0]
    print("python says", what)
    os.write(2, b"fd 2 says hello\n")
    if what == "exit":
        raise SystemExit(int(options[1]))
    if what == "raise":
        raise ValueError("no dataset")
    if what == "sleep":
        time.sleep(60)
    if what == "die":
        os._exit(5)


serve(runner)
'''


@pytest.fixture
def client(tmp_path, monkeypatch):
    script = tmp_path / "runner.py"
    script.write_text(RUNNER)
    monkeypatch.setattr(bench_client, "CHILD", [sys.executable, str(script), str(bench_client.ROOT)])
    with bench_client.BenchClient(dict(os.environ), tmp_path / "client.log") as c:
        yield c


def test_rates_run_one_after_another_each_in_its_log(client, tmp_path):
    for i, (options, code) in enumerate([(["ok", "--rate", "1 2"], 0), (["exit", "2"], 2), (["raise"], 1),
                                         (["ok"], 0)]):
        log = tmp_path / f"rate{i}.log"
        assert client.run(options, log, 30) == code
        lines = log.read_text().splitlines()
        assert lines[0] == "vllm bench serve " + " ".join(options).replace("1 2", "'1 2'")
        assert f"python says {options[0]}" in lines and "fd 2 says hello" in lines
        assert lines[-1].startswith("bench_client: ") and lines[-1].endswith(" s in vllm bench serve")
    assert "ValueError: no dataset" in (tmp_path / "rate2.log").read_text()
    assert (tmp_path / "client.log").read_text().splitlines()[0] == "imported"


def test_a_rate_past_its_time_stops_the_client(client, tmp_path):
    start = time.monotonic()
    with pytest.raises(HarnessError, match="(?s)ran past the budget.*python says sleep"):
        client.run(["sleep"], tmp_path / "slow.log", 1.0)
    assert time.monotonic() - start < 30
    assert client._proc.poll() is not None  # stopped, not left running the rate


def test_a_client_that_died_is_reported_with_its_log(client, tmp_path):
    with pytest.raises(HarnessError, match=r"(?s)process exited \(5\).*client.log ends:.*imported"):
        client.run(["die"], tmp_path / "dies.log", 30)
    with pytest.raises(HarnessError, match="process exited"):
        client.run(["ok"], tmp_path / "after.log", 30)


def test_without_vllm_the_real_client_stops_in_one_line(tmp_path):
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: the real client would run")
    with bench_client.BenchClient(dict(os.environ), tmp_path / "client.log") as c:
        with pytest.raises(HarnessError, match=r"(?s)exited \(2\).*error: vllm bench serve is not importable here"):
            c.run(["--help"], tmp_path / "rate.log", 60)
    assert (tmp_path / "client.log").read_text().count("\n") == 1  # one line, no traceback
