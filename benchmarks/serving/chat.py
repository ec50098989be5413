"""Goodput of a chat-shaped workload against vLLM with its defaults: one ``vllm serve`` per mode,
driven by ``vllm bench serve`` with a dataset file.

    python -m benchmarks.serving.chat --out DIR [--modes lorazor ...] [--gpus all] [--append] [--bundle DIR]

On a machine with six H200s (or more) and vLLM 0.34.0 or 0.33.0, the whole table in one call, the six
servers at once, one GPU each (:mod:`benchmarks.serving.placement`; the learned bundle is prepared
first on the lorazor mode's GPU, the other modes starting meanwhile):

    bash scripts/gpu_slot_bench.sh /tmp/chat chat512

On one H200, one mode per call (each fits a 10-minute call), into one table:

    MODES=lorazor bash scripts/gpu_slot_bench.sh /tmp/chat chat512
    MODES=lorazor-sync BUNDLE=/tmp/chat/chat512/learned bash scripts/gpu_slot_bench.sh /tmp/chat chat512
    MODES=lorazor-lag0 BUNDLE=/tmp/chat/chat512/learned bash scripts/gpu_slot_bench.sh /tmp/chat chat512
    MODES=gridtrim bash scripts/gpu_slot_bench.sh /tmp/chat chat512
    MODES=stock bash scripts/gpu_slot_bench.sh /tmp/chat chat512
    MODES=nolora bash scripts/gpu_slot_bench.sh /tmp/chat chat512

A second line (``--max-capture-size N``, ``GRAPH_TOKENS=N`` in the script) runs every mode with
vLLM's defaults but CUDA graphs captured up to N tokens (``--compilation-config
'{"max_cudagraph_capture_size": N}'``; vLLM's default is 512 on Hopper): it tells what the steps
past the default's largest graph, which run without one, cost each mode. Its table is a table of
its own (another ``--out``), its ratio lines marked ``[vLLM defaults, CUDA graphs up to N tokens]``.
``--gridtrim-launch inductor`` (``GRIDTRIM_LAUNCH=inductor``) serves the GridTrim modes with
``LORAZOR_GRIDTRIM_LAUNCH=inductor`` (docs/vllm_integration.md §4c), likewise a table of its own.

(``BUNDLE`` serves the learned bundle the lorazor call wrote into the table's folder, so that the
async/sync ratio compares one bundle; without it the bundle is prepared again, or taken from
``--work`` where it was kept.) The table ends with the lines

    chat512 goodput [vLLM defaults]: lorazor/stock = X.XX, lorazor/gridtrim = Y.YY
    learned async/sync = Z.ZZ
    learned lag 1/lag 0 [async] = W.WW

**Modes.** Every server runs vLLM's defaults: torch.compile with its default CUDA-graph mode,
async scheduling, prefix caching, the H200's default batch limits and share of its memory (on a
GPU of its own when the modes run at once). Each server's engine-config
line is checked for prefix caching on and vLLM's compilation (:data:`ENGINE_DEFAULTS`). The only
options given are the model (``--load-format dummy``), LoRA (``--enable-lora --max-loras 32
--max-lora-rank 8``, the adapters' rank, ``--max-cpu-loras 512``, every adapter kept in host
memory as goodput.py's servers keep them, ``--lora-modules`` for all 512), the host and port,
and in the lorazor modes LoRazor's worker extension, which reads the release counters; in the
second line, ``--compilation-config`` (above).

- ``stock``: no ``LORAZOR_*`` variable;
- ``gridtrim``: ``LORAZOR_GRIDTRIM=1`` only;
- ``lorazor``: GridTrim and the learned bundle (``LORAZOR_GRIDTRIM=1``, ``LORAZOR_BUNDLE``,
  ``LORAZOR_ADAPTERS``; :mod:`benchmarks.serving.chat_bundle`);
- ``lorazor-sync``: the same with ``--no-async-scheduling``, the one option that turns a default
  off, for ``learned async/sync``;
- ``lorazor-lag0``: the same heads and thresholds with decision lag 0 (:func:`lag0_bundle`), under
  async scheduling: each step is planned only once the previous step's decisions are read, the
  option that waits (docs/vllm_integration.md §9), for ``learned lag 1/lag 0``;
- ``nolora``: the backbone without LoRA; the same requests go to the base model.

The plugin's start-up lines are checked per mode as goodput.py checks them (``lorazor`` as its
``both``).

**The workload** (:mod:`benchmarks.serving.chat_workload`): 512 adapters by Zipf popularity, a
system prompt of 200–400 tokens per adapter, conversations of 1–4 turns whose follow-ups resend the
conversation, replies of 20–100 tokens (``ignore_eos``, temperature 1.0). Each rate has its own
conversations (the same for every mode), written as ``vllm bench serve``'s custom dataset
(``--dataset-name custom --custom-output-len -1 --skip-chat-template --disable-shuffle``). The
custom dataset has no per-row model, so the adapters go in ``--lora-modules``, one name per row,
with ``--lora-assignment round-robin``: request i gets name i (docs/vllm_integration.md §12b).
Before measuring, every adapter serves one 4-token request of its system prompt: each adapter has
been in a slot once and each system prompt is cached, as on a server that has been serving its
tenants.

**Measured per rate**: goodput.py's rate sweep, goodput rate and SLO verdict (P90 TTFT ≤ 1 s, P90
TPOT ≤ 50 ms, every request completed) over the requests' vLLM metrics; the P99s; the prefix-cache
hit rate (Δ ``vllm:prefix_cache_hits`` / Δ ``vllm:prefix_cache_queries`` of the server's
``/metrics``, :func:`metrics_delta`); the share of adapters with requests whose own requests meet
the SLO (:func:`adapter_slo`, from ``--save-detailed``) and the P90 TTFT of the requests of the most
popular adapters against the least popular (:func:`ttft_by_popularity`); the mean decode batch (Δ
``vllm:generation_tokens`` over Δ engine steps with output); the mean engine step (:func:`step_ms`:
the run's duration over those steps, the step time the slot capacity model takes,
``python -m serve_bridge.capacity --step-ms``); the share of those steps that processed more tokens
than vLLM's largest CUDA graph (:func:`largest_graph`, from the server's engine-config line) and ran
without one (Δ ``vllm:iteration_tokens_total`` buckets; the capacity model's "steps past 512
tokens" column predicts it); the GPU's busy share over the run's steady part
(:mod:`benchmarks.serving.gpu_busy`, ``nvidia-smi``; ``—`` without it); the realized skip in the
lorazor modes (``lorazor_counters``). The summary gives each at the mode's goodput rate.

**Where a step's time goes** (``--profile-rate R``): each mode's server starts with vLLM's torch
profiler configured for its worker (idle until asked; Python stacks off), and after the sweep one
more run at R req/s, kept out of the table's rows, records ``--profile-steps`` engine steps
(after :data:`PROFILE_DELAY_STEPS`). The trace stays in ``OUT/MODE/profile/trace``; the mode's
facts gain :func:`benchmarks.serving.step_profile.trace_line`: the mean step, the host time inside
``execute_model`` and outside it (the engine core's scheduling and output handling), the GPU
busy share from the trace's own kernels, the steps past the server's largest CUDA graph and their
``execute_model`` time against the others', the LoRA kernels' device time per step, and the host
time per call of GridTrim's op. The sweep leaves that run's time in the budget.

**Time.** A call has ``--budget-s`` (560 s); modes that run at once share it. goodput.py's servers
(full CUDA graphs of 12 sizes, no torch.compile, 512 adapters) were ready after 114–160 s
(benchmarks/results/2026-12-04-*goodput); vLLM's default compilation adds torch.compile (37 s for
SmolLM2 on 0.33.0, 2026-12-02) and the capture of its FULL_AND_PIECEWISE graphs (33 + 40 s there):
176–224 s with 512 adapters on an H200 (2026-12-05, benchmarks/results/2026-12-05-vllm-defaults.md),
400 s at most (``--ready-timeout-s``). The learned bundle, when it is not given or kept, took 185 s
more there (an eager engine's start-up 62 s, capture passes 46 s, 32 heads 76 s). A client run
costs its arrivals (``--duration-s`` 15 s, at least ``--min-prompts`` 150 requests) plus its own
overhead: about 21 s per rate when each rate started ``vllm bench serve`` afresh (2026-12-05), now
the tokenizer and dataset only, vLLM being imported once per server while it starts
(:mod:`benchmarks.serving.bench_client`). The probe and the rates fit what is left, and a rate that
no longer fits is not started (the table says so).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.serving import bench, goodput, gpu_busy, placement, step_profile, vllm_settings
from benchmarks.serving.bench_client import BenchClient
from benchmarks.serving.bench_workload import N_REQUESTS
from benchmarks.serving.chat_bundle import summary_path, with_lag
from benchmarks.serving.chat_workload import (ChatShape, add_shape_arguments, chat_rows, pool_for, shape_arguments,
                                              shape_from, shape_key, stream_key, system_prompts, words, write_dataset)
from benchmarks.serving.goodput import Slo
from benchmarks.serving.vllm_server import HarnessError, counters, free_port, http_json, tail, warm_up
from serve_bridge.command_line import Parser, existing_dir, number
from serve_bridge.gridtrim import COMPILED_LAUNCHES, DEFAULT_LAUNCH
from serve_bridge.vllm.settings import GRIDTRIM_ENV, GRIDTRIM_LAUNCH_ENV
from serve_bridge.vllm.versions import installed_version

# the vllm bench serve lines whose custom dataset and round-robin assignment this relies on (docs/vllm_integration.md §12b)
VERSIONS = ("0.34.0", "0.33.0")
MODES = ("lorazor", "lorazor-sync", "lorazor-lag0", "gridtrim", "stock", "nolora")
BENCH_MODE = {"stock": "stock", "gridtrim": "gridtrim", "lorazor": "both", "lorazor-sync": "both",
              "lorazor-lag0": "both", "nolora": "nolora"}
LEARNED = ("lorazor", "lorazor-sync", "lorazor-lag0")
SAME_BUNDLE = ("lorazor", "lorazor-sync")  # learned async/sync compares one bundle
DURATION_S, MIN_PROMPTS = 15.0, 150  # a rate's seconds of arrivals and fewest requests (--duration-s, --min-prompts)
# --profile-rate: steps skipped after /start_profile (about a second of arrivals), steps recorded, and the
# longest wait for the worker to write its trace
PROFILE_DELAY_STEPS, PROFILE_STEPS, PROFILE_WRITE_S = 100, 200, 60.0
LAG0 = "lorazor-lag0"
LABEL = {"stock": "stock", "gridtrim": "gridtrim (LORAZOR_GRIDTRIM=1)",
         "lorazor": "lorazor (GridTrim + the learned bundle)",
         "lorazor-sync": "lorazor-sync (the same, --no-async-scheduling)",
         "lorazor-lag0": "lorazor-lag0 (the same heads, decision lag 0)",
         "nolora": "nolora (the backbone without LoRA)"}
WORKER_EXTENSION = "serve_bridge.vllm.rpc.LoRazorWorkerExtension"
# vLLM's defaults as the engine core logs its config (v1/engine/core.py:140-142, config/vllm.py:2839-2842 in 0.33.0;
# :154-156 and :2920-2923 in 0.34.0)
ENGINE_DEFAULTS = ("enable_prefix_caching=True", "CompilationMode.VLLM_COMPILE", "CUDAGraphMode.FULL_AND_PIECEWISE")
ENGINE_LINE = "Initializing a V1 LLM engine"
# /metrics samples (v1/metrics/loggers.py: counters :661-678 and :799, the per-step histogram :887-893)
CACHE_QUERIES, CACHE_HITS = "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"
GENERATED, STEPS = "vllm:generation_tokens_total", "vllm:iteration_tokens_total_count"
STEP_BUCKET = "vllm:iteration_tokens_total_bucket"  # that histogram's buckets, one per le bound
# the engine-config field that names vLLM's largest CUDA graph (config/vllm.py:2453-2470 in 0.33.0: 512 tokens,
# 1024 on Blackwell, under the defaults; both bounds of the per-step token histogram, v1/metrics/buckets.py:107-121)
LARGEST_GRAPH = re.compile(r"'max_cudagraph_capture_size': (\d+)")
DETAIL_DROPPED = ("generated_texts", "itls")  # per-request lists not kept in the result files
DATASETS = threading.Lock()  # held while a rate's dataset file is looked for and written
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)(\s+\S+)?$")
_LE = re.compile(r'[{,]le="([^"]*)"')


# -- metrics (pure) -------------------------------------------------------------------------------

def prometheus(text: str) -> dict[str, float]:
    """Prometheus text exposition → sample name → its value summed over label sets; a histogram
    bucket also under ``name{le="bound"}`` (:func:`bucket`), summed over its other labels."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if m:  # comments (# HELP, # TYPE) do not match
            keys = [m.group(1)]
            if le := _LE.search(m.group(2) or ""):
                keys.append(bucket(m.group(1), le.group(1)))
            for key in keys:
                out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def bucket(sample: str, le: str) -> str:
    """:func:`prometheus`' key of one histogram bucket: ``sample`` ending in ``_bucket``, ``le`` as
    exported (``"512.0"``)."""
    return f'{sample}{{le="{le}"}}'


