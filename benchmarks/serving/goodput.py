"""Goodput under a latency SLO, through the path users run: ``vllm serve`` with the plugin (the
multiprocess engine core behind the OpenAI HTTP server), driven by ``vllm bench serve``.

    python -m benchmarks.serving.goodput --out DIR [--modes both gridtrim stock] [--adapters 512]
        [--max-loras 32] [--ttft-slo-ms 1000] [--tpot-slo-ms 50] [--append] [--budget-s 560]

(``bash scripts/gpu_slot_bench.sh OUT goodput512`` runs it with the plugin's entry point visible and
``--gpus all``: on a machine with a GPU per mode the modes run at once, one GPU each
(:mod:`benchmarks.serving.placement`); on one GPU, ``MODES=stock`` there runs one mode per call,
appending to one table.) Operators size servers by
the highest request rate their server sustains within a latency SLO. Per mode this reports the
highest Poisson rate whose P90 TTFT ≤ 1000 ms and P90 TPOT ≤ 50 ms (``--ttft-slo-ms``,
``--tpot-slo-ms``), and ends with ``goodput N/M: both/gridtrim = X.XX, both/stock = Y.YY`` (those
measured). The offline harness (:mod:`benchmarks.serving.bench`) stays the place for the slot
statistics, which need the engine core in the harness's process.

**One mode**, each in its own server, one after the other or at once on GPUs of their own
(``--gpus``, :mod:`benchmarks.serving.placement`): the modes, environments and engine
options are bench.py's (:func:`bench.mode_env`, :func:`bench.engine_options` with vLLM's defaults,
or the second-line settings of ``--graphs``/``--sync``/``--no-prefix-caching``,
:mod:`benchmarks.serving.vllm_settings`) written as ``vllm serve`` flags (:func:`cli_flags`), the N adapters registered with ``--lora-modules
name=path`` (``max_loras`` M slots, every adapter kept in host memory), and for steptrim/both
LoRazor's worker extension and ``VLLM_SERVER_DEV_MODE=1``, whose ``POST /collective_rpc`` reads
the StepTrim counters around every rate (the realized skip). Before measuring, the harness checks
the plugin's start-up lines in the server log (:func:`expected_markers`: stock none, gridtrim
GridTrim's, steptrim StepTrim's and slot hand-back's, both all three), then sends one 4-token
request per adapter so that every adapter has been written into a slot once (bench.py's warm-up).
Then ``vllm bench serve`` runs, once per rate, in one client process per server that imports vLLM
while the server starts (:mod:`benchmarks.serving.bench_client`):

- a capacity probe, all ``--probe-prompts`` requests at once (``--request-rate inf``); the sweep
  starts at ``--start-fraction`` of its throughput (``--start-rate R`` skips the probe);
- the sweep (:func:`next_rate`): × ``--factor`` while the SLO holds, ÷ it below a first miss
  down to ``--min-rate``, then bisection between the highest rate meeting the SLO and the lowest
  missing it until they are within ``--tolerance``. Each rate sends ``max(--min-prompts, rate ×
  --duration-s)`` requests; a rate is not started when its predicted wall time
  (:func:`predicted_wall_s`) no longer fits the budget, and the table says so.

A rate meets the SLO when every request completed and both P90s are within it
(:func:`meets_slo`). The mode's goodput rate is the highest rate meeting it below the lowest rate
missing it (:func:`goodput_rate`): a rate that met the SLO above a missed one is noise, listed
under the mode's table and not counted. vLLM's own ``request_goodput`` (requests meeting both SLOs, per
second) is in the table beside it.

**The workload** is vLLM's ``random`` dataset shaped like bench.py's: prompts of 100–300 tokens
(``--random-input-len 200``, range ratio 0.5) and 20–100 output tokens (``--random-output-len
60``, range ratio 0.66), uniform integers in both, ``ignore_eos``, temperature 1.0 (the
SamplingParams default bench.py serves with), each request on an adapter drawn uniformly
(``--lora-assignment random``), seed ``--seed``; the same requests and arrival times for every
mode at a given rate. StepTrim serves the offline uniform table's profiled bundle
(:func:`bench.prepare`: per adapter the k that skips half of its decode forwards on bench.py's 2048
requests), here on fresh requests of the same length distribution: the preamble gives the skip
those k converge to on that distribution (:func:`expected_skip`) and each rate its realized skip.

**The tokenizer.** ``vllm serve`` and ``vllm bench serve`` both need one for a text workload (the
server to encode prompts and detokenize streamed outputs; the client to build the random prompts
and, without one, it writes no TTFT or TPOT percentiles at all), and the dummy model directory has
none; no model hub is reachable. :func:`benchmarks.serving.synthetic.write_word_tokenizer` writes
one into the model directory: a word-level ``tokenizer.json`` (HF ``tokenizers``) of the config's
128256 tokens, token i being the word ``t<i>``, split on whitespace, bos and eos at the config's ids
and nothing added around a text. Random ids decode to words joined by spaces and encode back to the
same ids (tested at the full vocabulary on CPU), so every prompt has exactly the length the dataset
drew, the server counts the same prompt tokens as the client, and vLLM's alignment probe finds no
mismatch. Token-id prompts would not remove the need (docs/vllm_integration.md §12).

**vLLM facts relied on**, with file:line in the 0.33.0 and 0.26.0 wheels: docs/vllm_integration.md §12
(0.34.0 has every option used here). Any vLLM that LoRazor does not support is refused.

**Time.** Everything of one mode fits a 10-minute call on an H200 (``--budget-s`` 560, the rest
for the script around it): the server's start-up with 512 adapters loaded (the offline engines
took 16–52 s to start and 30–45 s to load the adapters on 0.33.0 with full CUDA graphs and no
torch.compile; vLLM's default compilation adds its compile and piecewise capture, not yet
measured for this model), the warm-up, the probe, and about six rates of 20 s of arrivals each
plus the client's own start. A rate whose predicted wall time no longer fits is not started, and
the table says so.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.serving import bench, placement, vllm_settings
from benchmarks.serving.bench_client import BenchClient
from benchmarks.serving.bench_table import MODE_LABEL
from benchmarks.serving.bench_workload import N_REQUESTS, OUTPUT_LEN, PROMPT_LEN, workload_for
from benchmarks.serving.host_memory import host_bytes_needed, host_memory_available, host_memory_problem
from benchmarks.serving.synthetic import LLAMA32_3B, write_word_tokenizer
from benchmarks.serving.vllm_server import (HarnessError, counters, free_port, start_server, stop_server, tail,
                                          wait_ready, warm_up)
from benchmarks.serving.vllm_settings import VllmSettings
from serve_bridge.command_line import Parser, number
from serve_bridge.steptrim import skip_fraction
from serve_bridge.vllm.versions import SUPPORTED, installed_version

ROOT = Path(__file__).resolve().parents[2]
VLLM_CLI = [sys.executable, "-m", "vllm.entrypoints.cli.main"]  # `vllm`, also with vLLM only on PYTHONPATH
MODES = ("stock", "gridtrim", "steptrim", "both", "nolora")  # bench.py's, less stockfix (in-process only)
DEFAULT_MODES = ("both", "gridtrim", "stock")
# (mean, range ratio) of vLLM's random dataset giving PROMPT_LEN and OUTPUT_LEN (module doc).
RANDOM_INPUT = (200, 0.5)
RANDOM_OUTPUT = (60, 0.66)
PERCENTILES = (50, 90, 99)
MARKERS = {"gridtrim": "LoRazor GridTrim active", "steptrim": "LoRazor StepTrim active",
           "slots": "LoRazor slot hand-back active"}  # the plugin's start-up log lines
STOP_RESERVE_S = 30.0  # budget kept for stopping a server
# Everything is local; no model hub is reachable from the GPU machines, and a lookup would wait out its timeouts.
OFFLINE = {"HF_HUB_OFFLINE": "1"}


@dataclass(frozen=True)
class Slo:
    """The latency SLO on the P90s: TTFT and TPOT in milliseconds."""

    ttft_ms: float = 1000.0
    tpot_ms: float = 50.0


@dataclass(frozen=True)
class Sweep:
    """How rates are chosen (:func:`next_rate`)."""

    factor: float = 1.5  # ladder step, up while the SLO holds, down below a first miss
    tolerance: float = 0.06  # stop once the lowest miss is within this of the highest hold
    min_rate: float = 0.5  # req/s: the ladder goes no lower


# -- rates (pure) ---------------------------------------------------------------------------------

def next_rate(points: Sequence[tuple[float, bool]], start: float, sweep: Sweep = Sweep()) -> float | None:
    """The next rate (req/s, rounded to 0.1) to measure after ``points`` (rate, SLO met), or None
    when the sweep is done.

    First ``start``. While no rate missed: the highest rate × factor. Once one did: below the lowest
    miss with no rate meeting the SLO, that miss ÷ factor (not below ``min_rate``; None once
    ``min_rate`` itself missed); else the geometric midpoint of the highest rate meeting the SLO
    below the lowest miss and that miss, None once they are within ``tolerance``."""
    if not points:
        return max(round(start, 1), sweep.min_rate)
    missed = [r for r, met in points if not met]
    if not missed:
        top = max(r for r, _ in points)
        return max(round(top * sweep.factor, 1), round(top + 0.1, 1))
    low_miss = min(missed)
    held = [r for r, met in points if met and r < low_miss]
    if not held:
        down = max(round(low_miss / sweep.factor, 1), sweep.min_rate)
        return down if down < low_miss else None
    high_hold = max(held)
    if low_miss <= high_hold * (1 + sweep.tolerance):
        return None
    mid = round(math.sqrt(high_hold * low_miss), 1)
    return mid if high_hold < mid < low_miss else None


def goodput_rate(points: Sequence[tuple[float, bool]]) -> tuple[float | None, float | None]:
    """(the highest rate meeting the SLO below the lowest rate missing it, that lowest miss);
    None where there is none."""
    missed = [r for r, met in points if not met]
    low_miss = min(missed) if missed else None
    held = [r for r, met in points if met and (low_miss is None or r < low_miss)]
    return (max(held) if held else None), low_miss


def held_above_a_miss(points: Sequence[tuple[float, bool]]) -> list[float]:
    """Rates that met the SLO above the lowest rate missing it (noise; not counted)."""
    _, low_miss = goodput_rate(points)
    return sorted(r for r, met in points if met and low_miss is not None and r > low_miss)


def prompts_for(rate: float, duration_s: float, min_prompts: int) -> int:
    """Requests sent at ``rate``: ``duration_s`` of arrivals, at least ``min_prompts``."""
    return max(min_prompts, math.ceil(rate * duration_s))


def predicted_wall_s(rate: float, n_prompts: int, overhead_s: float, capacity: float | None) -> float:
    """A client run's expected wall time: its overhead (tokenizer, dataset) plus the time to serve
    ``n_prompts`` at the rate, or at ``capacity`` (req/s) when the rate exceeds it."""
    served_at = rate if capacity is None else min(rate, capacity)
    return overhead_s + n_prompts / served_at


def planned_run(rate: float, args: argparse.Namespace, overhead_s: float, capacity: float | None) -> tuple[int, float]:
    """A client run at ``rate``: its requests (:func:`prompts_for` with ``--duration-s`` and
    ``--min-prompts``) and its :func:`predicted_wall_s`."""
    n = prompts_for(rate, args.duration_s, args.min_prompts)
    return n, predicted_wall_s(rate, n, overhead_s, capacity)


def client_overhead_s(row: dict[str, Any]) -> float:
    """A measured run's client overhead: its wall time beyond its requests' duration."""
    return max(0.0, row["wall_s"] - row["duration_s"])


def budget_left_s(deadline: float) -> float:
    """Seconds to ``deadline`` (``time.monotonic``) less :data:`STOP_RESERVE_S`."""
    return deadline - time.monotonic() - STOP_RESERVE_S


def expected_skip(ks: Sequence[int], output_len: tuple[int, int] = OUTPUT_LEN) -> float:
    """The skip fraction release points ``ks`` (one per adapter) converge to when every adapter
    and every output length in the inclusive range are equally likely: :func:`skip_fraction` over
    all (adapter, length) pairs."""
    lengths = range(output_len[0], output_len[1] + 1)
    return skip_fraction([n for _ in ks for n in lengths], [k for k in ks for _ in lengths])


# -- results (pure) ------------------------------------------------------------------------------

# vLLM 0.33.0's result keys (benchmarks/serve.py:1320-1326, :1430-1432) → the row's
RESULT_KEYS = {"completed": "completed", "failed": "failed", "duration": "duration_s",
               "request_throughput": "request_throughput", "request_goodput": "request_goodput",
               "output_throughput": "output_throughput"} | {
    f"p{p}_{metric}_ms": f"{metric}_p{p}_ms" for metric in ("ttft", "tpot") for p in PERCENTILES}


def parse_result(data: dict[str, Any]) -> dict[str, Any]:
    """The row's fields from a ``vllm bench serve --save-result`` JSON; a missing key is an error
    that names it."""
    missing = sorted(k for k in RESULT_KEYS if k not in data)
    if missing:
        raise HarnessError(f"the result has no {', '.join(missing)}: TTFT/TPOT percentiles are written only when "
                           "the client has a tokenizer, request_goodput only with --goodput")
    return {ours: data[theirs] for theirs, ours in RESULT_KEYS.items()}


def meets_slo(row: dict[str, Any], slo: Slo) -> bool:
    """Every request completed, and the P90 TTFT and TPOT are within the SLO."""
    return not misses(row, slo)


def misses(row: dict[str, Any], slo: Slo) -> list[str]:
    """What keeps a row from the SLO: failed requests, P90 TTFT, P90 TPOT (empty: met)."""
    short = row["prompts"] - row["completed"]
    out = [f"{short} of {row['prompts']} not completed"] if short else []
    out += ["TTFT"] if row["ttft_p90_ms"] > slo.ttft_ms else []
    return out + (["TPOT"] if row["tpot_p90_ms"] > slo.tpot_ms else [])


def counter_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """StepTrim counters over one run (``lorazor_counters`` before and after): decode forwards,
    skipped ones, released requests, and the realized skip."""
    d = {k: after[k] - before[k] for k in ("decode_forwards", "skipped_forwards", "released_requests")}
    return d | {"realized_skip": d["skipped_forwards"] / d["decode_forwards"] if d["decode_forwards"] else 0.0}


# -- commands (pure) -------------------------------------------------------------------------------

def cli_flags(opts: dict[str, Any]) -> list[str]:
    """Engine options as ``vllm serve`` flags: ``--name-with-dashes value``, a bool as ``--name``
    or ``--no-name``, a dict as JSON, a list as its items."""
    out: list[str] = []
    for key, value in opts.items():
        name = key.replace("_", "-")
        if isinstance(value, bool):
            out.append(f"--{name}" if value else f"--no-{name}")
        elif isinstance(value, dict):
            out += [f"--{name}", json.dumps(value)]
        elif isinstance(value, (list, tuple)):
            out += [f"--{name}", *map(str, value)]
        else:
            out += [f"--{name}", str(value)]
    return out


def server_command(model_dir: Path, mode: str, adapters: dict[str, Path], max_loras: int, port: int,
                   settings: VllmSettings = VllmSettings()) -> list[str]:
    """``vllm serve`` for a mode: bench.py's engine options with ``settings`` (vLLM's defaults
    unless a table says otherwise) and the tokenizer on, the adapters as ``--lora-modules`` (not
    for nolora), LoRazor's worker extension for steptrim/both."""
    opts = bench.engine_options(len(adapters), mode, settings=settings, max_loras=max_loras)
    cmd = [*VLLM_CLI, "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
           "--disable-uvicorn-access-log", *cli_flags(opts | {"skip_tokenizer_init": False})]
    if mode != "nolora":
        cmd += ["--lora-modules", *(f"{name}={path}" for name, path in adapters.items())]
    if mode in bench.STEPTRIM_MODES:
        cmd += ["--worker-extension-cls", "serve_bridge.vllm.rpc.LoRazorWorkerExtension"]
    return cmd


