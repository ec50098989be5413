"""Slot hand-back changes no request's tokens beyond numerical near-ties. Needs a GPU and a supported vLLM.

    python -m benchmarks.serving.check_slots --out DIR [--requests 320] [--budget-s 240] [--parallel 3]
        [--invariance [PAIR ...]] [--engines [ENGINE ...]] [--lora-kernels vllm|gridtrim]
        [--weights random|dummy]

(with the plugin visible to vLLM: ``pip install -e ".[vllm]"``, or ``source scripts/env.sh``)

A small Llama (SmolLM2-135M-like shape, 8 layers, random weights at a trained model's scale, or
vLLM's dummy weights) serves 48 random rank-8 adapters with ``max_loras`` = 8, so slots are the
bottleneck. Each adapter is served under four names: plain (full LoRA, the stock engine), ``-off``
(policy none), ``-prof`` (profiled k) and ``-learn`` (random learned heads: one third release at
t = 0, one third never, one third where wᵀh < 0). Three engines, each in its own process, side by
side on the GPU (``--parallel``; each with a fixed KV cache and a vLLM compile cache of its own):

- ``stock``: plain vLLM (no ``LORAZOR_*``), the plain names;
- ``slots``: the bridge with slot hand-back (``LORAZOR_SLOTS`` unset: on), -off, -prof, -learn;
- ``keep``: the bridge with ``LORAZOR_SLOTS=0`` (vLLM's slot accounting), -prof, -learn.

Checks (:data:`N_CHECKS` rows): (a) policy off ≡ stock, token for token (the same schedule:
nothing releases); (b) profiled and (c) learned: every request's tokens with hand-back equal those
without up to a near-tie (:func:`divergence`), and release points are equal wherever the tokens
before them agree, for (c) up to a near-tie of the decision itself (:func:`decision_ties`: at the
earlier release both runs' head scores lie within :data:`DECISION_TIE` of τ; the tokens may then
differ far from the next token on, where one run has dropped the adapter); (d) hand-back happened: some step scheduled more distinct adapters than
max_loras, no step had more than max_loras holding a slot, and it took fewer steps; (e) without
hand-back no step scheduled more than max_loras adapters; (g) the near-tie test sees an adapter:
requests that drop theirs at t = 0 differ far from full LoRA.

Why near-ties: hand-back changes which requests share a batch, and a request's logits then differ
in the last bits even under ``VLLM_BATCH_INVARIANT=1``, which every engine sets. Measured on one
H200 with random weights (2026-12-02), stock vLLM without LoRA at ``max_num_seqs`` 128 vs 16 gives
298/320 identical requests on 0.26.0 and 306/320 on 0.33.0. With dummy weights, 0.26.0 was
identical on 320/320 with LoRA too, because a dummy model's next token barely depends on
its context. A last-bit difference can flip only a greedy choice between near-equal
logits. So each run's token at the first difference must be among the other run's
TOP_LOGPROBS most likely (vLLM's own tests compare models this way). A wrong or missing adapter
is "far". ``--invariance`` measures what a batch change alone does in stock vLLM, (f), in named
pairs (:data:`INVARIANCE_PAIRS`) that differ in ``max_num_seqs`` and hold one thing fixed each:
CUDA graphs or eager, LoRA, LoRA enabled but no adapter requested, the backbone alone, the V1
runner (on the lines that still ship it: not 0.34), a slot for every adapter, prompts prefilled whole. ``--lora-kernels gridtrim`` runs every
engine on the plugin's LoRA kernels.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from importlib.metadata import entry_points
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from benchmarks.serving.bench import SlotStats, expected_scheduler
from benchmarks.serving.placement import compile_cache
from benchmarks.serving.synthetic import write_model_config, write_random_adapters, write_random_weights
from serve_bridge.command_line import Parser, number
from serve_bridge.vllm.versions import has_v1_runner, runner_environment

MODEL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
         "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 9, "num_key_value_heads": 3,
         "head_dim": 64, "vocab_size": 49152, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
         "rope_theta": 100000.0, "hidden_act": "silu", "tie_word_embeddings": True, "torch_dtype": "bfloat16",
         "bos_token_id": 1, "eos_token_id": 2}
N_ADAPTERS, MAX_LORAS, RANK, ALPHA = 48, 8, 8, 16
N_CHECKS = 13  # the rows of compare() other than the (f) pairs
TOP_LOGPROBS = 5  # each generated position's most likely tokens, kept for the near-tie test
PROFILED_K = [0, 1, 2, 4, 8, 16]
# Engines that share one GPU: a fixed KV cache instead of a share of the GPU, and only a tenth of it free
# at start-up (docs/vllm_integration.md §13). check_slots' engines and every GPU test's use it, so the
# files of tests/gpu run side by side (scripts/gpu_tests.sh) and each run sizes its cache alike.
ENGINE_MEMORY = {"gpu_memory_utilization": 0.1, "kv_cache_memory_bytes": 4 << 30}
# vLLM's defaults (torch.compile and its CUDA-graph mode, async scheduling, prefix caching) with the
# workload's batch limits
ENGINE = dict(load_format="dummy", skip_tokenizer_init=True, enable_lora=True, max_loras=MAX_LORAS,
              max_lora_rank=RANK, max_cpu_loras=4 * N_ADAPTERS, max_num_seqs=128, max_num_batched_tokens=512,
              max_model_len=1024, dtype="bfloat16", **ENGINE_MEMORY)
LEARNED_LAG = 1  # the learned heads' decision lag, as calibration exports it
ENGINES = {"stock": ("full",), "slots": ("off", "prof", "learn"), "keep": ("prof", "learn")}
EAGER = {"mode": 0, "cudagraph_mode": "NONE"}
# --invariance: stock vLLM under other batch limits, graphs, LoRA settings and runners (engine option
# overrides; "adapters": False requests no adapter from a LoRA-enabled engine; "env": environment
# overrides); each (f) pair differs in max_num_seqs alone, the precondition of (b) and (c)
VARIANTS: dict[str, dict[str, Any]] = {
    "stock16": {"max_num_seqs": 16},
    "eager": {"compilation_config": EAGER}, "eager16": {"compilation_config": EAGER, "max_num_seqs": 16},
    "idle": {"adapters": False}, "idle16": {"adapters": False, "max_num_seqs": 16},
    "base": {"enable_lora": False}, "base16": {"enable_lora": False, "max_num_seqs": 16},
    "v1": {"env": {"VLLM_USE_V2_MODEL_RUNNER": "0"}},
    "v1_16": {"env": {"VLLM_USE_V2_MODEL_RUNNER": "0"}, "max_num_seqs": 16},
    "wide": {"max_loras": N_ADAPTERS}, "wide16": {"max_loras": N_ADAPTERS, "max_num_seqs": 16},
    "whole": {"enable_chunked_prefill": False, "max_num_batched_tokens": 4096},
    "whole16": {"enable_chunked_prefill": False, "max_num_batched_tokens": 4096, "max_num_seqs": 16},
}
STOCK_ENGINES = ("stock", *VARIANTS)  # stock vLLM: no bundle, no LoRazor read-outs
# name: (engine, the same with max_num_seqs 16, what the pair holds fixed)
INVARIANCE_PAIRS = {
    "lora": ("stock", "stock16", "CUDA graphs, LoRA"),
    "eager": ("eager", "eager16", "eager, LoRA"),
    "idle": ("idle", "idle16", "CUDA graphs, LoRA enabled, no adapter requested"),
    "base": ("base", "base16", "CUDA graphs, no LoRA"),
    "v1": ("v1", "v1_16", "CUDA graphs, LoRA, the V1 model runner"),
    "wide": ("wide", "wide16", "CUDA graphs, LoRA, a slot for every adapter (max_loras 48)"),
    "whole": ("whole", "whole16", "CUDA graphs, LoRA, every prompt prefilled whole (no chunked prefill)"),
}


def name(a: int, family: str) -> str:
    return f"a{a:02d}" if family == "full" else f"a{a:02d}-{family}"


def learned_bias(a: int) -> float:
    return (-1e4, 1e4, 0.0)[a % 3]  # releases at t = 0, never, where wᵀh < 0


def prepare(work: Path, n_requests: int, weights: str = "dummy") -> None:
    """Model config, adapters, the bundle (three name families) and the request set; with
    ``weights="random"`` also the backbone's random checkpoint (:func:`write_random_weights`)."""
    import numpy as np

    from serve_bridge.bundle import AdapterEntry, write_bundle

    if weights == "random" and not (work / "model" / "model.safetensors").exists():
        write_random_weights(work, MODEL)
    if (work / "requests.json").exists():
        return
    write_model_config(work, MODEL)
    fps = write_random_adapters(work, MODEL, N_ADAPTERS, RANK, ALPHA, lambda a: name(a, "full"))
    rng = np.random.default_rng(0)
    entries = []
    for a in range(N_ADAPTERS):
        w = (rng.standard_normal(MODEL["hidden_size"]) / MODEL["hidden_size"] ** 0.5).astype(np.float32)
        entries += [AdapterEntry(name(a, "off"), fps[a], "none"),
                    AdapterEntry(name(a, "prof"), fps[a], "profiled", k=PROFILED_K[a % len(PROFILED_K)]),
                    AdapterEntry(name(a, "learn"), fps[a], "learned", tau=0.0, weight=w, bias=learned_bias(a),
                                 lag=LEARNED_LAG)]
    write_bundle(work / "bundle", backbone="tiny-llama-dummy", hidden_size=MODEL["hidden_size"],
                 config_fingerprint="0" * 64, adapters=entries)
    rnd = random.Random(0)
    requests = [{"adapter": i % N_ADAPTERS, "max_tokens": rnd.randint(4, 64),
                 "prompt": [rnd.randrange(3, MODEL["vocab_size"]) for _ in range(rnd.randint(8, 200))]}
                for i in range(n_requests)]
    (work / "requests.json").write_text(json.dumps(requests))