def largest_graph(log_text: str) -> int | None:
    """The token count of vLLM's largest CUDA graph, from the server's engine-config line (None
    without one, or with CUDA graphs off)."""
    m = LARGEST_GRAPH.search(engine_line(log_text))
    return int(m.group(1)) or None if m else None


def metrics_delta(before: dict[str, float], after: dict[str, float],
                  graph_tokens: int | None = None) -> dict[str, float | None]:
    """Over one run: prefix-cache queried and hit tokens, their hit rate, the engine steps with
    output, the mean decode batch (tokens generated per such step) and, with ``graph_tokens`` (the
    largest CUDA graph) a bound of the per-step token histogram, the share of those steps that
    processed more tokens and so ran without a graph (else None); a sample the server does not
    export is an error."""
    missing = sorted({CACHE_QUERIES, CACHE_HITS, GENERATED, STEPS} - set(after))
    if missing:
        raise HarnessError(f"the server's /metrics has no {', '.join(missing)}")
    within = None if graph_tokens is None else bucket(STEP_BUCKET, f"{graph_tokens:.1f}")
    d = {k: after[k] - before.get(k, 0.0) for k in (CACHE_QUERIES, CACHE_HITS, GENERATED, STEPS, within) if k in after}
    return {"cache_queries": d[CACHE_QUERIES], "cache_hits": d[CACHE_HITS],
            "cache_hit_rate": d[CACHE_HITS] / d[CACHE_QUERIES] if d[CACHE_QUERIES] else None,
            "engine_steps": d[STEPS], "decode_batch": d[GENERATED] / d[STEPS] if d[STEPS] else None,
            "past_graphs": (d[STEPS] - d[within]) / d[STEPS] if within in d and d[STEPS] else None}


