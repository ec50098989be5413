"""The chat harness on CPU (benchmarks/serving/chat.py): the servers' commands (vLLM's defaults, nothing
turned off but lorazor-sync's async scheduling) and environments, the client's per-row adapters, the
/metrics and per-request parsing, the engine-config check, the table and its ratio lines, and the
learned bundle it serves."""
from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from benchmarks.serving import bench, chat, chat_bundle, goodput, synthetic
from benchmarks.serving.goodput import Slo
from benchmarks.serving.vllm_server import HarnessError
from predictors.heads import Head
from serve_bridge.bundle import load_bundle
from serve_bridge.gridtrim import COMPILED_LAUNCHES, DEFAULT_LAUNCH
from tests.benchmarks.test_goodput import flags, use_stand_in

OTHER_LAUNCH = next(launch for launch in COMPILED_LAUNCHES if launch != DEFAULT_LAUNCH)

SLO = Slo()
ADAPTERS = {bench.adapter_name(a): Path(f"/w/adapters/{bench.adapter_name(a)}") for a in range(3)}
# Every `vllm serve` option the harness gives, where vLLM 0.33.0 defines it (engine/arg_utils.py; the
# frontend's in entrypoints/common/cli_args.py); --no-async-scheduling from BooleanOptionalAction (:384-386).
SERVE_OPTIONS_033 = {"--host": "common/cli_args.py:293", "--port": "common/cli_args.py:295",
                     "--lora-modules": "common/cli_args.py:81", "--load-format": "arg_utils.py:1085",
                     "--enable-lora": "arg_utils.py:1610", "--max-loras": "arg_utils.py:1614",
                     "--max-lora-rank": "arg_utils.py:1615", "--max-cpu-loras": "arg_utils.py:1624",
                     "--worker-extension-cls": "arg_utils.py:1372", "--no-async-scheduling": "arg_utils.py:1811"}
# ... and every `vllm bench serve` option (benchmarks/serve.py; the dataset's in benchmarks/datasets/datasets.py).
BENCH_OPTIONS_033 = {"--backend", "--base-url", "--endpoint", "--model", "--tokenizer", "--request-rate", "--burstiness",
                     "--disable-tqdm", "--save-result", "--save-detailed", "--metadata", "--result-dir",
                     "--result-filename", "--ignore-eos", "--percentile-metrics", "--metric-percentiles", "--goodput",
                     "--temperature", "--lora-modules", "--lora-assignment", "--seed", "--num-prompts",
                     "--dataset-name", "--dataset-path", "--custom-output-len", "--skip-chat-template",
                     "--disable-shuffle"}


@pytest.mark.parametrize("mode", chat.MODES)
def test_servers_keep_vllms_defaults(mode):
    cmd = chat.server_command(Path("/w/model"), mode, ADAPTERS, 2, 8123)
    assert cmd[:5] == [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "/w/model"]
    f = flags(cmd)
    assert set(f) <= set(SERVE_OPTIONS_033)
    assert [k for k in f if k.startswith("--no-")] == (["--no-async-scheduling"] if mode == "lorazor-sync" else [])
    assert f["--load-format"] == ["dummy"] and f["--port"] == ["8123"]
    lora = mode != "nolora"
    assert ("--enable-lora" in f) == lora and ("--lora-modules" in f) == lora
    if lora:
        assert f["--lora-modules"] == [f"a0{a}=/w/adapters/a0{a}" for a in range(3)]
        assert f["--max-loras"] == ["2"] and f["--max-cpu-loras"] == ["3"] and f["--max-lora-rank"] == ["8"]
    assert ("--worker-extension-cls" in f) == (mode in chat.LEARNED)


def test_profiling_server_configures_vllms_profiler_for_its_worker(tmp_path):
    cmd = chat.server_command(Path("/w/model"), "gridtrim", ADAPTERS, 2, 8123, (tmp_path / "trace", 50))
    f = flags(cmd)
    assert set(f) <= set(SERVE_OPTIONS_033) | {"--profiler-config"}  # arg_utils.py:1908 of vLLM 0.33.0
    assert json.loads(f["--profiler-config"][0]) == {  # config/profiler.py's fields
        "profiler": "torch", "torch_profiler_dir": str(tmp_path / "trace"), "ignore_frontend": True,
        "torch_profiler_with_stack": False, "delay_iterations": chat.PROFILE_DELAY_STEPS, "max_iterations": 50}
    assert "--profiler-config" not in chat.server_command(Path("/w/model"), "gridtrim", ADAPTERS, 2, 8123)


