"""The goodput harness on CPU (benchmarks/serving/goodput.py): the word tokenizer at Llama-3.2-3B's
vocabulary, the commands and environments per mode, vLLM 0.33.0's result JSON, the goodput-rate
rule, the rate sweep, and one whole call against a stand-in ``vllm`` CLI (server and client)."""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from benchmarks.serving import bench, bench_client, bench_workload, goodput, synthetic, vllm_server
from benchmarks.serving.goodput import Slo, Sweep
from benchmarks.serving.synthetic import write_word_tokenizer
from benchmarks.serving.vllm_settings import VllmSettings
from serve_bridge.gridtrim import DEFAULT_LAUNCH
from serve_bridge.steptrim import skip_fraction

SLO = Slo()
ADAPTERS = {bench.adapter_name(a): Path(f"/w/adapters/{bench.adapter_name(a)}") for a in range(3)}


def flags(cmd: list[str]) -> dict[str, list[str]]:
    """A command line's options → their values (the words up to the next option)."""
    out: dict[str, list[str]] = {}
    key = None
    for word in cmd:
        if word.startswith("--"):
            key = word
            out[key] = []
        elif key is not None:
            out[key].append(word)
    return out


# -- the tokenizer -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The word tokenizer in a Llama-3.2-3B model directory, loaded as vLLM 0.33.0 loads it:
    AutoTokenizer with the directory's config (tokenizers/registry.py:276-278, tokenizers/hf.py:183)."""
    transformers = pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("model")
    (d / "config.json").write_text(json.dumps(synthetic.LLAMA32_3B))
    write_word_tokenizer(d, synthetic.LLAMA32_3B)
    return transformers.AutoTokenizer.from_pretrained(d, config=transformers.AutoConfig.from_pretrained(d))


def test_tokenizer_has_the_models_vocabulary(tokenizer):
    assert tokenizer.vocab_size == len(tokenizer) == synthetic.LLAMA32_3B["vocab_size"] == 128256
    assert max(tokenizer.get_vocab().values()) == 128255  # vLLM's max_token_id (tokenizers/hf.py:123-133)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (128000, 128001)
    assert sorted(tokenizer.all_special_ids) == [128000, 128001]
    # nothing added around a text: the random dataset subtracts these from the input length
    # (benchmarks/datasets/utils.py:68-69), and the server's completions encode adds them
    assert tokenizer.num_special_tokens_to_add() == 0


def test_random_ids_round_trip_over_the_whole_vocabulary(tokenizer):
    ids = np.random.default_rng(0).integers(0, 128256, 20000).tolist() + [0, 1, 128255, 128000, 128001]
    text = tokenizer.decode(ids)
    assert tokenizer.encode(text, add_special_tokens=False) == ids
    assert tokenizer.encode(text) == ids  # the server's default for completions adds nothing either
    assert tokenizer.decode([5, 6]) == "t5 t6"


def test_random_dataset_prompts_keep_their_length(tokenizer):
    """vLLM 0.33.0's random dataset: ids other than the special ones (benchmarks/datasets/datasets.py:627-629),
    the sequence (offset + index + arange(len)) over them (:747-748), decoded and
    re-encoded without special tokens (:519-520); a length that holds needs no adjustment (:526)."""
    allowed = np.array(sorted(set(range(tokenizer.vocab_size)) - set(tokenizer.all_special_ids)))
    rng = np.random.default_rng(1)
    for index, length in enumerate((100, 173, 300)):
        offset = int(rng.integers(0, tokenizer.vocab_size))
        seq = allowed[(offset + index + np.arange(length)) % len(allowed)].tolist()
        assert tokenizer.encode(tokenizer.decode(seq), add_special_tokens=False) == seq


def test_random_dataset_lengths_are_bench_ranges():
    """vLLM 0.33.0's length interval (benchmarks/datasets/utils.py:68-77, no special tokens added),
    drawn with rng.integers(low, high + 1) (:96-97): uniform over bench.py's inclusive ranges."""
    def interval(mean: int, ratio: float) -> tuple[int, int]:
        return max(math.floor(mean * (1 - ratio)), 1), max(math.ceil(mean * (1 + ratio)), 1)

    assert interval(*goodput.RANDOM_INPUT) == bench_workload.PROMPT_LEN == (100, 300)
    assert interval(*goodput.RANDOM_OUTPUT) == bench_workload.OUTPUT_LEN == (20, 100)


# -- commands and environments ------------------------------------------------------------------------