def engine_env(engine: str, work: Path, environ: dict[str, str], gridtrim: bool = False) -> dict[str, str]:
    """The engine's environment: batch-invariant kernels, engine core in-process (for the
    read-outs), and the bridge's variables per engine (module doc); ``gridtrim``: every engine,
    stock and its variants included, runs the plugin's LoRA kernels (``LORAZOR_GRIDTRIM=1``)."""
    env = {k: v for k, v in environ.items() if not k.startswith("LORAZOR_")}
    env |= {"VLLM_BATCH_INVARIANT": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"} | runner_environment()
    if gridtrim:
        env["LORAZOR_GRIDTRIM"] = "1"
    if engine not in STOCK_ENGINES:
        env["LORAZOR_BUNDLE"] = str(work / "bundle")
        env["LORAZOR_LOG_INTERVAL_S"] = "0"
    if engine == "keep":
        env["LORAZOR_SLOTS"] = "0"
    return env | VARIANTS.get(engine, {}).get("env", {})


def serve(engine: str, work: Path, out: Path, weights: str = "dummy") -> None:
    """Run one engine's families; write tokens, release records and slot statistics."""
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    requests = json.loads((work / "requests.json").read_text())
    t0 = time.time()
    options = ENGINE | {k: v for k, v in VARIANTS.get(engine, {}).items() if k != "env"}
    if weights == "random":
        options["load_format"] = "safetensors"
    adapters = options.pop("adapters", True) and options["enable_lora"]
    if not options["enable_lora"]:
        options = {k: v for k, v in options.items() if not k.startswith(("max_lora", "max_cpu_lora"))}
    llm = LLM(model=str(work / "model"), **options)
    if engine not in STOCK_ENGINES:
        from serve_bridge.vllm.rpc import lorazor_record_margins

        llm.collective_rpc(lorazor_record_margins)
    stats = SlotStats.attach(llm)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler  # v1/core/sched/scheduler.py:98-99 (0.33, 0.34)
    result: dict[str, Any] = {"startup_s": time.time() - t0,
                              "scheduler": type(scheduler).__name__,
                              "async_scheduling": scheduler.scheduler_config.async_scheduling}
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True, detokenize=False,
                             logprobs=TOP_LOGPROBS) for r in requests]
    for i, family in enumerate(ENGINES.get(engine, ENGINES["stock"])):
        loras = [LoRARequest(name(r["adapter"], family), 1000 * i + r["adapter"] + 1,
                             str(work / "adapters" / name(r["adapter"], "full"))) if adapters else None
                 for r in requests]
        stats.start()
        t = time.time()
        outs = llm.generate([{"prompt_token_ids": r["prompt"]} for r in requests], params, lora_request=loras,
                            use_tqdm=False)
        part: dict[str, Any] = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
                                "top": [[sorted(step, key=lambda tok: -step[tok].logprob)[:TOP_LOGPROBS]
                                         for step in o.outputs[0].logprobs or []] for o in outs],
                                "seconds": time.time() - t, **stats.summary()}
        if engine not in STOCK_ENGINES:
            from serve_bridge.vllm.rpc import lorazor_requests

            index = {o.request_id: j for j, o in enumerate(outs)}
            releases: list[int | None] = [None] * len(requests)
            margins: list[list[list[float]]] = [[] for _ in requests]
            for rec in llm.collective_rpc(lorazor_requests, kwargs={"clear": True})[0]:
                j = index.get(rec["req_id"].rsplit("-", 1)[0])  # internal id = external id + "-" + suffix
                if j is not None:
                    releases[j], margins[j] = rec["release"], rec["margins"]
            part["releases"], part["margins"] = releases, margins
        result[family] = part
    (out / f"{engine}.json").write_text(json.dumps(result))