def test_profiled_run_says_why_it_did_not_run(tmp_path):
    runs = []
    args = argparse.Namespace(duration_s=15.0, min_prompts=150)
    port = chat.free_port()  # nothing listens there
    line = chat.profiled_run(lambda r, n: runs.append((r, n)), f"http://127.0.0.1:{port}", tmp_path / "trace", 40.0,
                             args, time.monotonic() + 600, 5.0)
    assert line.startswith("profile at 40 req/s not started: POST /start_profile: ") and runs == []
    line = chat.profiled_run(lambda r, n: runs.append((r, n)), f"http://127.0.0.1:{port}", tmp_path / "trace", 40.0,
                             args, time.monotonic() + 60, 5.0)
    assert line.startswith("profile at 40 req/s not run: it needs about ") and runs == []


@pytest.mark.parametrize("mode", chat.MODES)
def test_server_environment(mode):
    environ = {"PATH": "/bin", "LORAZOR_GRIDTRIM": "1", "LORAZOR_BUNDLE": "/elsewhere"}
    env = goodput.server_env(chat.BENCH_MODE[mode], environ, Path("/w/learned"), ADAPTERS)
    lorazor = {k: v for k, v in env.items() if k.startswith("LORAZOR_")}
    want = {"LORAZOR_GRIDTRIM": "1"} if mode in ("gridtrim", *chat.LEARNED) else {}
    if mode in chat.LEARNED:
        want |= {"LORAZOR_BUNDLE": "/w/learned", "LORAZOR_LOG_INTERVAL_S": "0",
                 "LORAZOR_ADAPTERS": "a00=/w/adapters/a00,a01=/w/adapters/a01,a02=/w/adapters/a02"}
    assert lorazor == want
    assert goodput.expected_markers(chat.BENCH_MODE[mode]) == (
        {"gridtrim", "steptrim", "slots"} if mode in chat.LEARNED else {"gridtrim"} if mode == "gridtrim" else set())


def test_client_gives_each_row_its_adapter():
    per_row = ["a17", "a00", "a17", "a03"]
    cmd = chat.client_command("http://127.0.0.1:8123", Path("/w/model"), 12.5, 4, Path("/w/chat/r.jsonl"), per_row, 0,
                              SLO, Path("/o/lorazor/rate_12.5.json"), "lorazor")
    f = flags(cmd)
    assert set(f) <= BENCH_OPTIONS_033
    assert f["--dataset-name"] == ["custom"] and f["--dataset-path"] == ["/w/chat/r.jsonl"]
    assert f["--custom-output-len"] == ["-1"] and "--skip-chat-template" in f and "--disable-shuffle" in f
    assert f["--num-prompts"] == ["4"] and f["--request-rate"] == ["12.5"] and "--save-detailed" in f
    # vLLM 0.33.0 gives request i lora_modules[i % len] under round-robin (benchmarks/serve.py:956-961)
    assert f["--lora-modules"] == per_row and f["--lora-assignment"] == ["round-robin"]
    assert f["--goodput"] == ["ttft:1000", "tpot:50"] and f["--metric-percentiles"] == ["50,90,99"]
    base = flags(chat.client_command("http://h:1", Path("/w/model"), float("inf"), 4, Path("/w/r.jsonl"), [], 0, SLO,
                                     Path("/o/nolora/rate_inf.json"), "nolora"))
    assert base["--request-rate"] == ["inf"] and "--lora-modules" not in base  # nolora: the base model


# A /metrics page in the text exposition format of prometheus_client (what vLLM 0.33.0 serves): a counter
# named vllm:x is sampled as vllm:x_total beside vllm:x_created, a histogram as _bucket, _count and _sum.
METRICS = """# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="/w/model"} %(queries)s
vllm:prefix_cache_queries_created{engine="0",model_name="/w/model"} 1.7649e+09
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="/w/model"} %(hits)s
vllm:generation_tokens_total{engine="0",model_name="/w/model"} %(generated)s
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_bucket{engine="0",le="1.0",model_name="/w/model"} 4.0
vllm:iteration_tokens_total_bucket{engine="0",le="512.0",model_name="/w/model"} %(within)s
vllm:iteration_tokens_total_bucket{engine="0",le="+Inf",model_name="/w/model"} %(steps)s
vllm:iteration_tokens_total_count{engine="0",model_name="/w/model"} %(steps)s
vllm:iteration_tokens_total_sum{engine="0",model_name="/w/model"} 9.5e+05
vllm:num_requests_running{engine="0",model_name="/w/model"} 37.0
"""