# Every option the harness gives `vllm serve`, where vLLM 0.33.0 defines it (engine/arg_utils.py; the
# frontend's in entrypoints/common/cli_args.py, one flag per field at :280-284); a bool's --no- form comes
# from argparse.BooleanOptionalAction (arg_utils.py:384-386, and :1610 for --enable-lora).
SERVE_OPTIONS_033 = {
    "--host": "common/cli_args.py:293", "--port": "common/cli_args.py:295",
    "--disable-uvicorn-access-log": "common/cli_args.py:319", "--lora-modules": "common/cli_args.py:81",
    "--load-format": "arg_utils.py:1085", "--skip-tokenizer-init": "arg_utils.py:1025",
    "--max-num-seqs": "arg_utils.py:1754", "--max-num-batched-tokens": "arg_utils.py:1740",
    "--enable-prefix-caching": "arg_utils.py:1402", "--async-scheduling": "arg_utils.py:1811",
    "--dtype": "arg_utils.py:977", "--compilation-config": "arg_utils.py:1891", "--enable-lora": "arg_utils.py:1610",
    "--max-loras": "arg_utils.py:1614", "--max-lora-rank": "arg_utils.py:1615", "--max-cpu-loras": "arg_utils.py:1624",
    "--specialize-active-lora": "arg_utils.py:1633", "--worker-extension-cls": "arg_utils.py:1372",
}
BOOLEAN_033 = {"--disable-uvicorn-access-log", "--skip-tokenizer-init", "--enable-prefix-caching",
               "--async-scheduling", "--enable-lora", "--specialize-active-lora"}
# Every option the harness gives `vllm bench serve`, where vLLM 0.33.0 defines it (benchmarks/serve.py;
# the dataset's in benchmarks/datasets/datasets.py).
BENCH_OPTIONS_033 = {
    "--backend": "serve.py:1648", "--base-url": "serve.py:1655", "--endpoint": "serve.py:1664",
    "--model": "serve.py:1693", "--tokenizer": "serve.py:1716", "--request-rate": "serve.py:1746",
    "--burstiness": "serve.py:1755", "--disable-tqdm": "serve.py:1776", "--save-result": "serve.py:1792",
    "--metadata": "serve.py:1808", "--result-dir": "serve.py:1816", "--result-filename": "serve.py:1823",
    "--ignore-eos": "serve.py:1832", "--percentile-metrics": "serve.py:1848", "--metric-percentiles": "serve.py:1859",
    "--goodput": "serve.py:1868", "--temperature": "serve.py:1907", "--lora-modules": "serve.py:1945",
    "--lora-assignment": "serve.py:1955", "--seed": "datasets.py:1585", "--num-prompts": "datasets.py:1587",
    "--dataset-name": "datasets.py:1593", "--random-input-len": "datasets.py:1888",
    "--random-output-len": "datasets.py:1894", "--random-range-ratio": "datasets.py:1900",
}


@pytest.mark.parametrize("mode", goodput.MODES)
def test_server_command(mode):
    cmd = goodput.server_command(Path("/w/model"), mode, ADAPTERS, 2, 8123)
    assert cmd[:5] == [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "/w/model"]
    f = flags(cmd)
    unknown = [k for k in f if k not in SERVE_OPTIONS_033
               and not (k.startswith("--no-") and "--" + k[5:] in BOOLEAN_033)]
    assert not unknown
    assert f["--port"] == ["8123"] and f["--load-format"] == ["dummy"] and f["--dtype"] == ["bfloat16"]
    assert "--no-skip-tokenizer-init" in f and "--skip-tokenizer-init" not in f  # the server needs its tokenizer
    # nothing turns a vLLM default off
    assert not [k for k in f if k.startswith("--no-") and k != "--no-skip-tokenizer-init"]
    assert "--compilation-config" not in f and "--async-scheduling" not in f  # nothing to turn on either
    assert f["--max-num-seqs"] == ["256"] and f["--max-num-batched-tokens"] == ["2048"]
    lora = mode != "nolora"
    assert ("--enable-lora" in f) == lora and ("--lora-modules" in f) == lora
    if lora:
        assert f["--lora-modules"] == [f"a0{a}=/w/adapters/a0{a}" for a in range(3)]
        assert f["--max-loras"] == ["2"] and f["--max-cpu-loras"] == ["3"] and f["--max-lora-rank"] == ["8"]
    assert "--specialize-active-lora" not in f  # vLLM's default: off
    tuned = flags(goodput.server_command(Path("/w/model"), mode, ADAPTERS, 2, 8123,
                                         VllmSettings(specialize_active_lora=True)))
    assert ("--specialize-active-lora" in tuned) == (mode in ("stock", "steptrim"))  # where vLLM's kernels run
    assert ("--worker-extension-cls" in f) == (mode in ("steptrim", "both"))
    second = VllmSettings("full", async_scheduling=False, prefix_caching=False, capture_sizes=(1, 2048))
    off = flags(goodput.server_command(Path("/w/model"), mode, ADAPTERS, 2, 8123, second))
    assert "--no-async-scheduling" in off and "--no-enable-prefix-caching" in off  # a second line, named
    assert json.loads(off["--compilation-config"][0]) == {"cudagraph_capture_sizes": [1, 2048], "mode": 0,
                                                          "cudagraph_mode": "FULL"}