DECISION_TIE = 0.05  # |s_t − τ| in both runs within which a learned decision may flip; the heads' s ~ N(0, 1)


def decision_ties(on: dict[str, Any], keep: dict[str, Any], rows: list[int]) -> dict[int, int]:
    """Request → first token that the tie may change, for the ``rows`` whose release points differ
    at a near-tie of the decision: at the decision t of the earlier release r = t + LEARNED_LAG both
    runs recorded the head's margin s_t − τ (``margins``: [[t, m], ...] per request) and both lie
    within DECISION_TIE of τ, so a last-bit difference of h_t decides it; tokens from r + 1 on run
    with or without the adapter."""
    out = {}
    for i in rows:
        if on["releases"][i] != keep["releases"][i]:
            t, margins = margins_at_release(on, keep, i)
            if all(m is not None and abs(m) <= DECISION_TIE for m in margins):
                out[i] = t + LEARNED_LAG + 1
    return out


def margins_at_release(on: dict[str, Any], keep: dict[str, Any], i: int) -> tuple[int | None, list[float | None]]:
    """The decision t of request ``i``'s earlier release r = t + LEARNED_LAG of the two runs (None:
    neither released) and each run's recorded margin s_t − τ there (None where that run recorded
    none at t)."""
    r = min((x for x in (on["releases"][i], keep["releases"][i]) if x is not None), default=None)
    t = None if r is None else r - LEARNED_LAG
    return t, [dict(map(tuple, run["margins"][i])).get(t) if run.get("margins") else None for run in (on, keep)]