def step_ms(row: dict[str, Any]) -> float | None:
    """A run's mean engine step in ms: its benchmark duration over its engine steps with output
    (None for a run without steps, or recorded before the steps were kept)."""
    steps = row["server_metrics"].get("engine_steps")
    return row["duration_s"] * 1e3 / steps if steps else None


def per_request(data: dict[str, Any], sent: int, keys: Sequence[str]) -> list[list[Any]]:
    """The ``--save-detailed`` result's per-request lists ``keys`` (the first named in the error),
    each checked to hold one entry per request sent."""
    lists = [data[k] for k in keys]
    if any(len(v) != sent for v in lists):
        raise HarnessError(f"{sent} requests sent, {len(lists[0])} in the detailed result")
    return lists


def adapter_slo(names: Sequence[str], data: dict[str, Any], slo: Slo) -> dict[str, int]:
    """Adapters with requests in the run (request i's is ``names[i]``), and those whose requests all
    completed with their own P90 TTFT and P90 TPOT within the SLO; per request as vLLM counts it:
    TTFT, and TPOT = (latency − TTFT) / (output tokens − 1) over requests of more than one token."""
    ttft, latency, out, err = per_request(data, len(names), ("ttfts", "latencies", "output_lens", "errors"))
    by: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        by.setdefault(name, []).append(i)
    meeting = 0
    for idx in by.values():
        if any(err[i] or not out[i] for i in idx):
            continue
        tpots = [(latency[i] - ttft[i]) / (out[i] - 1) for i in idx if out[i] > 1]
        meeting += bool(np.percentile([ttft[i] for i in idx], 90) * 1e3 <= slo.ttft_ms
                        and (not tpots or np.percentile(tpots, 90) * 1e3 <= slo.tpot_ms))
    return {"adapters": len(by), "meeting": meeting}


RANK_BANDS = (8, 32, 128)  # popularity ranks 1–8, 9–32, 33–128, 129 and after: the per-rate table's TTFT bands


def ttft_by_popularity(adapters: Sequence[int], data: dict[str, Any]) -> list[float | None]:
    """P90 TTFT in ms of the requests of each popularity band (:data:`RANK_BANDS`; request i on adapter
    ``adapters[i]``, adapter a the (a+1)-th most popular), None for a band without requests. Past a
    mode's knee the bands part: the adapters that are not resident wait for a slot."""
    ttft = np.asarray(per_request(data, len(adapters), ("ttfts",))[0], dtype=float)
    rank, edges = np.asarray(adapters), (0, *RANK_BANDS, np.inf)
    bands = [(rank >= lo) & (rank < hi) for lo, hi in zip(edges, edges[1:])]
    return [float(np.percentile(ttft[b], 90) * 1e3) if b.any() else None for b in bands]