@pytest.mark.parametrize("mode", goodput.MODES)
def test_server_environment(mode):
    environ = {"PATH": "/bin", "LORAZOR_GRIDTRIM": "1", "LORAZOR_BUNDLE": "/elsewhere", "LORAZOR_SLOTS": "0",
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env = goodput.server_env(mode, environ, Path("/w/bundle"), ADAPTERS)
    lorazor = {k: v for k, v in env.items() if k.startswith("LORAZOR_")}
    want: dict[str, str] = {}
    if mode in ("gridtrim", "both"):
        want["LORAZOR_GRIDTRIM"] = "1"
    if mode in ("steptrim", "both"):
        want |= {"LORAZOR_BUNDLE": "/w/bundle", "LORAZOR_LOG_INTERVAL_S": "0",
                 "LORAZOR_ADAPTERS": "a00=/w/adapters/a00,a01=/w/adapters/a01,a02=/w/adapters/a02"}
    assert lorazor == want  # stock and nolora: no LORAZOR_* variable; slot hand-back on (no LORAZOR_SLOTS)
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    assert env["PATH"] == "/bin" and env["HF_HUB_OFFLINE"] == "1"


def test_client_environment():
    env = goodput.client_env({"PATH": "/bin", "LORAZOR_BUNDLE": "/b", "LORAZOR_GRIDTRIM": "1"})
    assert env == {"PATH": "/bin", "HF_HUB_OFFLINE": "1"}


def test_expected_plugin_lines():
    assert [goodput.expected_markers(m) for m in goodput.MODES] == [
        set(), {"gridtrim"}, {"steptrim", "slots"}, {"gridtrim", "steptrim", "slots"}, set()]
    log = ("(EngineCore_DP0 pid=7) INFO 12-04 10:00:01 [punica_wrapper.py:39] LoRazor GridTrim active: LoRA linears "
           "use the work-list kernels (2048 tokens, 33 slots, 132 persistent programs).\n"
           "(EngineCore_DP0 pid=7) INFO 12-04 10:00:02 [scheduler.py:101] LoRazor slot hand-back active: released "
           "requests stop counting against max_loras=32.\n")
    assert goodput.found_markers(log) == {"gridtrim", "slots"}
    assert goodput.found_markers("INFO vLLM API server version 0.33.0\n") == set()


def test_client_command():
    cmd = goodput.client_command("http://127.0.0.1:8123", Path("/w/model"), 12.5, 250, ["a00", "a01"], 0, SLO,
                                 Path("/o/both/rate_12.5.json"), "both")
    assert cmd[:2] == ["--backend", "openai"]  # the options after `vllm bench serve`
    f = flags(cmd)
    assert set(f) <= set(BENCH_OPTIONS_033)
    assert f["--request-rate"] == ["12.5"] and f["--num-prompts"] == ["250"] and f["--burstiness"] == ["1.0"]
    assert f["--model"] == f["--tokenizer"] == ["/w/model"] and f["--dataset-name"] == ["random"]
    assert (f["--random-input-len"], f["--random-output-len"]) == (["200"], ["60"])
    assert json.loads(f["--random-range-ratio"][0]) == {"input": 0.5, "output": 0.66}
    assert f["--goodput"] == ["ttft:1000", "tpot:50"] and f["--metric-percentiles"] == ["50,90,99"]
    assert f["--percentile-metrics"] == ["ttft,tpot,itl,e2el"]
    assert f["--result-dir"] == ["/o/both"] and f["--result-filename"] == ["rate_12.5.json"] and "--save-result" in f
    assert f["--lora-modules"] == ["a00", "a01"] and f["--lora-assignment"] == ["random"] and "--ignore-eos" in f
    probe = flags(goodput.client_command("http://h:1", Path("/w/model"), math.inf, 512, [], 3, Slo(800, 40),
                                         Path("/o/nolora/rate_inf.json"), "nolora"))
    assert probe["--request-rate"] == ["inf"] and probe["--seed"] == ["3"] and probe["--goodput"] == ["ttft:800",
                                                                                                       "tpot:40"]
    assert "--lora-modules" not in probe and "--lora-assignment" not in probe  # nolora: the backbone


def test_cli_flags():
    assert goodput.cli_flags({"max_loras": 32, "enable_lora": True, "async_scheduling": False,
                              "compilation_config": {"mode": 0}, "lora_target_modules": ["o_proj", "down_proj"]}) == [
        "--max-loras", "32", "--enable-lora", "--no-async-scheduling", "--compilation-config", '{"mode": 0}',
        "--lora-target-modules", "o_proj", "down_proj"]


# -- results ------------------------------------------------------------------------------------------

# A `vllm bench serve --save-result` file as vLLM 0.33.0 writes it with --metric-percentiles 50,90,99,
# --percentile-metrics ttft,tpot,itl,e2el and --goodput: the call's setup (benchmarks/serve.py:2304-2336),
# the benchmark's result (:1319-1339, merged at :2338; per-request lists dropped without --save-detailed, :2428-2444) and each
# metric's mean/median/std and p{P} (:1425-1432).
RESULT_033 = {
    "date": "20261204-101500", "endpoint_type": "openai", "backend": "openai", "label": None,
    "model_id": "/w/model", "tokenizer_id": "/w/model", "num_prompts": 400, "mode": "both",
    "request_rate": 20.0, "burstiness": 1.0, "max_concurrency": None,
    "duration": 21.4, "completed": 400, "failed": 0, "total_input_tokens": 80123, "total_output_tokens": 24011,
    "request_throughput": 18.69, "request_goodput": 17.9, "output_throughput": 1122.0,
    "total_token_throughput": 4866.0, "latencies": [], "queue_times": [], "max_output_tokens_per_s": 1300.0,
    "max_concurrent_requests": 60, "rtfx": 0.0,
} | {f"{stat}_{m}_ms": 1.0 for stat in ("mean", "median", "std") for m in ("ttft", "tpot", "itl", "e2el")} | {
    f"p{p}_{m}_ms": v for m, vals in (("ttft", (180.0, 640.5, 1200.0)), ("tpot", (21.0, 38.2, 55.0)),
                                      ("itl", (20.0, 30.0, 90.0)), ("e2el", (1500.0, 3000.0, 4000.0)))
    for p, v in zip((50, 90, 99), vals)}


def test_parse_result():
    row = goodput.parse_result(RESULT_033)
    assert row == {"completed": 400, "failed": 0, "duration_s": 21.4, "request_throughput": 18.69,
                   "request_goodput": 17.9, "output_throughput": 1122.0, "ttft_p50_ms": 180.0, "ttft_p90_ms": 640.5,
                   "ttft_p99_ms": 1200.0, "tpot_p50_ms": 21.0, "tpot_p90_ms": 38.2, "tpot_p99_ms": 55.0}
    # without a tokenizer the client writes no TTFT/TPOT percentiles (serve.py:1434): an error naming them
    blind = {k: v for k, v in RESULT_033.items() if "ttft" not in k and "tpot" not in k}
    with pytest.raises(vllm_server.HarnessError, match="p50_tpot_ms, p50_ttft_ms.*tokenizer"):
        goodput.parse_result(blind)


def test_slo_verdict():
    row = {"prompts": 400, **goodput.parse_result(RESULT_033)}
    assert goodput.meets_slo(row, SLO) and goodput.misses(row, SLO) == []
    assert goodput.misses(row, Slo(600, 50)) == ["TTFT"] and goodput.misses(row, Slo(1000, 38)) == ["TPOT"]
    short = row | {"completed": 397, "failed": 3}
    assert goodput.misses(short, Slo(600, 38)) == ["3 of 400 not completed", "TTFT", "TPOT"]
    assert not goodput.meets_slo(short, SLO)  # latencies within the SLO, but not every request served


def test_first_line():
    assert goodput.first_line([sys.executable, "-c", "print('NVIDIA H200'); print('NVIDIA H200')"]) == "NVIDIA H200"
    assert goodput.first_line([sys.executable, "-c", "raise SystemExit(9)"]) is None
    assert goodput.first_line(["no-such-program-here"]) is None


def test_counter_delta():
    before = {"decode_forwards": 100, "skipped_forwards": 40, "released_requests": 5, "steps": 9}
    after = {"decode_forwards": 1100, "skipped_forwards": 540, "released_requests": 25, "steps": 99}
    assert goodput.counter_delta(before, after) == {"decode_forwards": 1000, "skipped_forwards": 500,
                                                    "released_requests": 20, "realized_skip": 0.5}
    assert goodput.counter_delta(before, before)["realized_skip"] == 0.0


def test_expected_skip():
    assert goodput.expected_skip([30]) == skip_fraction(list(range(20, 101)), [30] * 81)
    ks = [9, 47, 30]
    by_adapter = [goodput.expected_skip([k]) for k in ks]
    # longer outputs weigh more, but every adapter sees the same lengths: the mean over adapters
    assert goodput.expected_skip(ks) == pytest.approx(sum(by_adapter) / 3)
    assert by_adapter[0] > by_adapter[2] > by_adapter[1]


# -- the goodput rate and the sweep ------------------------------------------------------------------------

def test_goodput_rate():
    assert goodput.goodput_rate([(4.0, True), (6.0, True), (9.0, False), (7.3, True), (8.1, False)]) == (7.3, 8.1)
    assert goodput.goodput_rate([(4.0, True), (6.0, True)]) == (6.0, None)  # never missed: the highest
    assert goodput.goodput_rate([(4.0, False), (2.7, False)]) == (None, 2.7)  # no rate met the SLO
    assert goodput.goodput_rate([]) == (None, None)
    # non-monotone: 12 met the SLO above a miss at 8; the rate is the highest below the lowest miss
    noisy = [(4.0, True), (8.0, False), (12.0, True), (6.0, True), (16.0, False)]
    assert goodput.goodput_rate(noisy) == (6.0, 8.0)
    assert goodput.held_above_a_miss(noisy) == [12.0] and goodput.held_above_a_miss([(4.0, True)]) == []


def simulate(limit: float, start: float, sweep: Sweep = Sweep()) -> list[tuple[float, bool]]:
    """The sweep against a server that meets the SLO exactly up to ``limit`` req/s."""
    points: list[tuple[float, bool]] = []
    while (rate := goodput.next_rate(points, start, sweep)) is not None:
        assert rate not in [r for r, _ in points] and len(points) < 40
        points.append((rate, rate <= limit))
    return points


@pytest.mark.parametrize("limit,start", [(57.0, 30.0), (57.0, 56.0), (57.0, 150.0), (9.3, 40.0), (3.0, 3.0),
                                         (120.0, 4.0), (0.8, 20.0)])
def test_sweep_brackets_the_limit(limit, start):
    points = simulate(limit, start)
    best, low_miss = goodput.goodput_rate(points)
    assert best <= limit < low_miss <= best * (1 + Sweep.tolerance) + 0.1  # within the tolerance (0.1: rounding)
    assert points[0][0] == start
    # a ladder (x factor while the SLO holds, / factor while it misses) up to the first change of verdict
    k = next(i for i, (_, met) in enumerate(points) if met != points[0][1])
    ladder = [r for r, _ in points[:k + 1]]
    step = Sweep.factor if points[0][1] else 1 / Sweep.factor
    assert all(abs(b / a - step) < 0.1 for a, b in zip(ladder, ladder[1:]))


def test_sweep_counts():
    # from half the limit: up once or twice, then about three bisection steps
    assert len(simulate(57.0, 28.5)) <= 7
    assert len(simulate(57.0, 150.0)) <= 8


def test_sweep_ends_at_the_lowest_rate():
    points = simulate(0.2, 5.0)
    assert goodput.goodput_rate(points) == (None, 0.5) and points[-1] == (0.5, False)
    assert [r for r, _ in points] == [5.0, 3.3, 2.2, 1.5, 1.0, 0.7, 0.5]
    assert goodput.next_rate([], 0.01) == 0.5  # never below min_rate


def test_sweep_stops_within_tolerance_and_on_rounding():
    assert goodput.next_rate([(10.0, True), (10.5, False)], 10.0) is None  # 5% apart
    assert goodput.next_rate([(10.0, True), (11.0, False)], 10.0) == 10.5  # the geometric midpoint
    assert goodput.next_rate([(0.5, True), (0.6, False)], 0.5, Sweep(tolerance=0.01)) is None  # no 0.1 step between
    assert goodput.next_rate([(0.1, True)], 0.1, Sweep(min_rate=0.1)) == 0.2  # the ladder always climbs


def test_prompts_and_predicted_time():
    assert goodput.prompts_for(4.0, 20, 200) == 200 and goodput.prompts_for(57.5, 20, 200) == 1150
    assert goodput.predicted_wall_s(50.0, 1000, 12.0, None) == 32.0
    assert goodput.predicted_wall_s(50.0, 1000, 12.0, 25.0) == 52.0  # served at capacity above it
    assert goodput.predicted_wall_s(10.0, 200, 12.0, 25.0) == 32.0


# -- the table ------------------------------------------------------------------------------------------------

def _row(rate: float | None, ttft90: float, tpot90: float = 30.0, **extra) -> dict:
    return {"rate": rate, "prompts": 400, "completed": 400, "failed": 0, "duration_s": 20.0,
            "request_throughput": 19.5 if rate else 60.0, "request_goodput": 19.0, "output_throughput": 1.0,
            "ttft_p50_ms": 100.0, "ttft_p90_ms": ttft90, "ttft_p99_ms": 1.0, "tpot_p50_ms": 20.0,
            "tpot_p90_ms": tpot90, "tpot_p99_ms": 1.0, **extra}


def test_table_and_ratio_line():
    modes = {"both": {"facts": ["server ready after 80 s"], "error": None,
                      "rows": [_row(None, 9000.0), _row(30.0, 500.0, counters={"realized_skip": 0.5123}),
                               _row(45.0, 2000.0), _row(36.7, 900.0), _row(40.6, 300.0, 60.0)]},
             "gridtrim": {"facts": [], "error": None, "rows": [_row(10.0, 200.0), _row(24.5, 900.0), _row(30.0, 5000.0)]},
             "stock": {"facts": [], "error": "rate 20: vllm bench serve failed (rc 1)",
                       "rows": [_row(12.2, 900.0), _row(18.0, 1900.0)]}}
    assert goodput.ratio_line(512, 32, modes, SLO) == "goodput 512/32: both/gridtrim = 1.50, both/stock = 3.01"
    assert goodput.ratio_line(512, 32, {"both": modes["both"]}, SLO) == \
        "goodput 512/32: no ratio yet: it needs both and gridtrim or stock (a goodput rate so far: both)"
    doc = {"preamble": ["pre"], "modes": modes, "notes": ["note"],
           "ratio": goodput.ratio_line(512, 32, modes, SLO)}
    lines = goodput.render(doc, SLO).splitlines()
    assert lines[2] == goodput.SUMMARY_HEADER
    assert lines[4] == "| steptrim + gridtrim (release, our LoRA kernels) | 36.7 | 40.6 | 60.0 | 3.01 |"
    assert lines[6] == "| stock | 12.2 | 18 | — | 1.00 |"
    i = lines.index(goodput.HEADER)
    assert lines[i - 2] == "steptrim + gridtrim (release, our LoRA kernels); server ready after 80 s"
    assert lines[i + 2] == "| inf | 400 | 400 | 60.0 | 19.0 | 100.0 | 9000.0 | 20.0 | 30.0 | — | probe |"
    assert lines[i + 3] == "| 30 | 400 | 400 | 19.5 | 19.0 | 100.0 | 500.0 | 20.0 | 30.0 | 0.512 | met |"
    assert lines[i + 6] == "| 40.6 | 400 | 400 | 19.5 | 19.0 | 100.0 | 300.0 | 20.0 | 60.0 | — | missed: TPOT |"
    assert "stopped: rate 20: vllm bench serve failed (rc 1)" in lines
    assert lines[-3:] == ["note", "", "goodput 512/32: both/gridtrim = 1.50, both/stock = 3.01"]


def test_append_keeps_a_table_of_the_same_workload(tmp_path):
    pre = ["vLLM 0.33.0", "model", "workload and SLO", "schedule"]
    path = tmp_path / "goodput.json"
    assert goodput.load_table(path, pre, append=True) == {"preamble": pre, "modes": {}, "notes": [], "ratio": ""}
    path.write_text(json.dumps({"preamble": pre[:3] + ["older schedule line"], "modes": {"stock": {"rows": []}},
                                "notes": ["n1"], "ratio": "r"}))
    kept = goodput.load_table(path, pre, append=True)
    assert kept["modes"] == {"stock": {"rows": []}} and kept["notes"] == ["n1"] and kept["preamble"] == pre
    assert goodput.load_table(path, pre, append=False)["modes"] == {}
    assert goodput.load_table(path, ["vLLM 0.26.0", *pre[1:]], append=True) is None


# -- a whole call against a stand-in vLLM ------------------------------------------------------------------

FAKE_VLLM = r'''
"""Stand-in for `python -m vllm.entrypoints.cli.main`: `serve` logs its engine config as vLLM 0.33.0 does
with its defaults, prints the plugin's start-up lines the environment asks for and answers the routes the
harnesses use (/metrics with growing counters); `bench serve` writes a result whose P90 TTFT misses the SLO
above the mode's LIMIT (with per-request lists under --save-detailed). Both append what they saw to
$FAKE_RECORD. With FAKE_TOGETHER=N:DIR a server is not healthy until N servers have started (each
leaves a file in DIR): servers started one after another never all become ready."""
import json, os, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LIMIT = {"both": 30.0, "gridtrim": 20.0, "stock": 10.0,  # goodput's modes, then the chat benchmark's
         "lorazor": 30.0, "lorazor-sync": 24.0, "lorazor-lag0": 27.0, "nolora": 40.0}


def values(flag):
    args = sys.argv[1:]
    if flag not in args:
        return []
    out = []
    for word in args[args.index(flag) + 1:]:
        if word.startswith("--"):
            break
        out.append(word)
    return out


def record(**kw):
    with open(os.environ["FAKE_RECORD"], "a") as f:
        f.write(json.dumps(kw) + "\n")


def write_trace(directory):
    """What vLLM's worker profiler leaves at /stop_profile: a gzipped Chrome trace of four steps of
    10 us, 4 us in execute_model each, a 5-us kernel 1 us into each."""
    import gzip
    steps = [{"ph": "X", "cat": "user_annotation", "name": "execute_context_1(30)_generation_9(9)", "ts": t,
              "dur": 4} for t in (0, 10, 20, 30)]
    kernels = [{"ph": "X", "cat": "kernel", "name": "k", "ts": t + 1, "dur": 5} for t in (0, 10, 20, 30)]
    os.makedirs(directory, exist_ok=True)
    with gzip.open(os.path.join(directory, "stand_in_worker.1.pt.trace.json.gz"), "wt") as f:
        json.dump({"traceEvents": steps + kernels}, f)


if sys.argv[1] == "serve":
    env = {k: v for k, v in os.environ.items() if k.startswith(("LORAZOR_", "VLLM_", "CUDA_VISIBLE_DEVICES"))}
    together = os.environ.get("FAKE_TOGETHER", "").partition(":")
    if together[2]:
        open(os.path.join(together[2], values("--port")[0]), "w").close()
    record(what="serve", argv=sys.argv[1:], env=env)
    graphs = os.environ.get("FAKE_LARGEST_GRAPH") or json.loads(
        (values("--compilation-config") or ["{}"])[0]).get("max_cudagraph_capture_size", 512)
    print("(EngineCore_DP0 pid=1) INFO [core.py:140] Initializing a V1 LLM engine (v0.33.0) with config: "
          "enable_prefix_caching=True, compilation_config={'mode': <CompilationMode.VLLM_COMPILE: 3>, "
          f"'cudagraph_mode': <CUDAGraphMode.FULL_AND_PIECEWISE: (2, 1)>, 'max_cudagraph_capture_size': {graphs}}}")
    if os.environ.get("LORAZOR_GRIDTRIM") == "1":
        print("(EngineCore_DP0 pid=1) INFO [punica_wrapper.py:39] LoRazor GridTrim active: LoRA linears use the "
              "work-list kernels (8 tokens, 3 slots, 16 persistent programs; compiled launches: "
              f"{os.environ.get('FAKE_GRIDTRIM_LAUNCH') or os.environ.get('LORAZOR_GRIDTRIM_LAUNCH') or 'ops'}).")
    if os.environ.get("LORAZOR_BUNDLE"):
        print("(EngineCore_DP0 pid=1) INFO [runner_setup.py:33] LoRazor StepTrim active: bundle ...")
        print("(EngineCore_DP0 pid=1) INFO [scheduler.py:101] LoRazor slot hand-back active: ...")
    sys.stdout.flush()
    names = [m.split("=", 1)[0] for m in values("--lora-modules")] + [sys.argv[2]]
    reads = [0]

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def reply(self, body, code=200):
            raw = b"" if body is None else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self):
            if self.path == "/metrics":
                reads[0] += 1
                n = reads[0]
                text = (f"# TYPE vllm:prefix_cache_queries_total counter\nvllm:prefix_cache_queries_total{{a=\"1\"}} "
                        f"{1000 * n}\nvllm:prefix_cache_hits_total{{a=\"1\"}} {600 * n}\n"
                        f"vllm:generation_tokens_total {3000 * n}\nvllm:iteration_tokens_total_count {100 * n}\n")
                raw = text.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)
                return
            if self.path == "/health" and together[2] and len(os.listdir(together[2])) < int(together[0]):
                self.reply(None, 503)
                return
            self.reply(None if self.path == "/health" else {"data": [{"id": n} for n in names]})

        def do_POST(self):
            raw = self.rfile.read(int(self.headers["Content-Length"]))
            if self.path in ("/start_profile", "/stop_profile"):
                if not values("--profiler-config"):  # vLLM attaches these routes only with a profiler
                    self.reply(None, 404)
                    return
                record(what=self.path[1:])
                if self.path == "/stop_profile":
                    write_trace(json.loads(values("--profiler-config")[0])["torch_profiler_dir"])
                self.reply(None)
                return
            body = json.loads(raw)
            if self.path == "/v1/completions":
                record(what="completion", model=body["model"], max_tokens=body["max_tokens"])
                self.reply({"choices": [{"text": " t1 t2 t3 t4"}]})
            elif os.environ.get("LORAZOR_BUNDLE") and body == {"method": "lorazor_counters"}:
                reads[0] += 1
                n = reads[0]
                self.reply({"results": [{"decode_forwards": 1000 * n, "skipped_forwards": 510 * n,
                                         "released_requests": 7 * n}]})
            else:
                self.reply({"error": "no such method"}, 500)

    ThreadingHTTPServer(("127.0.0.1", int(values("--port")[0])), Handler).serve_forever()
elif sys.argv[1:3] == ["bench", "serve"]:
    mode = values("--metadata")[0].split("=", 1)[1]
    rate, n = float(values("--request-rate")[0]), int(values("--num-prompts")[0])
    record(what="bench", mode=mode, pid=os.getpid(), rate=values("--request-rate")[0], prompts=n,
           loras=len(values("--lora-modules")),
           lorazor=sorted(k for k in os.environ if k.startswith("LORAZOR_")))
    capacity = 1.3 * LIMIT[mode]
    over = rate > LIMIT[mode]
    result = {"date": "20261204-101500", "backend": "openai", "num_prompts": n, "mode": mode,
              "duration": n / min(rate, capacity), "completed": n, "failed": 0,
              "request_throughput": min(rate, capacity), "request_goodput": 0.0 if over else min(rate, capacity),
              "output_throughput": 60.0 * min(rate, capacity)}
    for p, (ttft, tpot) in zip((50, 90, 99), ((100.0, 20.0), (4000.0 if over else 400.0, 30.0), (9000.0, 45.0))):
        result |= {f"p{p}_ttft_ms": ttft, f"p{p}_tpot_ms": tpot}
    if "--save-detailed" in sys.argv:
        out, first = [1 + i % 7 for i in range(n)], 4.0 if over else 0.4
        result |= {"ttfts": [first] * n, "latencies": [first + 0.03 * (k - 1) for k in out],
                   "output_lens": out, "errors": [""] * n, "itls": [[0.03] * (k - 1) for k in out]}
    with open(os.path.join(values("--result-dir")[0], values("--result-filename")[0]), "w") as f:
        json.dump(result, f)
'''


# The client process of benchmarks/serving/bench_client.py with the stand-in's `bench serve` for vLLM's.
FAKE_CLIENT = r'''
import runpy, sys
sys.path.insert(0, sys.argv[2])
from benchmarks.serving.bench_client import serve
FAKE = sys.argv[1]


def run(options):
    sys.argv = [FAKE, "bench", "serve", *options]
    runpy.run_path(FAKE, run_name="__main__")


serve(lambda: run)
'''


def use_stand_in(tmp_path: Path, monkeypatch) -> Path:
    """The stand-in `vllm` (:data:`FAKE_VLLM`) for the harnesses' servers and client processes, and
    GridTrim's default launch whatever the shell sets."""
    monkeypatch.delenv("LORAZOR_GRIDTRIM_LAUNCH", raising=False)
    fake, client = tmp_path / "fake_vllm.py", tmp_path / "fake_client.py"
    fake.write_text(FAKE_VLLM)
    client.write_text(FAKE_CLIENT)
    monkeypatch.setattr(goodput, "VLLM_CLI", [sys.executable, str(fake)])
    monkeypatch.setattr(bench_client, "CHILD", [sys.executable, str(client), str(fake), str(goodput.ROOT)])
    return fake


def test_a_whole_call_against_a_stand_in_vllm(tmp_path, monkeypatch):
    use_stand_in(tmp_path, monkeypatch)
    record = tmp_path / "record.jsonl"
    monkeypatch.setattr(goodput, "installed_version", lambda: "0.33.0")
    monkeypatch.setattr(goodput, "prepare_files", lambda work, n, r, s: (work / "bundle", [20] * n, 0.5))
    monkeypatch.setenv("FAKE_RECORD", str(record))
    monkeypatch.setenv("LORAZOR_GRIDTRIM", "1")  # the harness's own environment: stock must not see it
    out, work = tmp_path / "out", tmp_path / "work"
    common = ["--out", str(out), "--work", str(work), "--adapters", "5", "--max-loras", "2"]
    assert goodput.main(common + ["--modes", "both", "gridtrim"]) == 0
    assert goodput.main(common + ["--modes", "stock", "--append"]) == 0
    table = (out / "goodput.json").read_text()
    # a table of vLLM's defaults is not extended by synchronous servers: one line, exit 2, table unchanged
    assert goodput.main(common + ["--modes", "nolora", "--append", "--sync"]) == 2
    assert (out / "goodput.json").read_text() == table

    doc = json.loads(table)
    assert doc["preamble"][0].endswith("vLLM settings of every server: vLLM's defaults (torch.compile and its "
                                       "CUDA-graph mode, async scheduling, prefix caching); GridTrim's kernels "
                                       f"launched by {DEFAULT_LAUNCH} (LORAZOR_GRIDTRIM_LAUNCH)")
    assert list(doc["modes"]) == ["both", "gridtrim", "stock"] and len(doc["notes"]) == 2
    for mode, limit in (("both", 30.0), ("gridtrim", 20.0), ("stock", 10.0)):
        entry = doc["modes"][mode]
        assert entry["error"] is None and entry["rows"][0]["rate"] is None  # the probe first
        best, low_miss = goodput.goodput_rate(goodput.points_of(entry, SLO))
        assert best <= limit < low_miss <= best * 1.06 + 0.1
        assert entry["rows"][1]["rate"] == round(0.5 * 1.3 * limit, 1)  # half the probe's throughput
        assert all((out / mode / r["result"]).exists() for r in entry["rows"])
        # every rate ran in the mode's one client process, its log opening with the command it stands for
        assert (out / mode / "client.log").exists()
        assert (out / mode / "rate_inf.log").read_text().startswith("vllm bench serve --backend openai --base-url ")
        assert ("counters" in entry["rows"][1]) == (mode == "both")
    assert doc["modes"]["both"]["rows"][1]["counters"]["realized_skip"] == pytest.approx(0.51)
    assert doc["ratio"] == goodput.ratio_line(5, 2, doc["modes"], SLO)
    assert doc["ratio"].startswith("goodput 5/2: both/gridtrim = 1.") and ", both/stock = " in doc["ratio"]
    text = (out / "goodput.txt").read_text()
    assert text.endswith(doc["ratio"] + "\n") and text.count(goodput.HEADER) == 3

    seen = [json.loads(line) for line in record.read_text().splitlines()]
    servers = [s for s in seen if s["what"] == "serve"]
    assert [sorted(k for k in s["env"] if k.startswith("LORAZOR_")) for s in servers] == [
        ["LORAZOR_ADAPTERS", "LORAZOR_BUNDLE", "LORAZOR_GRIDTRIM", "LORAZOR_LOG_INTERVAL_S"], ["LORAZOR_GRIDTRIM"], []]
    warm = [s["model"] for s in seen if s["what"] == "completion"]
    assert sorted(warm) == sorted([bench.adapter_name(a) for a in range(5)] * 3)  # each adapter once per server
    clients = [s for s in seen if s["what"] == "bench"]
    assert {s["loras"] for s in clients} == {5} and all(s["lorazor"] == [] for s in clients)
    assert [s["rate"] for s in clients if s["mode"] == "stock"][0] == "inf"  # the probe first
    assert [len({s["pid"] for s in clients if s["mode"] == m}) for m in ("both", "gridtrim", "stock")] == [1, 1, 1]
    # every server is gone: its port refuses
    for s in servers:
        port = int(s["argv"][s["argv"].index("--port") + 1])
        with pytest.raises(OSError):
            vllm_server.http_json(f"http://127.0.0.1:{port}/health", timeout_s=2)


def test_a_server_that_exits_is_reported_with_its_log(tmp_path):
    log = tmp_path / "server.log"
    crash = [sys.executable, "-c", "print('CUDA out of memory'); raise SystemExit(3)"]
    server = vllm_server.start_server(crash, {}, log)
    server.wait()
    with pytest.raises(vllm_server.HarnessError, match="(?s)exited with 3.*ends:.*CUDA out of memory"):
        vllm_server.wait_ready("http://127.0.0.1:9", server, log, 60, [])


def test_stop_server_ends_its_process_group(tmp_path):
    child = tmp_path / "child.pid"
    script = (f"import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
              f"open({str(child)!r}, 'w').write(str(p.pid)); p.wait()")
    server = vllm_server.start_server([sys.executable, "-c", script], {}, tmp_path / "log")
    while not child.exists() or not child.read_text():
        time.sleep(0.05)
    pid = int(child.read_text())
    assert running(pid)
    vllm_server.stop_server(server, timeout_s=30)
    assert server.returncode is not None
    deadline = time.monotonic() + 10  # the signal is sent; the grandchild may take a moment to go
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(pid)  # without the group signal it would sleep on for 600 s


def running(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan waits for a reaper that may be slow)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"