def _margins_text(t: int | None, margins: list[float | None]) -> str:
    return " / ".join("—" if m is None else f"{m:+.3f}" for m in margins) + f" at t = {t}"


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def divergence(a: dict[str, Any], b: dict[str, Any], i: int) -> tuple[str, int]:
    """How request ``i``'s greedy generations in two runs compare (each run: ``tokens`` and ``top``,
    its TOP_LOGPROBS most likely tokens per position): ("identical", length); ("near-tie", j) when
    they first differ at j and each run's token there is among the other's most likely, a flip
    that a last-bit difference in the logits can cause; ("far", j) otherwise, what a wrong or
    missing adapter causes. Only the first difference is judged: after it the inputs differ."""
    x, y = a["tokens"][i], b["tokens"][i]
    j = first_difference(x, y)
    if j == len(x) == len(y):
        return "identical", j
    tx, ty = (run.get("top", [])[i] if len(run.get("top", [])) > i else [] for run in (a, b))
    near = j < min(len(x), len(y), len(tx), len(ty)) and x[j] in ty[j] and y[j] in tx[j]
    return ("near-tie" if near else "far"), j


def divergences(a: dict[str, Any], b: dict[str, Any], rows: range | list[int],
                 note: Any = None, ties: dict[int, int] | None = None) -> tuple[dict[str, int], str]:
    """Counts of each :func:`divergence` kind over ``rows`` and a detail string (the first far
    differences, else the first near-ties; ``note(i)`` adds to each example). A far difference of a
    request in ``ties`` (:func:`decision_ties`) from its token on counts as "after a decision tie"."""
    kinds = {i: divergence(a, b, i) for i in rows}
    for i, start in (ties or {}).items():
        if i in kinds and kinds[i][0] == "far" and kinds[i][1] >= start:
            kinds[i] = ("after a decision tie", kinds[i][1])
    counts = {k: sum(kind == k for kind, _ in kinds.values())
              for k in ("identical", "near-tie", "far", "after a decision tie")}
    shown = [i for i, (kind, _) in kinds.items() if kind == "far"] or \
            [i for i, (kind, _) in kinds.items() if kind == "near-tie"]
    examples = [f"req {i}: {kinds[i][0]} at token {kinds[i][1]}" + (note(i) if note else "") for i in shown[:3]]
    detail = f"{counts['identical']}/{len(kinds)} identical, {counts['near-tie']} near-tie, {counts['far']} far"
    if counts["after a decision tie"]:
        detail += f", {counts['after a decision tie']} far after a decision near-tie"
    return counts, detail + (f" ({'; '.join(examples)})" if examples else "")


