"""The offline serving benchmark's report (:mod:`benchmarks.serving.bench`): its table of req/s
(or, open loop, TTFT and TPOT) per (adapters, traffic, mode, and vLLM where a run compares several)
with each row's ratio to the stock row of its own pass, settings and vLLM, the slot statistics
beside the capacity model's prediction, and the notes' line per engine and per interleaved round."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks.serving import interleave
from benchmarks.serving.vllm_settings import VllmSettings

HEADER = "| adapters | traffic | mode | req/s | output tok/s | realized skip | vs stock |"


# --arrival-rate: open-loop latency; "vs stock" is then stock's TPOT P50 over the row's
LATENCY_HEADER = ("| adapters | traffic | mode | req/s | output tok/s | TTFT P50 ms | TTFT P90 ms | TPOT P50 ms | "
                  "TPOT P90 ms | realized skip | vs stock (TPOT P50) |")


MODE_LABEL = {"stock": "stock", "gridtrim": "gridtrim (our LoRA kernels, no release)",
              "steptrim": "steptrim (release, vLLM's LoRA kernels)",
              "both": "steptrim + gridtrim (release, our LoRA kernels)",
              "nolora": "no LoRA (backbone alone: the ceiling)",
              "stockfix": "stock + one registry read per step (the plugin's vLLM fix alone)"}


def probe_note(row: dict[str, Any]) -> str:
    """The probes' part of :func:`run_note`: each run's host, matmul and copy probe (ms, taken in
    its turn, ``bench.probe``), or an older row's host probe before and after its runs."""
    if row.get("probes"):
        parts = ["/".join(f"{p[k]:.2f}" if k in p else "—" for k in ("host_ms", "matmul_ms", "copy_ms"))
                 for p in row["probes"]]
        what = f"probes host/matmul/copy ms, each run in its turn: {', '.join(parts)}"
    elif row.get("host_probe_ms"):
        what = f"host probe {row['host_probe_ms'][0]:.2f}/{row['host_probe_ms'][1]:.2f} ms before/after"
    else:
        return ""
    return f"; {what}, load {row['loadavg'][0]:.1f}"


def run_note(label: str, row: dict[str, Any], took_s: float) -> str:
    """The notes' line of a finished engine: its runs, start-up, steps, host probe and release counters."""
    runs_s = row.get("elapsed_runs_s", [])
    c = row["counters"]
    return (f"{label}: generate {row['elapsed_s']:.1f} s"
            + (f" (median of {'/'.join(f'{r:.1f}' for r in runs_s)} s)" if len(runs_s) > 1 else "")
            + f", engine start-up {row['startup_s']:.0f} s, warm-up {row['warmup_s']:.1f} s, subprocess {took_s:.0f} s"
            + (f"; {row['steps']} steps, step P50/P90/max {row['step_ms_p50']:.1f}/{row['step_ms_p90']:.1f}/"
               f"{row['step_ms_max']:.1f} ms" if row.get("steps") else "")
            + graphs_note(row)
            + probe_note(row)
            + ("" if c is None else
               f"; {c['skipped_forwards']}/{c['decode_forwards']} decode forwards skipped (planned "
               f"{row['planned_skip']:.3f}), {c['released_requests']} requests released, decision "
               f"{c['decision_ms_mean']:.2f} ms/step"))


def graphs_note(row: dict[str, Any]) -> str:
    """How many of the row's scheduled steps had more tokens than its largest CUDA graph, and their
    mean step time against the others' (:class:`benchmarks.serving.bench.SlotStats`); empty where
    the row has no such count."""
    if row.get("steps_past_graphs") is None:
        return ""
    ms = [row.get("step_ms_past_graphs"), row.get("step_ms_within_graphs")]
    times = ", {} ms each against {} ms".format(*(f"{x:.1f}" for x in ms)) if None not in ms else ""
    model = f"; model {row['model_steps_past_graphs']}" if row.get("model_steps_past_graphs") is not None else ""
    return (f"; {row['steps_past_graphs']}/{row['slot_steps']} steps past the largest CUDA graph "
            f"({row['graph_tokens']} tokens{model}){times}")


RATIOS = [("both", m) for m in ("gridtrim", "steptrim", "stock", "stockfix", "nolora")] + [("gridtrim", "stock")]


def round_notes(n: int, engines: Sequence[interleave.Engine], orders: Sequence[Sequence[str]]) -> list[str]:
    """Interleaved runs: each round's order and run times, then, per vLLM line, both's speed ratio
    to every other mode and gridtrim's to stock, and, where the run has several vLLM lines, each
    mode's speed on every later line over the first, round by round, with the median."""
    nth_run = {e.name: iter(e.runs) for e in engines}  # an engine's runs, in the rounds it ran
    lines = [f"N={n} round {r + 1}: " + (", ".join(f"{m} {next(nth_run[m]):.2f} s" for m in order) or "no engine ran")
             for r, order in enumerate(orders)]
    named = {(e.line, e.mode): e.name for e in engines}
    versions = list(dict.fromkeys(e.line for e in engines))

    def add(what: str, name: str, other: str) -> None:
        if ratios := interleave.round_ratios(engines, name, other):
            lines.append(f"N={n} {what} round by round: {', '.join(f'{x:.3f}' for x in ratios)} "
                         f"(median {float(np.median(ratios)):.3f})")

    for line in versions:
        tag = "" if line is None else f" (vLLM {line})"
        for a, b in RATIOS:
            if (line, a) in named and (line, b) in named:
                add(f"{a}/{b}{tag}", named[line, a], named[line, b])
    for line in versions[1:]:  # each mode's speed on a later vLLM over the first one's
        for mode in dict.fromkeys(e.mode for e in engines):
            if (line, mode) in named and (versions[0], mode) in named:
                add(f"{mode} vLLM {line}/{versions[0]}", named[line, mode], named[versions[0], mode])
    return lines