def missing_defaults(log_text: str) -> list[str]:
    """The :data:`ENGINE_DEFAULTS` that the server's engine-config line lacks (all when there is none)."""
    line = engine_line(log_text)
    return [d for d in ENGINE_DEFAULTS if d not in line]


def engine_line(log_text: str) -> str:
    """The server log's engine-config line (:data:`ENGINE_LINE`), empty when there is none."""
    return next((ln for ln in log_text.splitlines() if ENGINE_LINE in ln), "")


# -- commands (pure) --------------------------------------------------------------------------------

def server_command(model_dir: Path, mode: str, adapters: dict[str, Path], max_loras: int, port: int,
                   profile: tuple[Path, int] | None = None, max_capture_size: int | None = None) -> list[str]:
    """``vllm serve`` of a mode with vLLM's defaults (module doc): the dummy model, LoRA and its
    adapters (not for nolora), LoRazor's worker extension in the lorazor modes, and
    ``--no-async-scheduling`` for lorazor-sync. ``profile`` (trace directory, steps) configures
    vLLM's torch profiler for the worker alone, idle until ``POST /start_profile``, then recording
    that many steps after :data:`PROFILE_DELAY_STEPS`, without Python stacks. ``max_capture_size``:
    the second line's largest CUDA graph, in tokens (None: vLLM's)."""
    cmd = [*goodput.VLLM_CLI, "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
           "--load-format", "dummy"]
    if max_capture_size is not None:
        cmd += ["--compilation-config", json.dumps({"max_cudagraph_capture_size": max_capture_size})]
    if profile is not None:
        config = {"profiler": "torch", "torch_profiler_dir": str(profile[0].resolve()), "ignore_frontend": True,
                  "torch_profiler_with_stack": False, "delay_iterations": PROFILE_DELAY_STEPS,
                  "max_iterations": profile[1]}
        cmd += ["--profiler-config", json.dumps(config)]
    if mode != "nolora":
        cmd += ["--enable-lora", "--max-loras", str(max_loras), "--max-lora-rank", str(bench.RANK),
                "--max-cpu-loras", str(len(adapters)), "--lora-modules", *(f"{n}={p}" for n, p in adapters.items())]
    if mode in LEARNED:
        cmd += ["--worker-extension-cls", WORKER_EXTENSION]
    return cmd + (["--no-async-scheduling"] if mode == "lorazor-sync" else [])


def client_command(base_url: str, model_dir: Path, rate: float, n_rows: int, dataset: Path, per_row: Sequence[str],
                   seed: int, slo: Slo, result: Path, mode: str) -> list[str]:
    """``vllm bench serve``'s options for one rate over the ``n_rows`` rows of ``dataset`` in order (the custom
    dataset, each row's ``output_tokens``, no chat template), request i on adapter ``per_row[i]``
    (none: the base model), per-request results kept (``--save-detailed``)."""
    cmd = goodput.client_base(base_url, model_dir, rate, n_rows, seed, slo, result, mode) + [
        "--dataset-name", "custom", "--dataset-path", str(dataset), "--custom-output-len", "-1",
        "--skip-chat-template", "--disable-shuffle", "--save-detailed"]
    if per_row:
        cmd += ["--lora-modules", *per_row, "--lora-assignment", "round-robin"]
    return cmd


# -- the table (pure) -------------------------------------------------------------------------------

HEADER = ("| rate req/s | prompts | completed | req/s | TTFT P90 ms | TTFT P99 ms | TPOT P90 ms | TPOT P99 ms | "
          "prefix-cache hits | adapters meeting the SLO | decode batch | step ms | steps past graphs | GPU busy | "
          "realized skip | TTFT P90 ms by popularity rank 1–8 / 9–32 / 33–128 / 129+ | SLO on the P90s |")
SUMMARY_HEADER = ("| mode | goodput req/s | lowest rate missing | probe req/s | TTFT P99 ms | TPOT P99 ms | "
                  "prefix-cache hits | adapters meeting the SLO | decode batch | step ms | steps past graphs | "
                  "GPU busy | realized skip | vs stock |")


def _cells(row: dict[str, Any], percentiles: Sequence[int] = (90, 99)) -> str:
    """A row's TTFT and TPOT at ``percentiles``, then its cache, adapter, batch, step, graph, GPU and
    skip cells."""
    lat = " | ".join(f"{row[f'{m}_p{p}_ms']:.1f}" for m in ("ttft", "tpot") for p in percentiles)
    hit, batch, step = row["server_metrics"]["cache_hit_rate"], row["server_metrics"]["decode_batch"], step_ms(row)
    past = row["server_metrics"].get("past_graphs")  # kept rows from before it have none
    share, busy = row["adapter_slo"], row.get("gpu_busy")  # kept rows from before gpu_busy have none
    skip = "—" if "counters" not in row else f"{row['counters']['realized_skip']:.3f}"
    return (f"{lat} | {'—' if hit is None else f'{hit:.1%}'} | {share['meeting']}/{share['adapters']} | "
            f"{'—' if batch is None else f'{batch:.1f}'} | {'—' if step is None else f'{step:.1f}'} | "
            f"{'—' if past is None else f'{past:.1%}'} | {'—' if busy is None else f'{busy:.0f}%'} | {skip}")


def format_row(row: dict[str, Any], slo: Slo) -> str:
    """One rate's row of a mode's table (the probe's rate is ``inf``)."""
    rate = "inf" if row["rate"] is None else f"{row['rate']:g}"
    verdict = "probe" if row["rate"] is None else ("met" if goodput.meets_slo(row, slo) else "missed: " + ", ".join(
        goodput.misses(row, slo)))
    bands = row.get("ttft_by_popularity")  # kept rows from before it have none
    by_rank = "—" if bands is None else " / ".join("—" if b is None else f"{b:.0f}" for b in bands)
    return (f"| {rate} | {row['prompts']} | {row['completed']} | {row['request_throughput']:.1f} | {_cells(row)} | "
            f"{by_rank} | {verdict} |")