def server_env(mode: str, environ: dict[str, str], bundle: Path, adapters: dict[str, Path]) -> dict[str, str]:
    """The mode's environment (:func:`bench.mode_env`) with vLLM's dev routes on (``POST
    /collective_rpc``), the engine core in its own process, unbuffered output (the log is read
    for the plugin's start-up lines) and no hub lookups."""
    return bench.mode_env(mode, environ, bundle, adapters) | OFFLINE | {
        "VLLM_SERVER_DEV_MODE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "PYTHONUNBUFFERED": "1"}


def client_env(environ: dict[str, str]) -> dict[str, str]:
    """``vllm bench serve``'s environment: ``environ`` without any ``LORAZOR_*`` variable, no hub lookups."""
    return {k: v for k, v in environ.items() if not k.startswith("LORAZOR_")} | OFFLINE


def rate_label(rate: float) -> str:
    """A rate as the client's ``--request-rate`` and the result files name it (``inf``: all at once)."""
    return "inf" if math.isinf(rate) else f"{rate:g}"


def client_base(base_url: str, model_dir: Path, rate: float, n_prompts: int, seed: int, slo: Slo, result: Path,
                mode: str) -> list[str]:
    """``vllm bench serve``'s options for one rate (``inf``: all at once), without its dataset and
    adapters: P50/P90/P99 of TTFT, TPOT, ITL and E2EL, vLLM's goodput at ``slo``, the result JSON at
    ``result``, ``ignore_eos`` and temperature 1.0."""
    return ["--backend", "openai", "--base-url", base_url,
            "--endpoint", "/v1/completions", "--model", str(model_dir), "--tokenizer", str(model_dir),
            "--num-prompts", str(n_prompts), "--request-rate", rate_label(rate),
            "--burstiness", "1.0", "--seed", str(seed), "--ignore-eos", "--temperature", "1.0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", ",".join(map(str, PERCENTILES)),
            "--goodput", f"ttft:{slo.ttft_ms:g}", f"tpot:{slo.tpot_ms:g}",
            "--save-result", "--result-dir", str(result.parent), "--result-filename", result.name,
            "--metadata", f"mode={mode}", "--disable-tqdm"]


def client_command(base_url: str, model_dir: Path, rate: float, n_prompts: int, adapters: Sequence[str],
                   seed: int, slo: Slo, result: Path, mode: str) -> list[str]:
    """:func:`client_base` with the random dataset of the module doc and an adapter per request
    drawn uniformly from ``adapters`` (none: the backbone)."""
    cmd = client_base(base_url, model_dir, rate, n_prompts, seed, slo, result, mode) + [
        "--dataset-name", "random", "--random-input-len", str(RANDOM_INPUT[0]),
        "--random-output-len", str(RANDOM_OUTPUT[0]),
        "--random-range-ratio", json.dumps({"input": RANDOM_INPUT[1], "output": RANDOM_OUTPUT[1]})]
    if adapters:
        cmd += ["--lora-modules", *adapters, "--lora-assignment", "random"]
    return cmd


def expected_markers(mode: str) -> set[str]:
    """The plugin's start-up lines (keys of :data:`MARKERS`) a mode's server log must show, and no others."""
    out = {"gridtrim"} if mode in bench.GRIDTRIM_MODES else set()
    return out | ({"steptrim", "slots"} if mode in bench.STEPTRIM_MODES else set())


def found_markers(log_text: str) -> set[str]:
    """The plugin's start-up lines present in a server log."""
    return {key for key, line in MARKERS.items() if line in log_text}


# -- the table (pure) ------------------------------------------------------------------------------

HEADER = ("| rate req/s | prompts | completed | req/s | goodput req/s | TTFT P50 ms | TTFT P90 ms | TPOT P50 ms | "
          "TPOT P90 ms | realized skip | SLO on the P90s |")
SUMMARY_HEADER = "| mode | goodput rate req/s | lowest rate missing the SLO | probe req/s (all at once) | vs stock |"


def table_rule(header: str) -> str:
    """The markdown rule under table ``header``."""
    return "|" + "---|" * header.count(" | ") + "---|"


def format_row(row: dict[str, Any], slo: Slo) -> str:
    """One rate's table row (the probe's rate is ``inf``; its SLO cell says probe)."""
    rate = "inf" if row["rate"] is None else f"{row['rate']:g}"
    goodput = "—" if row["request_goodput"] is None else f"{row['request_goodput']:.1f}"
    lat = " | ".join(f"{row[k]:.1f}" for k in ("ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms"))
    skip = "—" if "counters" not in row else f"{row['counters']['realized_skip']:.3f}"
    verdict = "probe" if row["rate"] is None else ("met" if meets_slo(row, slo) else "missed: " + ", ".join(
        misses(row, slo)))
    return (f"| {rate} | {row['prompts']} | {row['completed']} | {row['request_throughput']:.1f} | {goodput} | "
            f"{lat} | {skip} | {verdict} |")


def points_of(entry: dict[str, Any], slo: Slo) -> list[tuple[float, bool]]:
    """(rate, SLO met) of a mode's swept rates (the probe excluded)."""
    return [(r["rate"], meets_slo(r, slo)) for r in entry["rows"] if r["rate"] is not None]


def summary_row(mode: str, entry: dict[str, Any], stock: float | None, slo: Slo) -> str:
    """A mode's line of the summary: goodput rate, lowest miss, probe throughput, ratio to stock's goodput rate."""
    best, low_miss = goodput_rate(points_of(entry, slo))
    probe = [f"{r['request_throughput']:.1f}" for r in entry["rows"] if r["rate"] is None]
    ratio = f"{best / stock:.2f}" if best and stock else "—"
    return (f"| {MODE_LABEL[mode]} | {'none' if best is None else f'{best:g}'} | "
            f"{'none' if low_miss is None else f'{low_miss:g}'} | {probe[0] if probe else '—'} | {ratio} |")


def ratio_line(n_adapters: int, max_loras: int, modes: dict[str, dict[str, Any]], slo: Slo) -> str:
    """``goodput N/M: both/gridtrim = X.XX, both/stock = Y.YY`` (and both/nolora), those measured."""
    rates = {m: goodput_rate(points_of(e, slo))[0] for m, e in modes.items()}
    parts = [f"both/{m} = {rates['both'] / rates[m]:.2f}" for m in ("gridtrim", "stock", "nolora")
             if rates.get("both") and rates.get(m)]
    have = ", ".join(sorted(m for m, r in rates.items() if r)) or "no mode"
    return f"goodput {n_adapters}/{max_loras}: " + (", ".join(parts) if parts else
                                                     f"no ratio yet: it needs both and gridtrim or stock "
                                                     f"(a goodput rate so far: {have})")


def mode_sections(modes: dict[str, dict[str, Any]], slo: Slo, labels: Mapping[str, str], header: str,
                  row: Callable[[dict[str, Any], Slo], str]) -> list[str]:
    """Each mode's part of a report: its label and facts, the table of its rates (``row`` formats
    one under ``header``), the rates that met the SLO above a missed one, and why it stopped."""
    lines: list[str] = []
    for mode, entry in modes.items():
        lines += ["", "; ".join([labels[mode], *entry["facts"]]), "", header, table_rule(header)]
        lines += [row(r, slo) for r in entry["rows"]]
        noise = held_above_a_miss(points_of(entry, slo))
        if noise:
            lines.append(f"met the SLO above a missed rate (noise, not counted): {', '.join(f'{r:g}' for r in noise)}")
        if entry.get("error"):
            lines.append(f"stopped: {entry['error']}")
    return lines


def render(doc: dict[str, Any], slo: Slo) -> str:
    """The report: preamble, the summary over modes, each mode's rates, notes, the ratio line."""
    modes = doc["modes"]
    stock = goodput_rate(points_of(modes["stock"], slo))[0] if "stock" in modes else None
    lines = doc["preamble"] + ["", SUMMARY_HEADER, table_rule(SUMMARY_HEADER)]
    lines += [summary_row(m, e, stock, slo) for m, e in modes.items()]
    lines += mode_sections(modes, slo, MODE_LABEL, HEADER, format_row)
    return "\n".join(lines + [""] + doc["notes"] + ["", doc["ratio"]]) + "\n"


# -- orchestration ---------------------------------------------------------------------------------

@dataclass
class Mode:
    """One mode's server, where its files go, and the call's deadline (``time.monotonic``)."""

    name: str
    base_url: str
    model_dir: Path
    adapters: list[str]
    directory: Path
    deadline: float


def run_client(client: BenchClient, options: list[str], label: str, log: Path, result: Path,
               deadline: float) -> tuple[dict[str, Any], float]:
    """Run ``vllm bench serve OPTIONS`` in ``client`` writing ``result``: its JSON and the wall
    seconds taken. A failure, or a run past ``deadline`` (``time.monotonic``) less
    :data:`STOP_RESERVE_S`, is an error naming the rate ``label`` with its log's tail."""
    result.unlink(missing_ok=True)
    t0 = time.monotonic()
    try:
        code = client.run(options, log, max(1.0, budget_left_s(deadline)))
    except HarnessError as e:
        raise HarnessError(f"rate {label}: {e}") from None
    if code != 0 or not result.exists():
        raise HarnessError(f"rate {label}: vllm bench serve failed (rc {code}); {log} ends:\n" + tail(log))
    return json.loads(result.read_text()), time.monotonic() - t0


def run_rate(m: Mode, client: BenchClient, rate: float, n_prompts: int, args: argparse.Namespace,
             slo: Slo) -> dict[str, Any]:
    """``vllm bench serve`` at one rate (``inf``: the probe) → the row (with the StepTrim counters'
    change for steptrim/both)."""
    label = rate_label(rate)
    result, log = m.directory / f"rate_{label}.json", m.directory / f"rate_{label}.log"
    cmd = client_command(m.base_url, m.model_dir, rate, n_prompts, m.adapters, args.seed, slo, result, m.name)
    before = counters(m.base_url) if m.name in bench.STEPTRIM_MODES else None
    data, wall_s = run_client(client, cmd, label, log, result, m.deadline)
    row = {"rate": None if math.isinf(rate) else rate, "prompts": n_prompts, **parse_result(data), "wall_s": wall_s,
           "result": result.name}
    if before is not None:
        row["counters"] = counter_delta(before, counters(m.base_url))
    return row


def sweep_mode(measure: Callable[[float, int], dict[str, Any]], entry: dict[str, Any], args: argparse.Namespace,
               slo: Slo, deadline: float, flush: Callable[[], None]) -> None:
    """The probe (unless ``--start-rate``), then the rates of :func:`next_rate` while the budget
    (``deadline``, ``time.monotonic``) allows, each measured by ``measure(rate, requests)`` → its
    row; every row goes into ``entry`` and the table as it comes."""
    overhead, capacity, start = args.client_overhead_s, None, args.start_rate
    if start is None:
        probe = measure(math.inf, args.probe_prompts)
        entry["rows"].append(probe)
        flush()
        capacity = probe["request_throughput"]
        overhead = client_overhead_s(probe)
        start = args.start_fraction * capacity
    sweep = Sweep(args.factor, args.tolerance, args.min_rate)
    while (rate := next_rate(points_of(entry, slo), start, sweep)) is not None:
        n, need = planned_run(rate, args, overhead, capacity)
        left = budget_left_s(deadline)
        if need > left:
            entry["facts"].append(f"rate {rate:g} not run: it needs about {need:.0f} s, {left:.0f} s left")
            break
        print(f"  rate {rate:g} req/s, {n} requests", flush=True)
        row = measure(rate, n)
        entry["rows"].append(row)
        flush()
        overhead = client_overhead_s(row)


def with_server(entry: dict[str, Any], command: list[str], env: dict[str, str], log: Path, base_url: str,
                served: Sequence[str], want: set[str], timeout_s: float, deadline: float,
                body: Callable[[BenchClient], None], flush: Callable[[], None]) -> None:
    """Start ``command`` (``vllm serve``) with ``env``, output to ``log``, and its client process
    (:class:`BenchClient`, environment :func:`client_env`, output beside ``log``); once the server
    answers and serves every name in ``served``, check that its log shows exactly the plugin lines
    ``want`` (:func:`found_markers`), then run ``body(client)``; stop both and flush the table. A
    HarnessError or OSError on the way becomes the ``entry``'s ``error``."""
    server = start_server(command, env, log)
    client = BenchClient(client_env(dict(os.environ)), log.with_name("client.log"))
    try:
        ready_s = wait_ready(base_url, server, log, min(timeout_s, deadline - time.monotonic()), served)
        entry["facts"].append(f"server ready after {ready_s:.0f} s")
        found = found_markers(log.read_text(errors="replace"))
        if found != want:
            raise HarnessError(f"the server log shows the plugin lines {sorted(found)}, expected {sorted(want)}: not "
                               f"this mode's configuration (see {log})")
        body(client)
    except (HarnessError, OSError) as e:
        entry["error"] = f"{type(e).__name__}: {e}" if isinstance(e, OSError) else str(e)
        print(f"  {log.parent.name}: {entry['error']}", flush=True)
    finally:
        client.close()
        stop_server(server)
        flush()


def run_mode(mode: str, entry: dict[str, Any], args: argparse.Namespace, bundle: Path, deadline: float, slo: Slo,
             flush: Callable[[], None], gpu: placement.Gpu) -> None:
    """Start the mode's server (on ``gpu``, :func:`placement.env`), check it, warm it up, sweep, stop
    it, filling the mode's ``entry`` of the table (``error`` when it stopped early)."""
    directory = args.out / mode
    directory.mkdir(parents=True, exist_ok=True)
    work = args.work
    adapters = {bench.adapter_name(a): work / "adapters" / bench.adapter_name(a) for a in range(args.adapters)}
    port = args.port or free_port()
    m = Mode(mode, f"http://127.0.0.1:{port}", work / "model", [] if mode == "nolora" else list(adapters),
             directory, deadline)
    settings = vllm_settings.from_arguments(args)
    command = server_command(work / "model", mode, adapters, args.max_loras, port, settings)
    entry["facts"].append(f"vLLM settings: {settings.tag or 'defaults'}")

    def body(client: BenchClient) -> None:
        warm_s = warm_up(m.base_url, m.adapters or [str(m.model_dir)] * args.adapters)
        entry["facts"].append(f"warm-up {args.adapters} requests {warm_s:.1f} s")
        flush()
        sweep_mode(lambda rate, n: run_rate(m, client, rate, n, args, slo), entry, args, slo, deadline, flush)

    with_server(entry, command, server_env(mode, dict(os.environ), bundle, adapters) | placement.env(gpu, work),
                directory / "server.log", m.base_url, m.adapters, expected_markers(mode), args.ready_timeout_s, deadline,
                body, flush)


def first_line(cmd: list[str]) -> str | None:
    """The first line a command prints, or None when it is missing, fails or prints nothing."""
    if shutil.which(cmd[0]) is None:
        return None
    out = subprocess.run(cmd, capture_output=True, text=True)
    lines = out.stdout.strip().splitlines()
    return lines[0] if out.returncode == 0 and lines else None


def identity() -> str:
    """Date (UTC), device and commit of this call."""
    device = first_line(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]) or "no NVIDIA GPU found"
    commit = first_line(["git", "-C", str(ROOT), "describe", "--always", "--dirty", "--abbrev=7"]) or "unknown"
    return f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {device}, commit {commit}"