def settings_tag(r: dict[str, Any]) -> str:
    """What the row's vLLM settings change from vLLM's defaults (a row names its settings; the
    harness refuses to append rows of other settings to a table, so a row without them is the
    table's, the defaults)."""
    return VllmSettings(**r.get("settings", {})).tag


def mode_label(r: dict[str, Any]) -> str:
    """The row's mode as the table names it, with what its vLLM settings change from the defaults and,
    in a table of several vLLM installs, its vLLM version."""
    tag = settings_tag(r)
    return MODE_LABEL[r["mode"]] + (f" {tag}" if tag else "") + vllm_tag(r)


def vllm_tag(r: dict[str, Any]) -> str:
    """`` (vLLM 0.34.0)`` for a row of a table of several vLLM installs; empty otherwise."""
    return f" (vLLM {r['vllm']})" if r.get("vllm") else ""


def format_row(r: dict[str, Any], stock: dict[str, Any] | None, latency: bool = False) -> str:
    traffic = "skewed 80/20" if r["skewed"] else "uniform"
    if r.get("pass", 0):
        traffic += f", pass {r['pass'] + 1}"
    width = 7 if latency else 3  # empty cells after the error
    if "error" in r:
        return f"| {r['adapters']} | {traffic} | {mode_label(r)} | {r['error']} |" + " |" * width
    skip = "—" if r["counters"] is None else f"{r['counters']['realized_skip']:.3f}"
    ok = stock is not None and "error" not in stock
    if latency:
        ratio = "1.00" if r["mode"] == "stock" else (f"{stock['tpot_p50_ms'] / r['tpot_p50_ms']:.2f}" if ok else "—")
        lat = " | ".join(f"{r[k]:.1f}" for k in ("ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms"))
        return (f"| {r['adapters']} | {traffic} | {mode_label(r)} | {r['req_per_s']:.1f} | "
                f"{r['output_tok_per_s']:.0f} | {lat} | {skip} | {ratio} |")
    ratio = "1.00" if r["mode"] == "stock" else (f"{r['req_per_s'] / stock['req_per_s']:.2f}" if ok else "—")
    return (f"| {r['adapters']} | {traffic} | {mode_label(r)} | {r['req_per_s']:.1f} | "
            f"{r['output_tok_per_s']:.0f} | {skip} | {ratio} |")


def render(preamble: list[str], rows: list[dict[str, Any]], notes: list[str], latency: bool = False) -> str:
    def key(r: dict[str, Any]) -> tuple:  # a row's ratio is to the stock row of its own settings and vLLM too
        return r["adapters"], r["skewed"], r.get("pass", 0), settings_tag(r), r.get("vllm")

    stock = {key(r): r for r in rows if r["mode"] == "stock"}
    header = LATENCY_HEADER if latency else HEADER
    lines = preamble + ["", header, "|" + "---|" * header.count(" | ") + "---|"]
    lines += [format_row(r, stock.get(key(r)), latency) for r in rows]
    return "\n".join(lines + [""] + notes) + "\n"


SLOT_HEADER = ("| adapters | traffic | mode | max_loras | req/s | steps | mean running | mean slots held | "
               "model: steps | model: mean running | model: mean slots held | model: slot loads | "
               "model: forwards with adapter |")


def slot_table(rows: list[dict[str, Any]]) -> str:
    """Slot statistics of the rows that have them (:class:`benchmarks.serving.bench.SlotStats`) beside
    the capacity model's prediction (:func:`benchmarks.serving.bench.predicted_slots`; rows measured
    before it counted slot loads show —); empty when none has."""
    have = [r for r in rows if "slot_steps" in r]
    if not have:
        return ""
    lines = ["", SLOT_HEADER, "|" + "---|" * SLOT_HEADER.count(" | ") + "---|"]
    for r in have:
        traffic = "skewed 80/20" if r["skewed"] else "uniform"
        lines.append(f"| {r['adapters']} | {traffic} | {r['mode']}{vllm_tag(r)} | {r['max_loras']} | {r['req_per_s']:.1f} | "
                     f"{r['slot_steps']} | {r['mean_running']:.1f} | {r['mean_slots_held']:.1f} | "
                     f"{r['model_steps']} | {r['model_mean_running']:.1f} | {r['model_mean_slots_held']:.1f} | "
                     f"{r.get('model_slot_loads', '—')} | "
                     + (f"{r['model_lora_share']:.1%} |" if "model_lora_share" in r else "— |"))
    return "\n".join(lines) + "\n"