def rates(modes: dict[str, dict[str, Any]], slo: Slo) -> dict[str, float | None]:
    """Each mode's goodput rate."""
    return {m: goodput.goodput_rate(goodput.points_of(e, slo))[0] for m, e in modes.items()}


def summary_row(mode: str, entry: dict[str, Any], stock: float | None, slo: Slo) -> str:
    """A mode's summary line, its numbers at its goodput rate."""
    best, low_miss = goodput.goodput_rate(goodput.points_of(entry, slo))
    probe = [f"{r['request_throughput']:.1f}" for r in entry["rows"] if r["rate"] is None]
    at = next((r for r in entry["rows"] if best is not None and r["rate"] == best), None)
    cells = "— | — | — | — | — | — | — | — | —" if at is None else _cells(at, (99,))
    return (f"| {LABEL[mode]} | {'none' if best is None else f'{best:g}'} | "
            f"{'none' if low_miss is None else f'{low_miss:g}'} | {probe[0] if probe else '—'} | {cells} | "
            f"{f'{best / stock:.2f}' if best and stock else '—'} |")


def settings_tag(max_capture_size: int | None, gridtrim_launch: str = DEFAULT_LAUNCH) -> str:
    """How the ratio lines mark a table's settings: vLLM's defaults, and a second line's graphs or
    GridTrim's compiled launch when they are not the defaults."""
    parts = ["vLLM defaults"]
    if max_capture_size is not None:
        parts.append(f"CUDA graphs up to {max_capture_size} tokens")
    if gridtrim_launch != DEFAULT_LAUNCH:
        parts.append(f"GridTrim launched by {gridtrim_launch}")
    return f"[{', '.join(parts)}]"


def ratio_lines(n_adapters: int, modes: dict[str, dict[str, Any]], slo: Slo,
                tag: str = settings_tag(None)) -> list[str]:
    """The report's last three lines (``n/a`` for a ratio whose modes lack a goodput rate): the
    headline ratios, async against synchronous scheduling on one bundle, and decision lag 1
    against lag 0 (which waits for each step's decisions) under async scheduling; ``tag`` marks the
    table's settings (:func:`settings_tag`)."""
    r = rates(modes, slo)

    def ratio(a: str, b: str) -> str:
        return f"{r[a] / r[b]:.2f}" if r.get(a) and r.get(b) else "n/a"

    def bundle(mode: str) -> dict[str, Any]:
        return modes.get(mode, {}).get("bundle") or {}

    sync = ratio("lorazor", "lorazor-sync")
    if sync != "n/a" and len({bundle(m).get("sha256") for m in SAME_BUNDLE if m in modes}) > 1:
        sync = "n/a (lorazor and lorazor-sync served different bundles)"
    lag = ratio("lorazor", LAG0)
    if lag != "n/a" and bundle(LAG0).get("lag_of") != bundle("lorazor").get("sha256"):
        lag = "n/a (lorazor-lag0 is not lorazor's bundle with lag 0)"
    return [f"chat{n_adapters} goodput {tag}: lorazor/stock = {ratio('lorazor', 'stock')}, "
            f"lorazor/gridtrim = {ratio('lorazor', 'gridtrim')}", f"learned async/sync = {sync}",
            f"learned lag 1/lag 0 [async] = {lag}"]


def render(doc: dict[str, Any], slo: Slo) -> str:
    """The report: preamble, the summary, each mode's rates, notes, the ratio lines."""
    modes = doc["modes"]
    stock = rates(modes, slo).get("stock")
    lines = doc["preamble"] + ["", SUMMARY_HEADER, goodput.table_rule(SUMMARY_HEADER)]
    lines += [summary_row(m, e, stock, slo) for m, e in modes.items()]
    lines += goodput.mode_sections(modes, slo, LABEL, HEADER, format_row)
    return "\n".join(lines + [""] + doc["notes"] + [""] + doc["ratio"]) + "\n"


def preamble(args: argparse.Namespace, version: str, slo: Slo, shape: ChatShape) -> list[str]:
    """The report's opening lines; the first three identify a table that ``--append`` may extend."""
    n, first = shape.n_adapters, (f"from {args.start_rate:g} req/s" if args.start_rate is not None else
                                  f"a probe of {args.probe_prompts} requests at once, then from "
                                  f"{args.start_fraction:g} x its req/s")
    graphs = ("its default CUDA graphs" if args.max_capture_size is None else
              f"its default CUDA-graph mode with graphs up to {args.max_capture_size} tokens (--compilation-config "
              f"max_cudagraph_capture_size={args.max_capture_size} in every mode)")
    graphs += f"; {vllm_settings.gridtrim_launch_note(args.gridtrim_launch)}"
    return [
        f"Chat workload goodput against vLLM's defaults: vLLM {version}, one `vllm serve` per mode (torch.compile, "
        f"{graphs}, async scheduling, prefix caching; lorazor-sync alone adds --no-async-scheduling), "
        "driven by `vllm bench serve` with a custom dataset file",
        f"model: {bench.MODEL_NAME['llama3b']} config, dummy weights, word-level tokenizer of its 128256 tokens; {n} "
        f"rank-{bench.RANK} random peft adapters ({min(bench.DISTINCT_WEIGHTS, n)} distinct weight files); server "
        f"options: --load-format dummy --enable-lora --max-loras {args.max_loras} --max-lora-rank {bench.RANK} "
        f"--max-cpu-loras {n} --lora-modules (all {n})",
        f"workload: conversations on {n} adapters by Zipf popularity (s = {shape.zipf:g}), a system prompt of "
        f"{shape.system_len[0]}-{shape.system_len[1]} tokens per adapter, 1-{shape.max_turns} turns of user messages "
        f"of {shape.user_len[0]}-{shape.user_len[1]} tokens and replies of {shape.output_len[0]}-{shape.output_len[1]} "
        f"tokens (ignore_eos, temperature 1.0), each follow-up resending the conversation, about {shape.think_s:g} s "
        f"between a conversation's turns; seed {args.seed}; Poisson arrivals, per rate max({args.min_prompts}, rate x "
        f"{args.duration_s:g} s) requests; SLO: P90 TTFT <= {slo.ttft_ms:g} ms and P90 TPOT <= {slo.tpot_ms:g} ms, "
        "every request completed",
        f"sweep: {first}, x{args.factor:g} while the SLO holds, /{args.factor:g} below a miss (not under "
        f"{args.min_rate:g}), then bisection to {args.tolerance:.0%}; goodput rate = the highest rate meeting the SLO "
        "below the lowest rate missing it",
        "per rate: prefix-cache hits = hit / queried prompt tokens (the server's /metrics over the run); adapters "
        "meeting the SLO = adapters whose own requests all completed within the SLO's P90s, of those with requests; "
        "decode batch = tokens generated per engine step with output; steps past graphs = those steps that processed "
        "more tokens than vLLM's largest CUDA graph and ran without one (the server's per-step token histogram); "
        "realized skip = the lorazor modes' StepTrim counters",
    ]