def call_note(modes: Sequence[str], gpus: Sequence[placement.Gpu]) -> str:
    """The table's note of one call: :func:`identity`, its modes, and how they were placed."""
    where = (f", at once on GPUs {' '.join(g for g in gpus if g is not None)} (one server per GPU)" if len(gpus) > 1
             else "" if gpus[0] is None else f", one after another on GPU {gpus[0]}")
    return f"{identity()}: modes {' '.join(modes)}{where}"


def preamble(args: argparse.Namespace, version: str, slo: Slo, ks: Sequence[int], planned: float) -> list[str]:
    """The report's opening lines; the first three identify a table that ``--append`` may extend."""
    settings = vllm_settings.from_arguments(args)
    server = bench.engine_options(args.adapters, "stock", settings=settings, max_loras=args.max_loras)
    first = (f"from {args.start_rate:g} req/s" if args.start_rate is not None else
             f"a probe of {args.probe_prompts} requests at once, then from {args.start_fraction:g} x its req/s")
    return [
        f"Goodput under a latency SLO: vLLM {version}, `vllm serve` with the LoRazor plugin (OpenAI HTTP server, "
        "engine core in its own process) driven by `vllm bench serve`, one server per mode; vLLM "
        "settings of every server: " + settings.described(),
        f"model: {bench.MODEL_NAME['llama3b']} config, dummy weights, bf16, word-level tokenizer of its 128256 "
        f"tokens; {args.adapters} rank-{bench.RANK} random peft adapters "
        f"({min(bench.DISTINCT_WEIGHTS, args.adapters)} distinct weight files), --lora-modules, max_loras {args.max_loras}; server: "
        + json.dumps({k: v for k, v in server.items() if k not in ("skip_tokenizer_init", "specialize_active_lora")}),
        f"workload: vllm bench serve's random dataset, prompts {PROMPT_LEN[0]}-{PROMPT_LEN[1]} tokens, "
        f"outputs {OUTPUT_LEN[0]}-{OUTPUT_LEN[1]} tokens (uniform), ignore_eos, temperature 1.0, an adapter "
        f"per request uniformly at random, seed {args.seed}; Poisson arrivals, per rate max({args.min_prompts}, "
        f"rate x {args.duration_s:g} s) requests; SLO: P90 TTFT <= {slo.ttft_ms:g} ms and P90 TPOT <= "
        f"{slo.tpot_ms:g} ms, every request completed",
        f"schedule (steptrim, both): the offline uniform table's profiled bundle, k {min(ks)}-{max(ks)} per adapter, "
        f"planned skip {planned:.3f} on its own {args.requests} requests, {expected_skip(ks):.3f} expected on this "
        "length distribution",
        f"sweep: {first}, x{args.factor:g} while the SLO holds, /{args.factor:g} below a miss (not under "
        f"{args.min_rate:g}), then bisection to {args.tolerance:.0%}; goodput rate = the highest rate meeting the SLO "
        "below the lowest rate missing it",
        "modes: stock = vLLM's runner and LoRA kernels, no LORAZOR_* variable; gridtrim = LORAZOR_GRIDTRIM=1; "
        "steptrim = the bundle (StepTrim release, slot hand-back, vLLM's kernels); both = the two; nolora = the "
        "backbone without LoRA (requests to the base model). Each server's log must show exactly its mode's LoRazor "
        "start-up lines; specialize_active_lora " + ("on for stock and steptrim, off for gridtrim and both" if
                                                     settings.specialize_active_lora else "off (vLLM's default)") + ".",
    ]


