"""Interleaved timed runs: the turn-taking protocol between the orchestrator and live engine processes.

The engines here are real child processes speaking the protocol through ``interleave.Turns``; each
"timed run" sleeps briefly and logs its start and end, so the tests can see that runs never overlap
and follow the round order."""
import os
import sys
import time
from pathlib import Path

import pytest

from benchmarks.serving import bench, bench_table, bench_workload, host_memory, interleave, synthetic

ROOT = Path(__file__).resolve().parents[2]

# argv: log path, mode, runs, then "die_before_ready" or "die_after:<k>" or "ok"
CHILD = """
import sys, time
from benchmarks.serving.interleave import Turns
log, mode, runs, how, spec = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[6]
turns = Turns.from_arg(spec)
if how == "die_before_ready":
    sys.exit(3)
turns.ready()
for i in range(runs):
    turns.wait()
    if how == f"die_after:{i}":
        sys.exit(4)
    t0 = time.time()
    time.sleep(0.03)
    t1 = time.time()
    with open(log, "a") as f:
        f.write(f"{mode} {t0} {t1}\\n")
    turns.done(t1 - t0)
"""


def _spawn(tmp_path: Path, mode: str, runs: int, how: str = "ok") -> interleave.Engine:
    log = open(tmp_path / f"{mode}.out", "w")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return interleave.spawn(mode, [sys.executable, "-c", CHILD, str(tmp_path / "runs.log"), mode, str(runs), how],
                            env, log)


def _logged(tmp_path: Path) -> list[tuple[str, float, float]]:
    lines = (tmp_path / "runs.log").read_text().split("\n")
    return [(m, float(a), float(b)) for m, a, b in (line.split() for line in lines if line)]


def test_rounds_take_turns_one_engine_at_a_time(tmp_path):
    modes = ["both", "gridtrim", "nolora"]
    engines = [_spawn(tmp_path, m, 4) for m in modes]
    deadline = time.time() + 60
    interleave.await_ready(engines, deadline)
    rounds = interleave.run_rounds(engines, 4, deadline)
    codes = interleave.finish(engines, 30)
    assert codes == {m: 0 for m in modes} and all(e.error is None for e in engines)
    orders = rounds.orders
    assert orders == [modes, modes[::-1], modes, modes[::-1]] and rounds.stopped is None
    assert len(rounds.seconds) == 4 and all(s >= 0.09 for s in rounds.seconds)  # three runs of 0.03 s each
    logged = _logged(tmp_path)
    assert [m for m, _, _ in logged] == [m for order in orders for m in order]
    assert all(b[1] >= a[2] for a, b in zip(logged, logged[1:]))  # each run starts after the one before ended
    for e in engines:
        assert len(e.runs) == 4 and all(0.02 < r < 5 for r in e.runs)
    ratios = interleave.round_ratios(engines, "both", "gridtrim")
    assert len(ratios) == 4 and all(r > 0 for r in ratios)


def test_an_engine_that_fails_drops_out_and_the_others_go_on(tmp_path):
    engines = [_spawn(tmp_path, "both", 3), _spawn(tmp_path, "gridtrim", 3, "die_after:1"),
               _spawn(tmp_path, "stock", 3, "die_before_ready")]
    deadline = time.time() + 60
    interleave.await_ready(engines, deadline)
    assert engines[2].error == "exited before it was ready"
    orders = interleave.run_rounds(engines, 3, deadline).orders
    codes = interleave.finish(engines, 30)
    assert orders == [["both", "gridtrim"], ["both"], ["both"]]  # round 2 reversed: gridtrim fails first
    assert "no answer to its turn in round 2" in engines[1].error
    assert codes["both"] == 0 and len(engines[0].runs) == 3 and len(engines[1].runs) == 1
    assert len(interleave.round_ratios(engines, "both", "gridtrim")) == 1  # only the round both ran


def test_a_round_that_would_end_past_the_deadline_is_not_started(tmp_path):
    """Each run sleeps 0.5 s: round 1 takes about 1 s, about 2 s are left after it, so round 2 runs and
    round 3 does not; both engines keep their two runs and exit cleanly with them."""
    slow = CHILD.replace("time.sleep(0.03)", "time.sleep(0.5)")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    engines = [interleave.spawn(m, [sys.executable, "-c", slow, str(tmp_path / "runs.log"), m, "4", "ok"], env,
                                open(tmp_path / f"{m}.out", "w")) for m in ("both", "gridtrim")]
    interleave.await_ready(engines, time.time() + 60)
    rounds = interleave.run_rounds(engines, 4, time.time() + 3.0)
    codes = interleave.finish(engines, 30)
    assert rounds.orders == [["both", "gridtrim"], ["gridtrim", "both"]]
    assert rounds.stopped.startswith("rounds 3-4 not run: a round took up to 1 s")
    assert all(e.error is None and len(e.runs) == 2 for e in engines) and codes == {"both": 0, "gridtrim": 0}