# -- the server and the client ------------------------------------------------------------------------

def metrics(base_url: str) -> dict[str, float]:
    """The server's ``GET /metrics`` (:func:`prometheus`)."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=60) as resp:
        return prometheus(resp.read().decode())


def measure(mode: str, base_url: str, model_dir: Path, directory: Path, args: argparse.Namespace, shape: ChatShape,
            slo: Slo, deadline: float, gpu: placement.Gpu, client: BenchClient,
            graph_tokens: int | None) -> Callable[[float, int], dict[str, Any]]:
    """The sweep's measure of one mode on ``gpu`` through ``client``: ``(rate, requests)`` → the
    rate's row (module doc); ``graph_tokens``: the server's largest CUDA graph (:func:`largest_graph`)."""
    def run(rate: float, n: int) -> dict[str, Any]:
        label = goodput.rate_label(rate)
        rows = chat_rows(shape, args.seed, stream_key(rate), n, pool_for(rate, shape.think_s, n))
        names = [bench.adapter_name(r.adapter) for r in rows]
        dataset = args.work / "chat" / f"{shape_key(shape, args.seed)}-rate-{label}-{n}.jsonl"
        with DATASETS:  # modes that run at once may reach the same rate together
            if not dataset.exists():
                write_dataset(dataset, rows, [bench.adapter_name(a) for a in range(shape.n_adapters)])
        result, log = directory / f"rate_{label}.json", directory / f"rate_{label}.log"
        cmd = client_command(base_url, model_dir, rate, n, dataset, [] if mode == "nolora" else names, args.seed,
                             slo, result, mode)
        learned = mode in LEARNED
        before, counted = metrics(base_url), counters(base_url) if learned else None
        with gpu_busy.BusySampler(gpu_busy.command(gpu)) as busy:
            data, wall_s = goodput.run_client(client, cmd, label, log, result, deadline)
            exited = time.monotonic()
        parsed = goodput.parse_result(data)
        row = {"rate": None if math.isinf(rate) else rate, "prompts": n, **parsed, "wall_s": wall_s,
               "result": result.name, "server_metrics": metrics_delta(before, metrics(base_url), graph_tokens),
               "adapter_slo": adapter_slo(names, data, slo),
               "ttft_by_popularity": ttft_by_popularity([r.adapter for r in rows], data),
               "gpu_busy": busy.mean(*gpu_busy.steady_window(exited, parsed["duration_s"]))}
        if counted is not None:
            row["counters"] = goodput.counter_delta(counted, counters(base_url))
        result.write_text(json.dumps({k: v for k, v in data.items() if k not in DETAIL_DROPPED}))
        return row

    return run


def profiled_run(run: Callable[[float, int], dict[str, Any]], base_url: str, trace_dir: Path, rate: float,
                 args: argparse.Namespace, deadline: float, overhead_s: float, graph_tokens: int | None = None) -> str:
    """One client run at ``rate`` under vLLM's profiler (started before it, stopped after it), kept
    out of the sweep; returns the table's line: the steps :func:`step_profile.trace_summary` reads off
    the worker's trace (split at ``graph_tokens``, the server's largest CUDA graph), or why there
    are none."""
    n, need = goodput.planned_run(rate, args, overhead_s, None)
    left = goodput.budget_left_s(deadline)
    if need + PROFILE_WRITE_S > left:
        return f"profile at {rate:g} req/s not run: it needs about {need + PROFILE_WRITE_S:.0f} s, {left:.0f} s left"
    trace_dir.mkdir(parents=True, exist_ok=True)
    try:
        http_json(base_url + "/start_profile", {}, 120)
    except OSError as e:
        return f"profile at {rate:g} req/s not started: POST /start_profile: {e}"
    try:
        run(rate, n)
    finally:
        http_json(base_url + "/stop_profile", {}, 120)  # a no-op once the profiler stopped itself after its steps
    end = time.monotonic() + PROFILE_WRITE_S
    while not (traces := sorted(trace_dir.glob("*.pt.trace.json*"))) and time.monotonic() < end:
        time.sleep(2.0)
    if not traces:
        return f"profile at {rate:g} req/s: no trace in {trace_dir} after {PROFILE_WRITE_S:.0f} s"
    time.sleep(2.0)  # the worker may still be writing it
    try:
        line = step_profile.trace_line(step_profile.trace_summary(traces[-1], graph_tokens))
    except ValueError as e:
        return f"profile at {rate:g} req/s: {e}"
    return f"profile at {rate:g} req/s ({traces[-1].name}, not in the sweep): {line}"


def run_mode(mode: str, entry: dict[str, Any], args: argparse.Namespace, shape: ChatShape, bundle: Path | None,
             deadline: float, slo: Slo, flush: Callable[[], None], gpu: placement.Gpu) -> None:
    """Start the mode's server (on ``gpu``, :func:`placement.env`), check it, warm it up, sweep, stop
    it, filling the mode's ``entry``."""
    directory = args.out / mode
    directory.mkdir(parents=True, exist_ok=True)
    adapters = {bench.adapter_name(a): args.work / "adapters" / bench.adapter_name(a) for a in range(shape.n_adapters)}
    model_dir, port = args.work / "model", args.port or free_port()
    base_url, log = f"http://127.0.0.1:{port}", directory / "server.log"
    served = [] if mode == "nolora" else list(adapters)
    env = (goodput.server_env(BENCH_MODE[mode], dict(os.environ), bundle or Path(), adapters)
           | placement.env(gpu, args.work))
    if GRIDTRIM_ENV in env:
        env[GRIDTRIM_LAUNCH_ENV] = args.gridtrim_launch

    trace_dir = directory / "profile" / "trace"  # --profile-rate's: vLLM's worker writes its trace there

    def body(client: BenchClient) -> None:
        log_text = log.read_text(errors="replace")
        missing = missing_defaults(log_text)
        if missing:
            raise HarnessError(f"the engine-config line of {log} lacks {', '.join(missing)}: not vLLM's defaults")
        graph_tokens = largest_graph(log_text)
        if args.max_capture_size is not None and graph_tokens != args.max_capture_size:
            shown = ("no largest CUDA graph" if graph_tokens is None else
                     f"a largest CUDA graph of {graph_tokens} tokens")
            raise HarnessError(f"the engine-config line of {log} gives {shown}, not the {args.max_capture_size} asked")
        if graph_tokens:
            entry["facts"].append(f"vLLM's largest CUDA graph: {graph_tokens} tokens")
        if GRIDTRIM_LAUNCH_ENV in env and f"compiled launches: {args.gridtrim_launch})" not in log_text:
            raise HarnessError(f"{log} lacks GridTrim's line with 'compiled launches: {args.gridtrim_launch}'")
        systems = [words(s) for s in system_prompts(shape, args.seed)]
        warm_s = warm_up(base_url, served or [str(model_dir)] * len(systems), systems)
        entry["facts"].append(f"warm-up: each adapter's system prompt once, {warm_s:.1f} s")
        flush()
        rate = args.profile_rate
        reserve = 0.0 if rate is None else PROFILE_WRITE_S + goodput.planned_run(
            rate, args, args.client_overhead_s, None)[1]
        goodput.sweep_mode(measure(mode, base_url, model_dir, directory, args, shape, slo, deadline, gpu, client,
                                   graph_tokens),
                           entry, args, slo, deadline - reserve, flush)
        if rate is not None:
            overhead = goodput.client_overhead_s(entry["rows"][-1]) if entry["rows"] else args.client_overhead_s
            profiled = measure(mode, base_url, model_dir, trace_dir.parent, args, shape, slo, deadline, gpu,
                               client, graph_tokens)
            entry["facts"].append(profiled_run(profiled, base_url, trace_dir, rate, args, deadline, overhead,
                                               graph_tokens))

    profile = None if args.profile_rate is None else (trace_dir, args.profile_steps)
    command = server_command(model_dir, mode, adapters, args.max_loras, port, profile, args.max_capture_size)
    goodput.with_server(entry, command, env, log, base_url, served, goodput.expected_markers(BENCH_MODE[mode]),
                        args.ready_timeout_s, deadline, body, flush)