def prepare_files(work: Path, n_adapters: int, n_requests: int, seed: int) -> tuple[Path, list[int], float]:
    """Model directory with the word tokenizer, adapters and the profiled bundle (:func:`bench.prepare`,
    kept when already written); returns the bundle, its k per adapter and its planned skip."""
    bench.prepare(work, [n_adapters], False, n_requests, seed)
    write_word_tokenizer(work / "model", LLAMA32_3B)
    wl = workload_for(n_adapters, n_requests, False, seed)
    return bench.bundle_dir(work, n_adapters, False, n_requests, seed), list(wl.k), wl.planned_skip


def load_table(path: Path, pre: list[str], append: bool) -> dict[str, Any] | None:
    """The table to extend: the modes of ``path`` under ``append`` when its first three preamble
    lines are these (else None), or an empty one."""
    if append and path.exists():
        earlier = json.loads(path.read_text())
        if earlier["preamble"][:3] != pre[:3]:
            return None
        return earlier | {"preamble": pre}
    return {"preamble": pre, "modes": {}, "notes": [], "ratio": ""}


def refusal(name: str, version: str | None, versions: Sequence[str], why: str, n_adapters: int,
            max_loras: int, gpus: Sequence[placement.Gpu], modes: Sequence[str]) -> str | None:
    """The line refusing a harness ``name`` before it starts: a vLLM other than ``versions``
    (``why`` those), or host memory short of ``n_adapters`` kept adapters in each server with
    adapters (every mode but nolora) that runs at once on ``gpus``; None when it may run."""
    if version not in versions:
        return f"{name} runs on vLLM {' or '.join(versions)} ({why}); found {version or 'no vLLM'}"
    servers = placement.concurrent_servers(gpus, modes, lambda m: m != "nolora")
    needed = servers * host_bytes_needed(LLAMA32_3B, bench.RANK, n_adapters, max_loras, None)
    problem = host_memory_problem(needed, host_memory_available())
    if problem is not None and servers > 1:
        problem += f", or fewer --gpus ({servers} servers with adapters run at once)"
    return None if problem is None else f"{name}: {problem}"