def comparable_releases(on: dict[str, Any], keep: dict[str, Any], n: int) -> list[int]:
    """Requests whose release decisions saw the same tokens in both runs: their generations agree
    up to the earlier release point (a request decides after each forward t from the tokens before
    t; never released counts as the end)."""
    out = []
    for i in range(n):
        ends = [len(on["tokens"][i]) if r is None else r for r in (on["releases"][i], keep["releases"][i])]
        if first_difference(on["tokens"][i], keep["tokens"][i]) >= min(ends):
            out.append(i)
    return out


def compare(out: Path, requests: list[dict[str, Any]]) -> list[tuple[str, bool, str]]:
    """The checks of the module doc, as (name, passed, detail)."""
    res = {e: json.loads((out / f"{e}.json").read_text()) for e in (*ENGINES, *VARIANTS)
           if (out / f"{e}.json").exists()}
    rows: list[tuple[str, bool, str]] = []
    n = len(requests)
    # LoRazor's wherever a bundle is served (keep: LORAZOR_SLOTS=0 switches hand-back off inside it)
    want = {e: expected_scheduler(e != "stock", res[e]["async_scheduling"]) for e in ENGINES if e in res}
    found = {e: r["scheduler"] for e, r in res.items()}
    rows.append(("engines run the expected schedulers", all(found.get(e) == s for e, s in want.items()),
                 json.dumps(found)))
    if "stock" in res and "slots" in res:
        full, off = res["stock"]["full"]["tokens"], res["slots"]["off"]["tokens"]
        same = sum(a == b for a, b in zip(full, off))
        rows.append(("(a) policy off ≡ stock, token for token", same == n, f"{same}/{n} identical"))
        rows.append(("(a) policy off never releases", all(r is None for r in res["slots"]["off"]["releases"]),
                     f"{sum(r is not None for r in res['slots']['off']['releases'])} released"))
        lengths = [len(t) for t in full]
        rows.append(("output lengths = max_tokens", lengths == [r["max_tokens"] for r in requests],
                     f"{sum(lengths)} tokens"))
        # the near-tie test can see an adapter: requests released at t = 0 run without it from
        # their second token on, so they must differ far from full LoRA
        dropped = [i for i, r in enumerate(requests) if learned_bias(r["adapter"]) < 0 and r["max_tokens"] > 1]
        counts, detail = divergences(res["stock"]["full"], res["slots"]["learn"], dropped)
        rows.append(("(g) dropping the adapter is far, not a near-tie (learned release at t = 0 vs full LoRA)",
                     bool(dropped) and counts["far"] >= 0.9 * len(dropped), detail))
    for big, small, what in INVARIANCE_PAIRS.values():  # not among the checks: what a batch change alone does
        if big in res and small in res:
            counts, detail = divergences(res[big]["full"], res[small]["full"], range(n))
            rows.append((f"(f) stock vLLM's batch dependence is near-ties only, {what} (max_num_seqs 128 vs 16)",
                         counts["far"] == 0, detail))
    if "slots" in res and "keep" in res:
        for tag, fam in (("(b) profiled", "prof"), ("(c) learned", "learn")):
            on, keep = res["slots"][fam], res["keep"][fam]
            same_inputs = comparable_releases(on, keep, n)
            ties = decision_ties(on, keep, same_inputs)
            counts, detail = divergences(on, keep, range(n), lambda i: f", release {keep['releases'][i]}", ties)
            rows.append((f"{tag}: tokens with hand-back ≡ without, up to near-ties", counts["far"] == 0, detail))
            released = sum(r is not None for r in keep["releases"])
            equal = sum(on["releases"][i] == keep["releases"][i] for i in same_inputs)
            tied = f", {len(ties)} at a decision near-tie (|s − τ| ≤ {DECISION_TIE} in both runs)" if ties else ""
            odd = [i for i in same_inputs if on["releases"][i] != keep["releases"][i] and i not in ties]
            shown = "; ".join(f"req {i}: release {on['releases'][i]} vs {keep['releases'][i]}, margins "
                              f"{_margins_text(*margins_at_release(on, keep, i))}" for i in odd[:3])
            rows.append((f"{tag}: release points with hand-back ≡ without, where the tokens before them agree",
                         equal + len(ties) == len(same_inputs) and released > 0,
                         f"{equal}/{len(same_inputs)} equal{tied} ({n - len(same_inputs)} diverged earlier); "
                         f"{released} released" + (f" ({shown})" if shown else "")))
            rows.append((f"{tag} (d): slots handed on", on["max_adapters_scheduled"] > MAX_LORAS
                         and on["max_slots_held"] <= MAX_LORAS and on["slot_steps"] < keep["slot_steps"],
                         f"max {on['max_adapters_scheduled']} adapters in a step, {on['max_slots_held']} holding "
                         f"slots (max_loras {MAX_LORAS}); {on['slot_steps']} vs {keep['slot_steps']} steps"))
            rows.append((f"{tag} (e): without hand-back ≤ max_loras adapters per step",
                         keep["max_adapters_scheduled"] <= MAX_LORAS, f"max {keep['max_adapters_scheduled']}"))
    return rows