def test_prefix_cache_and_batch_from_metrics():
    before = chat.prometheus(METRICS % {"queries": "1000.0", "hits": "600.0", "generated": "50.0", "steps": "10.0",
                                        "within": "9.0"})
    assert before["vllm:prefix_cache_queries_total"] == 1000.0 and before["vllm:num_requests_running"] == 37.0
    assert before["vllm:iteration_tokens_total_count"] == 10.0  # not the +Inf bucket's line
    assert before[chat.bucket("vllm:iteration_tokens_total_bucket", "512.0")] == 9.0
    after = chat.prometheus(METRICS % {"queries": "101000.0", "hits": "75600.0", "generated": "6050.0",
                                       "steps": "160.0", "within": "129.0"})
    assert chat.metrics_delta(before, after) == {"cache_queries": 100000.0, "cache_hits": 75000.0,
                                                 "cache_hit_rate": 0.75, "engine_steps": 150.0, "decode_batch": 40.0,
                                                 "past_graphs": None}
    # 120 of the 150 steps processed at most 512 tokens: a fifth ran past the graphs
    assert chat.metrics_delta(before, after, 512)["past_graphs"] == pytest.approx(0.2)
    assert chat.metrics_delta(before, after, 500)["past_graphs"] is None  # not a bucket bound: not counted
    assert chat.metrics_delta(before, after, 1024)["past_graphs"] is None  # no such bucket exported
    assert chat.metrics_delta(after, after, 512)["past_graphs"] is None and \
        chat.metrics_delta(after, after)["cache_hit_rate"] is None
    with pytest.raises(HarnessError, match="vllm:prefix_cache_hits_total"):
        chat.metrics_delta(before, {k: v for k, v in after.items() if "hits" not in k})


def test_largest_graph_from_the_engine_config_line():
    line = ("(EngineCore pid=1) INFO 12-07 05:48:57 [core.py:139] Initializing a V1 LLM engine (v0.33.0) with config: "
            "model='/w/model', compilation_config={'mode': <CompilationMode.VLLM_COMPILE: 3>, "
            "'cudagraph_capture_sizes': [1, 2, 4, 512], 'max_cudagraph_capture_size': 512, 'local_cache_dir': None}")
    assert chat.largest_graph("a line before\n" + line + "\n") == 512
    assert chat.largest_graph(line.replace("512, 'local", "0, 'local")) is None  # CUDA graphs off
    assert chat.largest_graph("'max_cudagraph_capture_size': 512 on another line") is None


def test_share_of_adapters_meeting_the_slo():
    # --save-detailed lists, per request (benchmarks/serve.py:1319-1339): TTFT and latency in s
    data = {"ttfts": [0.2, 0.3, 2.0, 0.1, 0.1, 0.4], "latencies": [1.2, 1.3, 3.0, 0.1, 5.1, 1.4],
            "output_lens": [21, 21, 21, 0, 51, 21], "errors": ["", "", "", "boom", "", ""]}
    names = ["a00", "a00", "a01", "a02", "a03", "a04"]
    # a00: both fine; a01: TTFT 2 s; a02: a failed request; a03: TPOT 100 ms; a04: fine
    assert chat.adapter_slo(names, data, SLO) == {"adapters": 5, "meeting": 2}
    assert chat.adapter_slo(names, data, Slo(2500, 120)) == {"adapters": 5, "meeting": 4}
    with pytest.raises(HarnessError, match="5 requests sent, 6"):
        chat.adapter_slo(names[:5], data, SLO)


def test_ttft_by_popularity_band():
    # request i on adapter adapters[i]; bands by rank 1–8, 9–32, 33–128, 129+ (adapter a has rank a+1)
    adapters = [0, 7, 7, 8, 31, 200, 511]
    data = {"ttfts": [0.1, 0.2, 0.3, 1.0, 2.0, 3.0, 5.0]}
    got = chat.ttft_by_popularity(adapters, data)
    assert got[0] == pytest.approx(np.percentile([100, 200, 300], 90)) and got[0] == pytest.approx(280.0)
    assert got[1] == pytest.approx(1900.0) and got[2] is None and got[3] == pytest.approx(4800.0)
    with pytest.raises(HarnessError, match="6 requests sent, 7"):
        chat.ttft_by_popularity(adapters[:6], data)


# vLLM 0.33.0's engine-config line (v1/engine/core.py:140-142), as a server with its defaults logs it (cut short)
ENGINE_LINE = ("(EngineCore pid=211) INFO 12-05 09:00:01 [core.py:139] Initializing a V1 LLM engine (v0.33.0) with "
               "config: model='/w/model', dtype=torch.bfloat16, max_seq_len=131072, load_format=dummy, seed=0, "
               "enable_prefix_caching=True, enable_chunked_prefill=True, pooler_config=None, compilation_config={'mode': "
               "<CompilationMode.VLLM_COMPILE: 3>, 'backend': 'inductor', 'cudagraph_mode': "
               "<CUDAGraphMode.FULL_AND_PIECEWISE: (2, 1)>, 'cudagraph_capture_sizes': [1, 2, 4, 8]}")


def test_engine_config_line_shows_vllms_defaults():
    assert chat.missing_defaults("INFO starting\n" + ENGINE_LINE + "\nINFO ready\n") == []
    off = ENGINE_LINE.replace("enable_prefix_caching=True", "enable_prefix_caching=False")
    assert chat.missing_defaults(off) == ["enable_prefix_caching=True"]
    eager = ENGINE_LINE.replace("VLLM_COMPILE: 3", "NONE: 0").replace("FULL_AND_PIECEWISE: (2, 1)", "FULL: (2, 2)")
    assert chat.missing_defaults(eager) == list(chat.ENGINE_DEFAULTS[1:])
    assert chat.missing_defaults("no engine line") == list(chat.ENGINE_DEFAULTS)