def orchestrate(args: argparse.Namespace) -> int:
    start = time.monotonic()
    deadline = start + args.budget_s
    version = installed_version()
    gpus = placement.resolve(args.gpus, args.port, os.environ)
    if problem := refusal("goodput", version, SUPPORTED, "`vllm bench serve` of each has every option used here",
                          args.adapters, args.max_loras, gpus, args.modes):
        print(problem, file=sys.stderr)
        return 2
    slo = Slo(args.ttft_slo_ms, args.tpot_slo_ms)
    args.out.mkdir(parents=True, exist_ok=True)
    bundle, ks, planned = prepare_files(args.work, args.adapters, args.requests, args.seed)
    doc = load_table(args.out / "goodput.json", preamble(args, version, slo, ks, planned), args.append)
    if doc is None:
        print(f"{args.out}/goodput.json holds another vLLM, model, server configuration (e.g. "
              "async scheduling), workload or SLO: give another --out", file=sys.stderr)
        return 2
    doc["notes"].append(call_note(args.modes, gpus))

    @placement.serialized
    def flush() -> None:
        doc["ratio"] = ratio_line(args.adapters, args.max_loras, doc["modes"], slo)
        (args.out / "goodput.json").write_text(json.dumps(doc, indent=1))
        (args.out / "goodput.txt").write_text(render(doc, slo))

    rc = placement.run_modes(doc, args, gpus, start, deadline, lambda mode, entry, gpu: run_mode(
        mode, entry, args, bundle, deadline, slo, flush, gpu), flush)
    print((args.out / "goodput.txt").read_text(), flush=True)  # ends with the ratio line
    return rc