def manifest_sha(bundle: Path) -> str:
    """A bundle's name in the table: the first 12 hex digits of its manifest's sha256."""
    return hashlib.sha256((bundle / "manifest.json").read_bytes()).hexdigest()[:12]


def learned_bundle(args: argparse.Namespace, shape: ChatShape, deadline: float,
                   gpu: placement.Gpu) -> tuple[Path, dict[str, Any]]:
    """The learned bundle the lorazor modes serve: ``--bundle``, else the one kept in ``--work``
    for this workload, else prepared now on ``gpu`` (:mod:`benchmarks.serving.chat_bundle`, log in OUT);
    copied to ``OUT/learned`` (with its summary) and described by its manifest's sha256 and
    planned skip. The preparation leaves ``--min-mode-s`` of the budget to the server; its failure
    is an error with its log's tail."""
    if args.bundle is not None and not (args.bundle / "manifest.json").exists():
        raise HarnessError(f"--bundle {args.bundle}: no bundle there (no manifest.json)")
    path = args.bundle or args.work / "learned" / f"n{shape.n_adapters}-{shape_key(shape, args.seed)}"
    if not (path / "manifest.json").exists():
        shutil.rmtree(path, ignore_errors=True)  # --work's own: what an interrupted preparation left
        path.parent.mkdir(parents=True, exist_ok=True)
        log = args.out / "learned_prep.log"
        cmd = [sys.executable, "-m", "benchmarks.serving.chat_bundle", "--work", str(args.work), "--bundle", str(path),
               "--seed", str(args.seed), *shape_arguments(shape)]
        print(f"  preparing the learned bundle ({log})", flush=True)
        with open(log, "w") as out:
            try:
                env = goodput.client_env(dict(os.environ)) | placement.env(gpu, args.work)
                code = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                      timeout=max(1.0, deadline - time.monotonic() - args.min_mode_s)).returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
        if code != 0:
            shutil.rmtree(path, ignore_errors=True)
            raise HarnessError(f"the learned bundle was not prepared ({code}); {log} ends:\n" + tail(log))
    summary = json.loads(summary_path(path).read_text()) if summary_path(path).exists() else {}
    kept = args.out / "learned"
    if path.resolve() != kept.resolve():
        shutil.rmtree(kept, ignore_errors=True)
        shutil.copytree(path, kept)
        if summary:
            summary_path(kept).write_text(json.dumps(summary, indent=1))
    return path, {"sha256": manifest_sha(path), "planned_skip": summary.get("planned_skip"),
                  "heldout_requests": summary.get("heldout_requests")}