def _row(rate: float | None, ttft90: float, tpot90: float = 30.0, **extra) -> dict:
    return {"rate": rate, "prompts": 300, "completed": 300, "failed": 0, "duration_s": 15.0,
            "request_throughput": 19.5 if rate else 60.0, "request_goodput": 19.0, "output_throughput": 1.0,
            "ttft_p50_ms": 100.0, "ttft_p90_ms": ttft90, "ttft_p99_ms": 1500.0, "tpot_p50_ms": 20.0,
            "tpot_p90_ms": tpot90, "tpot_p99_ms": 44.0, "wall_s": 30.0,
            "server_metrics": {"cache_queries": 1e5, "cache_hits": 8.1e4, "cache_hit_rate": 0.81,
                               "engine_steps": 1200.0, "decode_batch": 64.5, "past_graphs": 0.042},
            "adapter_slo": {"adapters": 300, "meeting": 290}, "gpu_busy": 92.6, **extra}


def test_table_and_ratio_lines():
    learned = {"sha256": "abc", "planned_skip": 0.5}
    modes = {"lorazor": {"facts": ["server ready after 240 s"], "error": None, "bundle": learned,
                         "rows": [_row(None, 9000.0), _row(60.0, 500.0, counters={"realized_skip": 0.4921},
                                                              ttft_by_popularity=[83.2, 124.5, None, 1121.0]),
                                  _row(90.0, 2000.0), _row(75.0, 900.0)]},
             "lorazor-sync": {"facts": [], "error": None, "bundle": learned,
                              "rows": [_row(40.0, 500.0), _row(60.0, 1500.0), _row(50.0, 700.0)]},
             "lorazor-lag0": {"facts": [], "error": None, "bundle": {"sha256": "0ab", "lag_of": "abc"},
                              "rows": [_row(50.0, 500.0), _row(70.0, 1500.0), _row(60.0, 700.0)]},
             "gridtrim": {"facts": [], "error": None, "rows": [_row(30.0, 200.0), _row(45.0, 3000.0)]},
             "stock": {"facts": [], "error": "rate 20: vllm bench serve failed (rc 1)",
                       "rows": [_row(12.5, 900.0), _row(18.0, 1900.0)]}}
    assert chat.ratio_lines(512, modes, SLO) == [
        "chat512 goodput [vLLM defaults]: lorazor/stock = 6.00, lorazor/gridtrim = 2.50", "learned async/sync = 1.50",
        "learned lag 1/lag 0 [async] = 1.25"]
    other = modes | {"lorazor-sync": modes["lorazor-sync"] | {"bundle": {"sha256": "def"}},
                     "lorazor-lag0": modes["lorazor-lag0"] | {"bundle": {"sha256": "0ab", "lag_of": "def"}}}
    assert chat.ratio_lines(512, other, SLO)[1:] == [
        "learned async/sync = n/a (lorazor and lorazor-sync served different bundles)",
        "learned lag 1/lag 0 [async] = n/a (lorazor-lag0 is not lorazor's bundle with lag 0)"]
    assert chat.ratio_lines(512, {"stock": modes["stock"]}, SLO) == [
        "chat512 goodput [vLLM defaults]: lorazor/stock = n/a, lorazor/gridtrim = n/a", "learned async/sync = n/a",
        "learned lag 1/lag 0 [async] = n/a"]
    doc = {"preamble": ["pre"], "modes": modes, "notes": ["note"], "ratio": chat.ratio_lines(512, modes, SLO)}
    lines = chat.render(doc, SLO).splitlines()
    assert lines[2] == chat.SUMMARY_HEADER
    # lorazor at its goodput rate, 75 req/s (no counters in that row)
    assert lines[4] == ("| lorazor (GridTrim + the learned bundle) | 75 | 90 | 60.0 | 1500.0 | 44.0 | 81.0% | "
                        "290/300 | 64.5 | 12.5 | 4.2% | 93% | — | 6.00 |")
    assert lines[8] == ("| stock | 12.5 | 18 | — | 1500.0 | 44.0 | 81.0% | 290/300 | 64.5 | 12.5 | 4.2% | 93% | "
                        "— | 1.00 |")
    i = lines.index(chat.HEADER)
    assert lines[i - 2] == "lorazor (GridTrim + the learned bundle); server ready after 240 s"
    assert lines[i + 2] == ("| inf | 300 | 300 | 60.0 | 9000.0 | 1500.0 | 30.0 | 44.0 | 81.0% | 290/300 | 64.5 | "
                            "12.5 | 4.2% | 93% | — | — | probe |")  # 12.5 ms: 15 s over 1200 engine steps
    assert lines[i + 3] == ("| 60 | 300 | 300 | 19.5 | 500.0 | 1500.0 | 30.0 | 44.0 | 81.0% | 290/300 | 64.5 | 12.5 | "
                            "4.2% | 93% | 0.492 | 83 / 124 / — / 1121 | met |")
    old = _row(60.0, 500.0)
    # a row kept from before steps, graphs and GPU were recorded
    del old["server_metrics"]["engine_steps"], old["server_metrics"]["past_graphs"], old["gpu_busy"]
    assert chat.step_ms(old) is None and " | 64.5 | — | — | — | — | — | met |" in chat.format_row(old, SLO)
    assert "stopped: rate 20: vllm bench serve failed (rc 1)" in lines
    assert lines[-3:] == doc["ratio"] and lines[-5] == "note"