def test_the_last_round_left_out_is_named_alone(tmp_path):
    """Two rounds (the defaults' REPEATS=2) and time for one: the note names round 2, not a range."""
    slow = CHILD.replace("time.sleep(0.03)", "time.sleep(0.5)")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    e = interleave.spawn("both", [sys.executable, "-c", slow, str(tmp_path / "runs.log"), "both", "2", "ok"], env,
                         open(tmp_path / "both.out", "w"))
    interleave.await_ready([e], time.time() + 60)
    rounds = interleave.run_rounds([e], 2, time.time() + 0.95)
    assert interleave.finish([e], 30) == {"both": 0}
    assert rounds.orders == [["both"]] and rounds.stopped.startswith("round 2 not run: a round took up to")


def test_turns_end_at_end_of_file_and_refuse_anything_else():
    to_r, to_w = os.pipe()
    from_r, from_w = os.pipe()
    os.write(to_w, b"run\nwalk\n")
    turns = interleave.Turns(to_r, from_w)
    assert turns.wait() is True
    with pytest.raises(RuntimeError, match="'walk'"):
        turns.wait()
    os.close(to_w)
    assert turns.wait() is False


def test_an_engine_that_is_not_ready_by_the_deadline_fails(tmp_path):
    slow = CHILD.replace("turns.ready()", "time.sleep(30); turns.ready()")
    log = open(tmp_path / "slow.out", "w")
    e = interleave.spawn("both", [sys.executable, "-c", slow, str(tmp_path / "runs.log"), "both", "1", "ok"],
                         dict(os.environ, PYTHONPATH=str(ROOT)), log)
    t = time.time()
    interleave.await_ready([e], time.time() + 1.0)
    assert e.error.startswith("not ready within the budget") and time.time() - t < 10
    assert interleave.finish([e], 5)["both"] != 0  # killed


def test_round_order_reverses_every_other_round():
    assert [interleave.round_order("abc", r) for r in range(3)] == [list("abc"), list("cba"), list("abc")]


def test_timed_runs_wait_for_their_turn_and_report_each_run():
    from tests.benchmarks.test_serving_workload import _StepEngine

    to_r, to_w = os.pipe()
    from_r, from_w = os.pipe()
    os.write(to_w, b"run\nrun\n")
    turns = interleave.Turns(to_r, from_w)
    prompts, params, loras = [[1, 2]] * 5, ["p"] * 5, [None] * 5
    runs, tokens, _ = bench.timed_runs(_StepEngine(lambda i: 2), prompts, params, loras, 2, None, turns)
    answers = os.read(from_r, 1000).decode().split("\n")
    assert [a.split()[0] for a in answers if a] == ["done", "done"]
    assert [float(a.split()[1]) for a in answers if a] == pytest.approx(runs, abs=1e-5)
    os.close(to_w)  # the orchestrator ends the rounds: no run without a turn
    with pytest.raises(RuntimeError, match="before this engine's first turn"):
        bench.timed_runs(_StepEngine(lambda i: 2), prompts, params, loras, 1, None, turns)


def test_timed_runs_stop_where_the_orchestrator_ends_the_rounds():
    from tests.benchmarks.test_serving_workload import _StepEngine

    to_r, to_w = os.pipe()
    from_r, from_w = os.pipe()
    os.write(to_w, b"run\n")
    os.close(to_w)  # one round of three
    prompts, params, loras = [[1, 2]] * 5, ["p"] * 5, [None] * 5
    runs, tokens, _ = bench.timed_runs(_StepEngine(lambda i: 2), prompts, params, loras, 3, None,
                                       interleave.Turns(to_r, from_w))
    assert len(runs) == 1 and len(tokens) == 5


def test_round_notes_give_each_round_and_boths_ratios():
    def engine(mode, runs):
        return interleave.Engine(mode, None, None, None, runs)

    engines = [engine("both", [10.0, 11.0]), engine("gridtrim", [11.0, 11.0]), engine("nolora", [9.0])]
    notes = bench_table.round_notes(128, engines, [["both", "gridtrim", "nolora"], ["gridtrim", "both"]])
    assert notes == ["N=128 round 1: both 10.00 s, gridtrim 11.00 s, nolora 9.00 s",
                     "N=128 round 2: gridtrim 11.00 s, both 11.00 s",
                     "N=128 both/gridtrim round by round: 1.100, 1.000 (median 1.050)",
                     "N=128 both/nolora round by round: 0.900 (median 0.900)"]