def table(rows: list[tuple[str, bool, str]]) -> str:
    lines = ["| check | result | detail |", "|---|---|---|"]
    lines += [f"| {n} | {'PASS' if ok else 'FAIL'} | {d} |" for n, ok, d in rows]
    return "\n".join(lines)


def tally(rows: list[tuple[str, bool, str]]) -> tuple[str, bool]:
    """``"P/N checks pass"`` over the :data:`N_CHECKS` checks (the (f) pairs apart), with how many
    failed or were not reached (an engine that did not finish leaves its checks out); and whether
    all N passed."""
    checks = [ok for n, ok, _ in rows if not n.startswith("(f)")]
    passed, missing = sum(checks), N_CHECKS - len(checks)
    text = f"{passed}/{N_CHECKS} checks pass" + "".join(
        f", {k} {what}" for k, what in ((len(checks) - passed, "failed"), (missing, "not reached")) if k)
    return text, passed == N_CHECKS and not missing


def engine_order(engines: list[str], pairs: list[str] | None, v1_runner: bool = True) -> list[str]:
    """The engines to run, in order: ``engines`` (of :data:`ENGINES`), then the invariance pairs'
    (``pairs``: [] means every pair the installed vLLM can run, the V1 runner's only with
    ``v1_runner``; None none) that are not among them."""
    chosen = [e for e in ENGINES if e in engines]
    every = [pair for pair in INVARIANCE_PAIRS if v1_runner or pair != "v1"]
    for pair in (every if pairs == [] else pairs or []):
        chosen += [e for e in INVARIANCE_PAIRS[pair][:2] if e not in chosen]
    return chosen


def run_engines(engines: list[str], launch: Callable[[str, IO[str]], subprocess.Popen], out: Path, deadline: float,
                parallel: int, min_left_s: float = 20) -> list[str]:
    """Run ``engines`` in order, at most ``parallel`` at a time (they share the GPU through fixed KV
    caches, :data:`ENGINE_MEMORY`; each compiles into a vLLM cache of its own), each logging to
    ``out/<engine>.log``; an engine is started only with ``min_left_s`` left before ``deadline``
    (time.time()) and killed at it. Returns one note per engine: its exit code or ``timeout`` and
    when it ended, or why it was not run. An engine's earlier result file is removed before it
    starts, so a failed engine is compared as missing."""
    t0, notes, running = time.time(), {}, {}
    waiting = list(engines)

    def reap(engine: str, rc: int | str) -> None:
        proc, log = running.pop(engine)
        log.close()
        notes[engine] = f"{engine}: rc {rc}, {time.time() - t0:.0f} s since start"

    while waiting or running:
        while waiting and len(running) < parallel:
            engine = waiting.pop(0)
            if deadline - time.time() < min_left_s:
                notes[engine] = f"{engine}: not run, {max(deadline - time.time(), 0):.0f} s left"
                continue
            (out / f"{engine}.json").unlink(missing_ok=True)
            log = open(out / f"{engine}.log", "w")
            running[engine] = (launch(engine, log), log)
        for engine, (proc, _) in list(running.items()):
            if (rc := proc.poll()) is not None:
                reap(engine, rc)
            elif time.time() >= deadline:
                proc.kill()
                proc.wait()
                reap(engine, "timeout")
        if running:
            time.sleep(0.2)
    return [notes[e] for e in engines]