def _args(tmp_path: Path, **kw) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    chat.add_shape_arguments(ap)
    goodput.add_sweep_arguments(ap)
    args = ap.parse_args(["--adapters", "4"])
    return argparse.Namespace(**vars(args) | {"out": tmp_path / "out", "work": tmp_path / "work", "seed": 0,
                                              "max_loras": 2, "bundle": None, "max_capture_size": None,
                                              "gridtrim_launch": DEFAULT_LAUNCH} | kw)


def test_a_given_bundle_is_served_and_kept_with_the_table(tmp_path):
    head = Head("a00", np.linspace(-1, 1, 8).astype(np.float32), 0.25, 3, 9, 4, "ok")
    entries = [chat_bundle.learned_entry(bench.adapter_name(a), f"{a:064x}", head, -0.5, {"heldout_skip": 0.5})
               for a in range(4)]
    given = chat_bundle.write_learned_bundle(tmp_path / "given", entries, synthetic.LLAMA32_3B | {"hidden_size": 8})
    chat_bundle.summary_path(given).write_text(json.dumps({"planned_skip": 0.497, "heldout_requests": 512}))
    args = _args(tmp_path, bundle=given)
    args.out.mkdir()
    path, described = chat.learned_bundle(args, chat.shape_from(args), 0.0, None)
    sha = hashlib.sha256((given / "manifest.json").read_bytes()).hexdigest()[:12]
    assert path == given and described == {"sha256": sha, "planned_skip": 0.497, "heldout_requests": 512}
    kept = args.out / "learned"
    assert (kept / "manifest.json").read_bytes() == (given / "manifest.json").read_bytes()
    assert json.loads(chat_bundle.summary_path(kept).read_text())["planned_skip"] == 0.497
    # served again from the copy kept with the table: the same bundle, nothing copied over itself
    assert chat.learned_bundle(_args(tmp_path, bundle=kept), chat.shape_from(args), 0.0, None) == (kept, described)
    with pytest.raises(HarnessError, match="no bundle there"):
        chat.learned_bundle(_args(tmp_path, bundle=tmp_path / "nothing"), chat.shape_from(args), 0.0, None)


def test_the_bundle_is_prepared_on_the_modes_gpu_once_and_a_failure_leaves_nothing(tmp_path, monkeypatch):
    """Without --bundle the preparation runs (here a stand-in for chat_bundle's command) on the
    learned mode's GPU, into --work, and is kept there; a failed one is an error with its log's
    tail and leaves no half-written bundle."""
    calls: list[tuple[list[str], dict]] = []
    fails = [False]

    def prepare(cmd, env, stdout, **kw):
        calls.append((cmd, env))
        stdout.write("capturing hidden states\n" + ("CUDA error: out of memory\n" if fails[0] else ""))
        bundle = Path(cmd[cmd.index("--bundle") + 1])
        bundle.mkdir(parents=True)
        (bundle / "manifest.json").write_text("{}")
        return subprocess.CompletedProcess(cmd, int(fails[0]))

    monkeypatch.setattr(chat.subprocess, "run", prepare)
    args = _args(tmp_path)
    args.out.mkdir()
    shape = chat.shape_from(args)
    path, described = chat.learned_bundle(args, shape, time.monotonic() + 600, "2")
    assert path.parent == args.work / "learned" and (args.out / "learned" / "manifest.json").exists()
    (cmd, env), = calls
    assert cmd[1:3] == ["-m", "benchmarks.serving.chat_bundle"] and env["CUDA_VISIBLE_DEVICES"] == "2"
    assert chat.learned_bundle(args, shape, time.monotonic() + 600, "3")[0] == path and len(calls) == 1  # kept

    failing, fails[0] = _args(tmp_path / "fail"), True
    failing.out.mkdir(parents=True)
    with pytest.raises(HarnessError, match="(?s)not prepared \\(1\\).*CUDA error: out of memory"):
        chat.learned_bundle(failing, shape, time.monotonic() + 600, None)
    assert len(calls) == 2 and not any((failing.work / "learned").iterdir())