def test_kv_cache_for_engines_sharing_the_gpu():
    cfg = synthetic.LLAMA32_3B
    per_token = 2 * 28 * 8 * 128 * 2
    need = bench.MAX_NUM_SEQS * (bench_workload.PROMPT_LEN[1] + bench_workload.OUTPUT_LEN[1]) * per_token
    got = bench.interleaved_kv_cache_bytes(cfg)
    assert need < got < 1.5 * need and 13 * 2**30 < got < 16 * 2**30
    assert bench.interleaved_kv_cache_bytes(synthetic.LLAMA31_8B) > got  # more layers
    opts = bench.engine_options(128, mode="both", kv_cache_bytes=got)
    assert opts["kv_cache_memory_bytes"] == got and opts["gpu_memory_utilization"] == 0.1
    assert "kv_cache_memory_bytes" not in bench.engine_options(128, mode="both")


@pytest.mark.parametrize("extra", [[], ["--repeats", "1"], ["--repeats", "3", "--passes", "2"],
                                   ["--repeats", "3", "--profile-steps", "5"]])
def test_interleave_needs_repeats_and_offline_runs(extra, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--interleave", "--out", "/nonexistent/out", *extra])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--interleave" in err.splitlines()[-1]


def test_interleave_counts_every_lora_engine_in_host_memory(tmp_path, monkeypatch, capsys):
    one = host_memory.host_bytes_needed(synthetic.LLAMA32_3B, 8, 128, None, None)
    monkeypatch.setattr(bench, "host_memory_available", lambda: int(1.5 * one))  # one engine fits, two do not
    argv = ["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--adapters", "128",
            "--modes", "both", "gridtrim", "nolora", "--repeats", "3", "--interleave"]
    assert bench.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{2 * one / 2**30:.1f} GiB" in err
    assert not (tmp_path / "out").exists()


def test_interleaved_table_reports_engines_that_never_got_ready(tmp_path, capsys):
    """Through bench.main: the prepare phase writes the adapters, the engines start together and, with no
    GPU engine to start on this machine, each exits before it is ready; every mode gets an error row."""
    out = tmp_path / "out"
    argv = ["--out", str(out), "--work", str(tmp_path / "work"), "--adapters", "2", "--requests", "8",
            "--modes", "both", "gridtrim", "--repeats", "2", "--interleave", "--budget-s", "300",
            "--graphs", "full", "--sync"]
    assert bench.main(argv) == 1
    doc = bench.json.loads((out / "bench.json").read_text())
    assert [(r["mode"], r["error"]) for r in doc["rows"]] == [("both", "exited before it was ready"),
                                                              ("gridtrim", "exited before it was ready")]
    assert "interleaved: every mode's engine alive at once" in doc["preamble"][2]
    engine = next(line for line in doc["preamble"] if line.startswith("engine: "))
    opts = bench.json.loads(engine[len("engine: "):])
    assert opts["async_scheduling"] is False and opts["compilation_config"]["cudagraph_mode"] == "FULL"
    assert doc["preamble"][0].endswith("vLLM settings of every mode: [full CUDA graphs, sync]")
    assert [r["settings"]["graphs"] for r in doc["rows"]] == ["full", "full"]
    assert [n for n in doc["notes"] if "round" in n] == ["N=2 round 1: no engine ran", "N=2 round 2: no engine ran"]
    assert (out / "n2_uniform_both.log").exists() and (out / "prepare.log").exists()


def _interpreter(tmp_path: Path, version: str | None) -> str:
    """An interpreter whose vLLM install is package metadata of ``version`` alone (no module), on
    PYTHONPATH before the caller's; with None, the test's own interpreter (no vLLM installed)."""
    if version is None:
        return sys.executable
    site = tmp_path / f"site-{version}"
    (site / f"vllm-{version}.dist-info").mkdir(parents=True)
    (site / f"vllm-{version}.dist-info" / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    python = tmp_path / f"python-{version}"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={site}:$PYTHONPATH exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    return str(python)


def test_vllm_lines_read_each_interpreters_own_version(tmp_path):
    a, b = _interpreter(tmp_path, "0.33.0"), _interpreter(tmp_path, "0.34.0")
    assert bench.vllm_lines([a, b]) == [("0.33.0", a), ("0.34.0", b)]
    with pytest.raises(ValueError, match="both have vLLM 0.33.0"):
        bench.vllm_lines([a, a])
    with pytest.raises(ValueError, match="no vLLM installed for that interpreter"):
        bench.vllm_lines([a, _interpreter(tmp_path, None)])
    with pytest.raises(ValueError, match="cannot run it"):
        bench.vllm_lines([str(tmp_path / "no-such-python")])


def test_vllm_python_needs_interleaved_rounds(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--out", str(tmp_path / "out"), "--vllm-python", sys.executable, "--repeats", "2"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "--interleave" in err
    assert not (tmp_path / "out").exists()


def test_an_interpreter_without_vllm_is_refused_before_anything_is_written(tmp_path, capsys):
    argv = ["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--repeats", "2", "--interleave",
            "--vllm-python", _interpreter(tmp_path, "0.33.0"), sys.executable]
    assert bench.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{sys.executable}: no vLLM installed" in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "work").exists()


def test_round_notes_of_two_vllm_lines_pair_modes_within_each_line():
    def engine(mode, line, runs):
        return interleave.Engine(mode, None, None, None, runs, line=line)

    engines = [engine("gridtrim", "0.33.0", [10.0, 12.0]), engine("stock", "0.33.0", [20.0, 18.0]),
               engine("gridtrim", "0.34.0", [11.0, 11.0]), engine("stock", "0.34.0", [22.0, 33.0])]
    names = [e.name for e in engines]
    assert names[0] == "gridtrim (vLLM 0.33.0)" and len(set(names)) == 4
    notes = bench_table.round_notes(512, engines, [names, names[::-1]])
    assert notes[0] == ("N=512 round 1: gridtrim (vLLM 0.33.0) 10.00 s, stock (vLLM 0.33.0) 20.00 s, "
                        "gridtrim (vLLM 0.34.0) 11.00 s, stock (vLLM 0.34.0) 22.00 s")
    assert notes[2:] == ["N=512 gridtrim/stock (vLLM 0.33.0) round by round: 2.000, 1.500 (median 1.750)",
                         "N=512 gridtrim/stock (vLLM 0.34.0) round by round: 2.000, 3.000 (median 2.500)",
                         "N=512 gridtrim vLLM 0.34.0/0.33.0 round by round: 0.909, 1.091 (median 1.000)",
                         "N=512 stock vLLM 0.34.0/0.33.0 round by round: 0.909, 0.545 (median 0.727)"]


def test_two_vllm_lines_share_the_rounds_and_name_their_rows(tmp_path, capsys):
    """Through bench.main with two interpreters whose vLLM is metadata alone: every (line, mode)
    engine starts, none gets ready on this machine, and each gets its own error row, log and name."""
    out = tmp_path / "out"
    argv = ["--out", str(out), "--work", str(tmp_path / "work"), "--adapters", "2", "--requests", "8",
            "--modes", "gridtrim", "stock", "--repeats", "2", "--interleave", "--budget-s", "300",
            "--vllm-python", _interpreter(tmp_path, "0.33.0"), _interpreter(tmp_path, "0.34.0")]
    assert bench.main(argv) == 1
    doc = bench.json.loads((out / "bench.json").read_text())
    assert [(r["mode"], r["vllm"], r["error"]) for r in doc["rows"]] == [
        ("gridtrim", "0.33.0", "exited before it was ready"), ("stock", "0.33.0", "exited before it was ready"),
        ("gridtrim", "0.34.0", "exited before it was ready"), ("stock", "0.34.0", "exited before it was ready")]
    assert doc["preamble"][0].startswith("LoRazor serve_bridge throughput: stock vLLM 0.33.0 and 0.34.0 vs")
    assert {p.name for p in out.glob("*.log")} >= {"n2_uniform_gridtrim_vllm0_33_0.log", "n2_uniform_stock_vllm0_34_0.log"}
    assert "| gridtrim (our LoRA kernels, no release) (vLLM 0.34.0) | exited before it was ready |" in (
        out / "bench.txt").read_text()
    assert bench.main(argv[:argv.index("--modes")] + ["--modes", "stock", "--append"] + argv[argv.index("--repeats"):]) == 1
    again = bench.json.loads((out / "bench.json").read_text())  # stock's rows of both lines replaced, gridtrim's kept
    assert [(r["mode"], r["vllm"]) for r in again["rows"]] == [("gridtrim", "0.33.0"), ("gridtrim", "0.34.0"),
                                                               ("stock", "0.33.0"), ("stock", "0.34.0")]