def add_sweep_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of the SLO, the rate sweep, the call's budget and the server (shared with
    :mod:`benchmarks.serving.chat`)."""
    ap.add_argument("--ttft-slo-ms", type=number("positive_number"), default=Slo.ttft_ms,
                    help="SLO on the P90 time to first token")
    ap.add_argument("--tpot-slo-ms", type=number("positive_number"), default=Slo.tpot_ms,
                    help="SLO on the P90 time per output token")
    ap.add_argument("--duration-s", type=number("positive_number"), default=20.0, help="seconds of arrivals per rate")
    ap.add_argument("--min-prompts", type=number("positive_int"), default=200, help="requests per rate at least")
    ap.add_argument("--probe-prompts", type=number("positive_int"), default=512,
                    help="requests of the all-at-once capacity probe")
    ap.add_argument("--start-rate", type=number("positive_number"), default=None, metavar="R",
                    help="first rate (req/s) of every mode, instead of a fraction of the probe's throughput")
    ap.add_argument("--start-fraction", type=number("positive_number"), default=0.5,
                    help="first rate as a fraction of the probe's req/s")
    ap.add_argument("--factor", type=number("above_one"), default=Sweep.factor, help="ladder step between rates")
    ap.add_argument("--tolerance", type=number("positive_number"), default=Sweep.tolerance,
                    help="stop once the lowest rate missing the SLO is within this of the highest meeting it")
    ap.add_argument("--min-rate", type=number("positive_number"), default=Sweep.min_rate,
                    help="the lowest rate tried (req/s)")
    ap.add_argument("--budget-s", type=number("positive_number"), default=560,
                    help="the whole call's time; no rate starts past it")
    ap.add_argument("--min-mode-s", type=number("non_negative_number"), default=180,
                    help="do not start a server with less time left")
    ap.add_argument("--ready-timeout-s", type=number("positive_number"), default=300,
                    help="vllm serve's start-up, at most")
    ap.add_argument("--client-overhead-s", type=number("non_negative_number"), default=5,
                    help="a rate's client time besides serving (tokenizer, dataset), until one is measured "
                         "(1.1-1.7 s on a 2-core CPU in one client process, 2026-12-05)")
    ap.add_argument("--port", type=number("port"), default=0, help="the server's port (default: a free one)")


def add_table_arguments(ap: argparse.ArgumentParser, name: str, modes: Sequence[str],
                        default_modes: Sequence[str]) -> None:
    """Where a table of ``name`` goes (``OUT/<name>.json`` and ``.txt``) and what it holds: ``--out``,
    ``--work``, ``--modes``, ``--append``, ``--max-loras``, ``--gpus`` (shared with
    :mod:`benchmarks.serving.chat`)."""
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", f"/tmp/lorazor_{name}_out")))
    ap.add_argument("--work", type=Path, default=Path(f"/tmp/lorazor_{name}"),
                    help="model directory, adapters and bundles (kept between calls with the same adapters)")
    ap.add_argument("--modes", nargs="+", choices=modes, default=list(default_modes),
                    help="modes to run, in this order, each in its own server")
    ap.add_argument("--append", action="store_true",
                    help=f"keep the other modes of OUT/{name}.json (same vLLM, model, workload and SLO): one table "
                         "over several calls")
    ap.add_argument("--max-loras", type=number("positive_int"), default=32, help="adapter slots (vLLM's max_loras)")
    placement.add_argument(ap)


def main(argv: Sequence[str] | None = None) -> int:
    ap = Parser(description=__doc__.split("\n")[0])
    add_table_arguments(ap, "goodput", MODES, DEFAULT_MODES)
    ap.add_argument("--adapters", type=number("positive_int"), default=512,
                    help="adapters registered with --lora-modules")
    ap.add_argument("--requests", type=number("positive_int"), default=N_REQUESTS,
                    help="requests of bench.py's workload the bundle's k are profiled on")
    ap.add_argument("--seed", type=number("seed"), default=0, help="the bundle's workload and vllm bench serve's seed")
    vllm_settings.add_arguments(ap)
    add_sweep_arguments(ap)
    return orchestrate(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