def test_append_extends_only_a_table_of_the_same_workload(tmp_path):
    args = _args(tmp_path)
    pre = chat.preamble(args, "0.33.0", SLO, chat.shape_from(args))
    assert pre[0].startswith("Chat workload goodput against vLLM's defaults: vLLM 0.33.0")
    path = tmp_path / "chat.json"
    path.write_text(json.dumps({"preamble": pre, "modes": {"stock": {"rows": []}}, "notes": ["n1"], "ratio": []}))
    assert goodput.load_table(path, pre, append=True)["modes"] == {"stock": {"rows": []}}
    skewed = _args(tmp_path, zipf=1.2)
    assert goodput.load_table(path, chat.preamble(skewed, "0.33.0", SLO, chat.shape_from(skewed)), append=True) is None


def test_the_graphs_line_is_a_table_of_its_own(tmp_path):
    """``--max-capture-size``: every mode's server gets vLLM's compilation option and nothing else
    that differs; the preamble and the ratio lines say so, and a defaults table is not extended by it."""
    for mode in chat.MODES:
        f = flags(chat.server_command(Path("/w/model"), mode, ADAPTERS, 2, 8123, max_capture_size=2048))
        assert set(f) - set(SERVE_OPTIONS_033) == {"--compilation-config"}  # arg_utils.py:1891 of vLLM 0.33.0
        assert json.loads(f["--compilation-config"][0]) == {"max_cudagraph_capture_size": 2048}
    args, graphs = _args(tmp_path), _args(tmp_path, max_capture_size=2048)
    pre, pre_graphs = (chat.preamble(a, "0.33.0", SLO, chat.shape_from(a)) for a in (args, graphs))
    launch = f"GridTrim's kernels launched by {DEFAULT_LAUNCH} (LORAZOR_GRIDTRIM_LAUNCH)"
    assert f"its default CUDA graphs; {launch}," in pre[0]  # every table names its launch, the default too
    assert ("graphs up to 2048 tokens (--compilation-config max_cudagraph_capture_size=2048 in every mode)"
            in pre_graphs[0])
    path = tmp_path / "chat.json"
    path.write_text(json.dumps({"preamble": pre, "modes": {}, "notes": [], "ratio": []}))
    assert goodput.load_table(path, pre_graphs, append=True) is None
    assert chat.ratio_lines(512, {}, SLO, chat.settings_tag(2048))[0] == (
        "chat512 goodput [vLLM defaults, CUDA graphs up to 2048 tokens]: lorazor/stock = n/a, lorazor/gridtrim = n/a")


def test_refuses_a_vllm_it_was_not_written_for(tmp_path, capsys):
    if chat.installed_version() in chat.VERSIONS:
        pytest.skip("a vLLM the chat harness runs on is installed here")
    assert chat.main(["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")]) == 2
    assert "chat runs on vLLM 0.34.0 or 0.33.0 (" in capsys.readouterr().err
    assert not (tmp_path / "work").exists()  # refused before writing anything


def _stand_in(tmp_path: Path, monkeypatch) -> tuple[list[str], Path]:
    """The chat harness's arguments against the goodput test's stand-in `vllm` (a given learned
    bundle, a tiny workload and sweep), and the file the stand-in records into."""
    use_stand_in(tmp_path, monkeypatch)
    record = tmp_path / "record.jsonl"
    monkeypatch.setattr(chat, "installed_version", lambda: chat.VERSIONS[0])
    monkeypatch.setattr(goodput, "prepare_files", lambda work, n, r, s: None)
    monkeypatch.setenv("FAKE_RECORD", str(record))
    head = Head("a00", np.linspace(-1, 1, 8).astype(np.float32), 0.25, 3, 9, 4, "ok")
    entries = [chat_bundle.learned_entry(bench.adapter_name(a), f"{a:064x}", head, -0.5, {}) for a in range(4)]
    given = chat_bundle.write_learned_bundle(tmp_path / "given", entries, synthetic.LLAMA32_3B | {"hidden_size": 8})
    argv = ["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--adapters", "4", "--max-loras", "2",
            "--bundle", str(given), "--system-len", "5", "10", "--user-len", "3", "6", "--output-len", "2", "8",
            "--probe-prompts", "16", "--min-prompts", "8", "--duration-s", "1", "--min-mode-s", "1",
            "--budget-s", "300", "--client-overhead-s", "0"]
    return argv, record