def lag0_bundle(directory: Path, learned: tuple[Path, dict[str, Any]]) -> tuple[Path, dict[str, Any]]:
    """The lorazor-lag0 mode's bundle: the learned one with decision lag 0
    (:func:`chat_bundle.with_lag`), written afresh to ``directory``; its planned skip is not
    computed (the held-out scores are not kept): about one forward per released request more."""
    shutil.rmtree(directory, ignore_errors=True)
    with_lag(learned[0], 0, directory)
    return directory, {"sha256": manifest_sha(directory), "planned_skip": None, "heldout_requests": None,
                       "lag_of": learned[1]["sha256"]}


def orchestrate(args: argparse.Namespace) -> int:
    start = time.monotonic()
    deadline = start + args.budget_s
    version, shape = installed_version(), shape_from(args)
    gpus = placement.resolve(args.gpus, args.port, os.environ)
    if problem := goodput.refusal("chat", version, VERSIONS, "its vllm bench serve's custom dataset and round-robin "
                                  "adapters, docs/vllm_integration.md §12b", shape.n_adapters, args.max_loras,
                                  gpus, args.modes):
        print(problem, file=sys.stderr)
        return 2
    slo = Slo(args.ttft_slo_ms, args.tpot_slo_ms)
    args.out.mkdir(parents=True, exist_ok=True)
    goodput.prepare_files(args.work, shape.n_adapters, N_REQUESTS, args.seed)  # model, tokenizer, adapters
    doc = goodput.load_table(args.out / "chat.json", preamble(args, version, slo, shape), args.append)
    if doc is None:
        print(f"{args.out}/chat.json holds another vLLM, model or workload: give another --out", file=sys.stderr)
        return 2
    doc["notes"].append(goodput.call_note(args.modes, gpus))

    @placement.serialized
    def flush() -> None:
        doc["ratio"] = ratio_lines(shape.n_adapters, doc["modes"], slo,
                                   settings_tag(args.max_capture_size, args.gridtrim_launch))
        (args.out / "chat.json").write_text(json.dumps(doc, indent=1))
        (args.out / "chat.txt").write_text(render(doc, slo))

    learned: dict[str, Any] = {}  # the bundle (path, description) or the error preparing it, once
    preparing = threading.Lock()  # the learned modes that run at once wait for one preparation

    def run(mode: str, entry: dict[str, Any], gpu: placement.Gpu) -> None:
        bundle = None
        if mode in LEARNED:
            with preparing:
                if not learned:
                    try:
                        learned["bundle"] = learned_bundle(args, shape, deadline, gpu)
                    except HarnessError as e:
                        learned["error"] = str(e)
                if mode == LAG0 and "bundle" in learned and LAG0 not in learned:
                    learned[LAG0] = lag0_bundle(args.out / "learned-lag0", learned["bundle"])
            if "error" in learned:
                entry["error"] = learned["error"]
                return
            with placement.TABLE:  # a key added while another mode's thread may write the table
                bundle, entry["bundle"] = learned[LAG0 if mode == LAG0 else "bundle"]
            planned, of = entry["bundle"]["planned_skip"], entry["bundle"].get("lag_of")
            entry["facts"].append(f"learned bundle {entry['bundle']['sha256']}"
                                  + (f" (bundle {of} with decision lag 0)" if of else "") + ", planned skip "
                                  + ('unknown' if planned is None else f'{planned:.3f}'))
        run_mode(mode, entry, args, shape, bundle, deadline, slo, flush, gpu)

    rc = placement.run_modes(doc, args, gpus, start, deadline, run, flush)
    print((args.out / "chat.txt").read_text(), flush=True)  # ends with the ratio lines
    return rc


def main(argv: Sequence[str] | None = None) -> int:
    ap = Parser(description=__doc__.split("\n")[0])
    goodput.add_table_arguments(ap, "chat", MODES, MODES)
    ap.add_argument("--seed", type=number("seed"), default=0, help="the workload's seed (and vllm bench serve's)")
    ap.add_argument("--bundle", type=existing_dir, default=None,
                    help="the learned bundle the lorazor modes serve (default: the one kept in --work, else prepared)")
    add_shape_arguments(ap)
    goodput.add_sweep_arguments(ap)
    ap.add_argument("--profile-rate", type=number("positive_number"), default=None, metavar="R",
                    help="after each mode's sweep, one run at R req/s under vLLM's torch profiler (kept out of the "
                         "sweep): the worker's trace in OUT/MODE/profile/trace and a line of where its steps go")
    ap.add_argument("--profile-steps", type=number("positive_int"), default=PROFILE_STEPS,
                    help="engine steps the profiler records, after %d steps of the run" % PROFILE_DELAY_STEPS)
    ap.add_argument("--max-capture-size", type=number("positive_int"), default=None, metavar="N",
                    help="the second line: vLLM's defaults but CUDA graphs captured up to N tokens in every mode "
                         "(default: vLLM's own, 512 on Hopper); a table of its own")
    ap.add_argument("--gridtrim-launch", choices=COMPILED_LAUNCHES, default=DEFAULT_LAUNCH,
                    help="how GridTrim's servers launch their kernels in the compiled forward "
                         "(LORAZOR_GRIDTRIM_LAUNCH, docs/serving.md); a value other than the default is a table of "
                         "its own")
    ap.set_defaults(duration_s=DURATION_S, min_prompts=MIN_PROMPTS, ready_timeout_s=400, min_mode_s=300)
    return orchestrate(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