def main(argv: list[str] | None = None) -> int:
    ap = Parser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/lorazor_check_slots"))
    ap.add_argument("--requests", type=number("positive_int"), default=320)
    ap.add_argument("--budget-s", type=number("positive_number"), default=240,
                    help="seconds from the start: no engine starts in its last 20, none runs past it")
    ap.add_argument("--parallel", type=number("positive_int"), default=3,
                    help="engines at once on the GPU (default 3: stock, slots and keep together)")
    ap.add_argument("--invariance", nargs="*", choices=sorted(INVARIANCE_PAIRS), metavar="PAIR",
                    help="also check (f) on stock vLLM: each named pair (default: all of "
                         f"{', '.join(INVARIANCE_PAIRS)}) runs an engine with max_num_seqs 128 and 16")
    ap.add_argument("--lora-kernels", choices=["vllm", "gridtrim"], default="vllm",
                    help="every engine's LoRA kernels: vLLM's (default) or the plugin's GridTrim kernels, whose "
                         "batch invariance (f) measures with --invariance; 'stock' is then the plugin without release")
    ap.add_argument("--weights", choices=["random", "dummy"], default="random",
                    help="the backbone's weights: random at a trained model's scale (default: std 0.02, unit norms, "
                         "so its numerics matter as in a real model) or vLLM's dummy ones (±1e-3)")
    ap.add_argument("--engines", nargs="*", choices=sorted(ENGINES), default=sorted(ENGINES),
                    help="the engines to run (default all; the checks need all three; none: only --invariance)")
    ap.add_argument("--engine", choices=sorted(ENGINES | VARIANTS), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.engine:
        serve(args.engine, args.work, args.out, args.weights)
        return 0
    if not any(ep.name == "lorazor" for ep in entry_points(group="vllm.general_plugins")):
        print("check_slots: vLLM would not load the LoRazor plugin in its engines (no 'lorazor' vllm.general_plugins "
              "entry point): pip install -e '.[vllm]', or source scripts/env.sh first", file=sys.stderr)
        return 2
    v1_runner = has_v1_runner()
    if "v1" in (args.invariance or []) and not v1_runner:
        print("check_slots: --invariance v1 needs vLLM's V1 model runner, which the installed vLLM no longer has "
              "(0.34 removed it); name the other pairs", file=sys.stderr)
        return 2
    start = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    prepare(args.work, args.requests, args.weights)
    requests = json.loads((args.work / "requests.json").read_text())
    if len(requests) != args.requests:
        print(f"{args.work}/requests.json holds {len(requests)} requests, not {args.requests}: remove {args.work}",
              file=sys.stderr)
        return 2
    def launch(engine: str, log: IO[str]) -> subprocess.Popen:
        env = engine_env(engine, args.work, dict(os.environ), gridtrim=args.lora_kernels == "gridtrim")
        return subprocess.Popen([sys.executable, "-m", "benchmarks.serving.check_slots", "--engine", engine,
                                 "--work", str(args.work), "--out", str(args.out), "--weights", args.weights],
                                env=env | compile_cache(args.work, engine), stdout=log, stderr=subprocess.STDOUT)

    engines = engine_order(args.engines, args.invariance, v1_runner)
    notes = run_engines(engines, launch, args.out, start + args.budget_s, args.parallel)
    rows = compare(args.out, requests)
    summary, passed = tally(rows)
    text = table(rows) + "\n\n" + "\n".join(notes) + f"\n\n{summary}\n"
    (args.out / "check_slots.md").write_text(text)
    print(text, flush=True)
    return 0 if passed and all(ok for _, ok, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