def _check_table(out: Path, order: list[str]) -> list[dict]:
    """Every mode of ``order`` measured without error, probe then sweep, its goodput bracketed; both
    ratio lines measured; the learned modes on one bundle. The stand-in's records."""
    doc = json.loads((out / "chat.json").read_text())
    assert list(doc["modes"]) == order
    for mode, entry in doc["modes"].items():
        assert entry["error"] is None, (mode, entry["error"])
        assert entry["rows"][0]["rate"] is None and len(entry["rows"]) > 2  # the probe, then the sweep
        row = entry["rows"][1]
        assert row["server_metrics"]["cache_hit_rate"] == pytest.approx(0.6)
        assert row["adapter_slo"]["adapters"] > 0 and ("counters" in row) == (mode in chat.LEARNED)
        bands = row["ttft_by_popularity"]
        assert len(bands) == len(chat.RANK_BANDS) + 1 and bands[0] is not None and bands[0] > 0
        best, low_miss = goodput.goodput_rate(goodput.points_of(entry, SLO))
        assert best is not None and low_miss is not None and best < low_miss
    assert doc["modes"]["lorazor"]["bundle"] == doc["modes"]["lorazor-sync"]["bundle"]
    lines = doc["ratio"]
    assert lines[0].startswith("chat4 goodput [vLLM defaults]: lorazor/stock = ") and "n/a" not in lines[0]
    assert lines[1].startswith("learned async/sync = ") and "n/a" not in lines[1]
    assert lines[2].startswith("learned lag 1/lag 0 [async] = ") and "n/a" not in lines[2]
    lag0 = doc["modes"]["lorazor-lag0"]
    assert lag0["bundle"]["lag_of"] == doc["modes"]["lorazor"]["bundle"]["sha256"] != lag0["bundle"]["sha256"]
    assert {e.lag for e in load_bundle(out / "learned-lag0").adapters.values()} == {0}
    assert (out / "chat.txt").read_text().endswith("\n".join(lines) + "\n")
    return [json.loads(line) for line in (out.parent / "record.jsonl").read_text().splitlines()]


def test_a_whole_call_against_a_stand_in_vllm(tmp_path, monkeypatch):
    """Every mode of the chat benchmark, through the stand-in `vllm serve` and `vllm bench serve` of
    the goodput test, over two calls into one table: each server checked for vLLM's defaults and its
    plugin lines, warmed up, swept; the table, its summary and its two ratio lines."""
    argv, _ = _stand_in(tmp_path, monkeypatch)
    assert chat.main(argv + ["--modes", "lorazor", "gridtrim", "stock"]) == 0
    assert chat.main(argv + ["--modes", "lorazor-sync", "lorazor-lag0", "nolora", "--append"]) == 0

    seen = _check_table(tmp_path / "out", ["lorazor", "gridtrim", "stock", "lorazor-sync", "lorazor-lag0", "nolora"])
    servers = [s for s in seen if s["what"] == "serve"]
    assert [("--no-async-scheduling" in s["argv"], "--enable-lora" in s["argv"]) for s in servers] == [
        (False, True), (False, True), (False, True), (True, True), (False, True), (False, False)]
    lag0 = servers[4]["env"]["LORAZOR_BUNDLE"]
    assert lag0 == str(tmp_path / "out" / "learned-lag0") and servers[0]["env"]["LORAZOR_BUNDLE"] != lag0
    assert not any("CUDA_VISIBLE_DEVICES" in s["env"] or "VLLM_CACHE_ROOT" in s["env"] for s in servers)
    clients = [s for s in seen if s["what"] == "bench"]
    assert {s["mode"] for s in clients} == set(chat.MODES) and all(s["lorazor"] == [] for s in clients)


def test_the_graphs_line_checks_the_servers_largest_graph(tmp_path, monkeypatch):
    """A server of the second line must report the largest CUDA graph asked for; one that reports
    another is an error of that mode, named in its row."""
    argv, _ = _stand_in(tmp_path, monkeypatch)
    assert chat.main(argv + ["--modes", "gridtrim", "--max-capture-size", "2048"]) == 0
    doc = json.loads((tmp_path / "out" / "chat.json").read_text())
    assert doc["modes"]["gridtrim"]["error"] is None
    assert "vLLM's largest CUDA graph: 2048 tokens" in doc["modes"]["gridtrim"]["facts"]
    assert doc["ratio"][0].startswith("chat4 goodput [vLLM defaults, CUDA graphs up to 2048 tokens]: ")
    monkeypatch.setenv("FAKE_LARGEST_GRAPH", "512")
    other = ["--out", str(tmp_path / "other"), "--modes", "gridtrim", "--max-capture-size", "2048"]
    assert chat.main(argv + other) == 1
    error = json.loads((tmp_path / "other" / "chat.json").read_text())["modes"]["gridtrim"]["error"]
    assert "gives a largest CUDA graph of 512 tokens, not the 2048 asked" in error


def test_the_other_launch_line(tmp_path, monkeypatch):
    """``--gridtrim-launch`` other than the default: GridTrim's servers (and only theirs) get it in
    ``LORAZOR_GRIDTRIM_LAUNCH``, the preamble and the ratio lines say so, and a server whose GridTrim
    line names another launch is an error of that mode."""
    argv, record = _stand_in(tmp_path, monkeypatch)
    assert chat.main(argv + ["--modes", "gridtrim", "stock", "--gridtrim-launch", OTHER_LAUNCH]) == 0
    doc = json.loads((tmp_path / "out" / "chat.json").read_text())
    assert doc["modes"]["gridtrim"]["error"] is None
    assert doc["ratio"][0].startswith(f"chat4 goodput [vLLM defaults, GridTrim launched by {OTHER_LAUNCH}]: ")
    assert f"GridTrim's kernels launched by {OTHER_LAUNCH} (LORAZOR_GRIDTRIM_LAUNCH)" in doc["preamble"][0]
    seen = [json.loads(line) for line in record.read_text().splitlines()]
    servers = [s for s in seen if s["what"] == "serve"]
    assert [s["env"].get("LORAZOR_GRIDTRIM_LAUNCH") for s in servers] == [OTHER_LAUNCH, None]
    monkeypatch.setenv("FAKE_GRIDTRIM_LAUNCH", DEFAULT_LAUNCH)
    other = ["--out", str(tmp_path / "other"), "--modes", "gridtrim", "--gridtrim-launch", OTHER_LAUNCH]
    assert chat.main(argv + other) == 1
    error = json.loads((tmp_path / "other" / "chat.json").read_text())["modes"]["gridtrim"]["error"]
    assert f"lacks GridTrim's line with 'compiled launches: {OTHER_LAUNCH}'" in error
    assert chat.settings_tag(2048, OTHER_LAUNCH) == (
        f"[vLLM defaults, CUDA graphs up to 2048 tokens, GridTrim launched by {OTHER_LAUNCH}]")
    assert chat.settings_tag(None, DEFAULT_LAUNCH) == "[vLLM defaults]"


def test_a_profiled_run_after_the_sweep(tmp_path, monkeypatch):
    """``--profile-rate``: the server starts with vLLM's profiler configured, the sweep runs as
    without it, then one more run between /start_profile and /stop_profile, whose trace becomes a
    line of the mode's facts."""
    argv, record = _stand_in(tmp_path, monkeypatch)
    assert chat.main(argv + ["--modes", "gridtrim", "--profile-rate", "5"]) == 0
    entry = json.loads((tmp_path / "out" / "chat.json").read_text())["modes"]["gridtrim"]
    assert entry["error"] is None and len(entry["rows"]) > 2
    line = next(f for f in entry["facts"] if f.startswith("profile at 5 req/s"))
    assert line == ("profile at 5 req/s (stand_in_worker.1.pt.trace.json.gz, not in the sweep): 4 steps of 0.01 ms: "
                    "0.00 ms in execute_model, 0.01 ms outside it; GPU busy 53% (1 device events per step); "
                    "39.0 tokens and 9.0 decoding requests per step; past the 512-token graph: 0 steps of — ms in "
                    "execute_model, within: 0.00 ms; LoRA kernels 0.00 ms per step")
    seen = [json.loads(s) for s in record.read_text().splitlines()]
    what = [s["what"] for s in seen if s["what"] in ("serve", "bench", "start_profile", "stop_profile")]
    assert what[0] == "serve" and what[-3:] == ["start_profile", "bench", "stop_profile"]
    assert "--profiler-config" in seen[0]["argv"]
    assert list((tmp_path / "out" / "gridtrim" / "profile").glob("rate_5*.json"))


def test_the_six_modes_run_at_once_one_gpu_each(tmp_path, monkeypatch):
    """``--gpus 0 1 2 3 4 5``: one call, the six servers at once (the stand-in's servers become
    healthy only once all six have started: one after another, none would), each seeing its own
    GPU and compiling into that GPU's vLLM cache; the same table as over several calls."""
    argv, _ = _stand_in(tmp_path, monkeypatch)
    (tmp_path / "together").mkdir()
    monkeypatch.setenv("FAKE_TOGETHER", f"6:{tmp_path / 'together'}")
    assert chat.main(argv + ["--gpus", *map(str, range(6)), "--ready-timeout-s", "60"]) == 0

    seen = _check_table(tmp_path / "out", list(chat.MODES))
    servers = {s["argv"][s["argv"].index("--port") + 1]: s["env"] for s in seen if s["what"] == "serve"}
    assert sorted(e["CUDA_VISIBLE_DEVICES"] for e in servers.values()) == list(map(str, range(6)))
    assert len({e["VLLM_CACHE_ROOT"] for e in servers.values()}) == 6
    doc = json.loads((tmp_path / "out" / "chat.json").read_text())
    assert doc["notes"][0].endswith("modes lorazor lorazor-sync lorazor-lag0 gridtrim stock nolora, at once on GPUs "
                                    "0 1 2 3 4 5 (one server per GPU)")
    assert [e["facts"][0] for e in doc["modes"].values()] == [f"GPU {g}" for g in range(6)]
