"""Offline throughput: stock vLLM 0.26 vs vLLM with the LoRazor plugin, in one run (issue 7).

    python -m serve_bridge.bench --out DIR [--adapters 128 4] [--modes stock steptrim] [--skewed]

(``scripts/device_serve_bench.sh`` registers the plugin's entry point and runs this on the
GPU machine.) It serves a Llama-3.2-3B-shaped model with dummy weights and N random rank-8
peft adapters on q,k,v,o,gate,up,down. The workload follows the paper: 2048 requests with
prompts of 100–300 tokens and 20–100 output tokens (``ignore_eos``, per-request
``max_tokens``), spread uniformly over the adapters, or 80% of requests on 20% of them with
``--skewed``. StepTrim runs a P50-like profiled schedule: each adapter gets the k whose
release skips about half of its decode forwards, given its requests' output lengths
(:func:`serve_bridge.steptrim.skip_fraction`).

Every (adapters, mode) pair runs in its own subprocess, back to back on the same machine:

- ``stock``: ``LORAZOR_BUNDLE`` unset, so the plugin stays inactive (vLLM's own runner).
- ``steptrim``: the plugin with the profiled bundle; the realized skip comes from the
  plugin's counters over ``collective_rpc``. GridTrim's kernels are not integrated yet, so
  released rows still go through vLLM's stock LoRA kernels.

The first stock engine starts while the adapters are being written. Each engine serves one
short request per adapter (loading every adapter) before the timed ``generate`` of all
requests. The table is rewritten to ``OUT/bench.txt`` after every run, so a run cut short
still leaves the finished rows.

Workload generation (:func:`make_workload`) is pure and seeded, and is tested on CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from serve_bridge.steptrim import skip_fraction
from serve_bridge.synthetic import write_model_config, write_random_adapters

ROOT = Path(__file__).resolve().parents[1]

# Llama-3.2-3B's config.json with its llama3 rope scaling. transformers 5 folds rope_theta and
# rope_scaling into rope_parameters, and vLLM 0.26's llama loader hands those to get_rope
# (model_executor/models/llama.py:240-244; rope_type 'llama3' → Llama3RotaryEmbedding).
LLAMA32_3B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 3072, "intermediate_size": 8192,
    "num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001,
}
RANK, ALPHA = 8, 16
N_REQUESTS = 2048
PROMPT_LEN = (100, 300)  # inclusive
OUTPUT_LEN = (20, 100)  # inclusive
TARGET_SKIP = 0.5
HOT_ADAPTERS, HOT_TRAFFIC = 0.2, 0.8  # --skewed: 80% of requests on 20% of the adapters
# Decode batches replay CUDA graphs (no torch.compile), as in check_correctness.py; mixed
# prefill/decode steps run eagerly. Both modes use the same settings.
CAPTURE_SIZES = [1, 2, 4, 8, 16, 32, 64, 96, 128, 160, 192, 224, 256]
MODES = ("stock", "steptrim")
MODE_LABEL = {"stock": "stock", "steptrim": "steptrim (stock LoRA kernels; GridTrim not integrated)"}


# -- workload (pure) ------------------------------------------------------------------------

@dataclass(frozen=True)
class Workload:
    """One request set and its profiled release schedule.

    adapter[i], prompt[i], max_tokens[i]: request i's adapter index (0 … N−1), prompt token
    ids and output length. k[a]: adapter a's profiled release point. planned_skip: the skip
    fraction of decode forwards that k implies for these output lengths.
    """

    n_adapters: int
    skewed: bool
    adapter: list[int]
    prompt: list[list[int]]
    max_tokens: list[int]
    k: list[int]
    planned_skip: float

    def releases(self) -> list[int]:
        """Each request's release point r (its adapter's k)."""
        return [self.k[a] for a in self.adapter]


def hot_adapter_count(n_adapters: int) -> int:
    """Adapters in the hot set of skewed traffic: 20% of them, at least one, never all."""
    return min(max(1, round(HOT_ADAPTERS * n_adapters)), max(1, n_adapters - 1))


def assign_adapters(n_requests: int, n_adapters: int, skewed: bool, rng: np.random.Generator) -> list[int]:
    """Adapter index per request: uniform, or 80% of requests uniformly on the hot set
    (adapters 0 … hot−1) and the rest uniformly on the others."""
    if n_adapters < 1:
        raise ValueError(f"need at least one adapter, got {n_adapters}")
    if not skewed or n_adapters == 1:
        return rng.integers(0, n_adapters, n_requests).tolist()
    hot = hot_adapter_count(n_adapters)
    on_hot = rng.random(n_requests) < HOT_TRAFFIC
    return np.where(on_hot, rng.integers(0, hot, n_requests), rng.integers(hot, n_adapters, n_requests)).tolist()


def choose_k(lengths: Sequence[int], target: float = TARGET_SKIP) -> int:
    """The release point k whose skip fraction over these output lengths is nearest the
    target (the smaller k on a tie). Empty lengths → 0.

    The skip fraction does not grow with k, so a bisection finds the smallest k at or below
    the target; the answer is it or the k before it."""
    if not lengths:
        return 0

    def skip(k: int) -> float:
        return skip_fraction(lengths, [k] * len(lengths))

    lo, hi = 0, max(0, max(lengths) - 1)  # skip(hi) = 0
    while lo < hi:
        mid = (lo + hi) // 2
        if skip(mid) <= target:
            hi = mid
        else:
            lo = mid + 1
    if lo > 0 and abs(skip(lo - 1) - target) <= abs(skip(lo) - target):
        return lo - 1
    return lo


def profiled_ks(adapter: Sequence[int], lengths: Sequence[int], n_adapters: int,
                target: float = TARGET_SKIP) -> list[int]:
    """Per adapter, :func:`choose_k` over its own requests' output lengths (an adapter without
    requests gets the k of all lengths)."""
    by_adapter: list[list[int]] = [[] for _ in range(n_adapters)]
    for a, n in zip(adapter, lengths):
        by_adapter[a].append(n)
    fallback = choose_k(lengths, target)
    return [choose_k(ls, target) if ls else fallback for ls in by_adapter]


def make_workload(n_adapters: int, n_requests: int = N_REQUESTS, *, skewed: bool = False, seed: int = 0,
                  prompt_len: tuple[int, int] = PROMPT_LEN, output_len: tuple[int, int] = OUTPUT_LEN,
                  vocab_size: int = LLAMA32_3B["vocab_size"], target_skip: float = TARGET_SKIP) -> Workload:
    """The seeded request set. Prompts and output lengths depend on the seed only (not on the
    adapter count or traffic), so runs with different N serve the same requests."""
    rng = np.random.default_rng([seed, 0])
    plens = rng.integers(prompt_len[0], prompt_len[1] + 1, n_requests)
    lengths = rng.integers(output_len[0], output_len[1] + 1, n_requests).tolist()
    tokens = rng.integers(3, vocab_size, int(plens.sum())).tolist()
    starts = np.concatenate([[0], np.cumsum(plens)[:-1]]).tolist()
    prompts = [tokens[s:s + int(p)] for s, p in zip(starts, plens)]
    adapter = assign_adapters(n_requests, n_adapters, skewed, np.random.default_rng([seed, 1, int(skewed)]))
    ks = profiled_ks(adapter, lengths, n_adapters, target_skip)
    planned = skip_fraction(lengths, [ks[a] for a in adapter])
    return Workload(n_adapters, skewed, adapter, prompts, lengths, ks, planned)


# -- files: model config, adapters, bundles -------------------------------------------------------

def adapter_name(a: int) -> str:
    """Served name of adapter a (check_correctness.py's naming)."""
    return f"a{a:02d}"


def write_model_and_adapters(work: Path, n_adapters: int, cfg: dict[str, Any] = LLAMA32_3B) -> dict[str, str]:
    """``work/model/config.json`` and ``work/adapters/aNN``: random rank-8 peft adapters on
    q,k,v,o,gate,up,down of this model's shapes; returns adapter name → weights sha256."""
    write_model_config(work, cfg)
    fps = write_random_adapters(work, cfg, n_adapters, RANK, ALPHA, adapter_name)
    return {adapter_name(a): fp for a, fp in fps.items()}


def write_profiled_bundle(directory: Path, wl: Workload, fingerprints: dict[str, str],
                          cfg: dict[str, Any] = LLAMA32_3B) -> Path:
    """The workload's profiled schedule as a bundle for its N adapters."""
    from serve_bridge.bundle import AdapterEntry, config_fingerprint, write_bundle

    entries = [AdapterEntry(adapter_name(a), fingerprints[adapter_name(a)], "profiled", k=int(wl.k[a]),
                            stats={"rule": "profiled k: ~50% of decode forwards skipped on the bench lengths",
                                   "target_skip": TARGET_SKIP})
               for a in range(wl.n_adapters)]
    return write_bundle(directory, backbone="llama-3.2-3b-shape-dummy", hidden_size=cfg["hidden_size"],
                        config_fingerprint=config_fingerprint(cfg), adapters=entries)


def _tag(n: int, skewed: bool) -> str:
    return f"n{n}_{'skewed' if skewed else 'uniform'}"


def _prep_key(adapters: Sequence[int]) -> dict[str, Any]:
    return {"config": LLAMA32_3B, "rank": RANK, "adapters": max(adapters)}


def drop_stale_stamp(work: Path, adapters: Sequence[int]) -> None:
    """Remove ``work/prepared.json`` unless it was written for these adapters."""
    stamp = work / "prepared.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("key") != _prep_key(adapters):
        stamp.unlink()


def prepare(work: Path, adapters: Sequence[int], skewed: bool, n_requests: int, seed: int) -> None:
    """Adapters for max(adapters), a bundle per adapter count; ``work/prepared.json`` last.

    Adapters already written for the same model and adapter count (same stamp) are kept."""
    import shutil

    stamp = work / "prepared.json"
    drop_stale_stamp(work, adapters)
    if stamp.exists():
        fps = json.loads(stamp.read_text())["fingerprints"]
    else:
        for stale in ("adapters", "bundle", "bundle_bad", "bundles"):
            shutil.rmtree(work / stale, ignore_errors=True)
        fps = write_model_and_adapters(work, max(adapters))
    for n in adapters:
        wl = make_workload(n, n_requests, skewed=skewed, seed=seed)
        directory = work / "bundles" / f"{_tag(n, skewed)}_r{n_requests}_s{seed}"
        if not directory.exists():
            write_profiled_bundle(directory, wl, fps)
    stamp.write_text(json.dumps({"key": _prep_key(adapters), "fingerprints": fps}))


# -- one engine (subprocess) ----------------------------------------------------------------------

def engine_options(n_adapters: int, capture_sizes: Sequence[int] = CAPTURE_SIZES) -> dict[str, Any]:
    """The device README's engine options, with max_loras = N, and the decode CUDA graph sizes."""
    return dict(load_format="dummy", skip_tokenizer_init=True, enable_lora=True, max_loras=n_adapters,
                max_lora_rank=RANK, max_cpu_loras=256, max_num_seqs=256, max_num_batched_tokens=2048,
                enable_prefix_caching=False, async_scheduling=False, specialize_active_lora=True, dtype="bfloat16",
                compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                    "cudagraph_capture_sizes": list(capture_sizes)})


def _runner_name(worker: Any) -> str:
    return type(worker.model_runner).__name__


def _wait_prepared(work: Path, timeout_s: float = 900) -> None:
    start = time.time()
    while not (work / "prepared.json").exists():
        if (work / "prepare.failed").exists():
            raise RuntimeError(f"preparation failed: {(work / 'prepare.failed').read_text()[-2000:]}")
        if time.time() - start > timeout_s:
            raise TimeoutError(f"{work}/prepared.json did not appear within {timeout_s:.0f} s")
        time.sleep(0.2)


def run_engine(mode: str, n: int, skewed: bool, n_requests: int, seed: int, work: Path, result: Path,
               capture_sizes: Sequence[int] = CAPTURE_SIZES) -> None:
    """Start one engine, serve one warm-up request per adapter, time ``generate`` of the workload."""
    import torch
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    wl = make_workload(n, n_requests, skewed=skewed, seed=seed)
    t0 = time.time()
    llm = LLM(model=str(work / "model"), **engine_options(n, capture_sizes))
    startup = time.time() - t0
    runner = llm.collective_rpc(_runner_name)[0]
    want = "GPUModelRunner" if mode == "stock" else "LoRazorGPUModelRunner"
    if runner != want:
        raise RuntimeError(f"mode {mode}: the engine runs {runner}, expected {want}")
    waited = time.time()
    _wait_prepared(work)
    waited = time.time() - waited

    def lora(a: int) -> LoRARequest:
        return LoRARequest(adapter_name(a), a + 1, str(work / "adapters" / adapter_name(a)))

    t = time.time()
    llm.generate([{"prompt_token_ids": wl.prompt[a % n_requests][:16]} for a in range(n)],
                 [SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False) for _ in range(n)],
                 lora_request=[lora(a) for a in range(n)], use_tqdm=False)
    warmup = time.time() - t
    counters = None
    if mode == "steptrim":
        from serve_bridge.rpc import lorazor_counters

        before = llm.collective_rpc(lorazor_counters)[0]
    params = [SamplingParams(max_tokens=m, ignore_eos=True, detokenize=False) for m in wl.max_tokens]
    prompts = [{"prompt_token_ids": p} for p in wl.prompt]
    loras = [lora(a) for a in wl.adapter]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    elapsed = time.perf_counter() - t
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    if lengths != wl.max_tokens:
        bad = sum(a != b for a, b in zip(lengths, wl.max_tokens))
        raise RuntimeError(f"{bad} requests did not produce max_tokens tokens")
    if mode == "steptrim":
        after = llm.collective_rpc(lorazor_counters)[0]
        decode = after["decode_forwards"] - before["decode_forwards"]
        skipped = after["skipped_forwards"] - before["skipped_forwards"]
        counters = {"decode_forwards": decode, "skipped_forwards": skipped,
                    "released_requests": after["released_requests"] - before["released_requests"],
                    "realized_skip": skipped / decode if decode else 0.0,
                    "decision_ms_mean": after["decision_ms_mean"], "decision_steps": after["decision_steps"],
                    "mapping_ms_total": after["mapping_ms_total"]}
    out = {"mode": mode, "adapters": n, "skewed": skewed, "requests": n_requests, "seed": seed,
           "elapsed_s": elapsed, "req_per_s": n_requests / elapsed, "output_tokens": sum(lengths),
           "output_tok_per_s": sum(lengths) / elapsed, "planned_skip": wl.planned_skip,
           "k_min": min(wl.k), "k_max": max(wl.k), "startup_s": startup, "waited_for_prepare_s": waited,
           "warmup_s": warmup, "runner": runner,
           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "counters": counters}
    result.write_text(json.dumps(out, indent=1))


# -- orchestration ----------------------------------------------------------------------------

HEADER = "| adapters | traffic | mode | req/s | output tok/s | realized skip | vs stock |"


def format_row(r: dict[str, Any], stock: dict[str, Any] | None) -> str:
    traffic = "skewed 80/20" if r["skewed"] else "uniform"
    if "error" in r:
        return f"| {r['adapters']} | {traffic} | {MODE_LABEL[r['mode']]} | {r['error']} | | | |"
    skip = "—" if r["counters"] is None else f"{r['counters']['realized_skip']:.3f}"
    ratio = "1.00" if r["mode"] == "stock" else (
        f"{r['req_per_s'] / stock['req_per_s']:.2f}" if stock and "error" not in stock else "—")
    return (f"| {r['adapters']} | {traffic} | {MODE_LABEL[r['mode']]} | {r['req_per_s']:.1f} | "
            f"{r['output_tok_per_s']:.0f} | {skip} | {ratio} |")


def render(preamble: list[str], rows: list[dict[str, Any]], notes: list[str]) -> str:
    stock = {(r["adapters"], r["skewed"]): r for r in rows if r["mode"] == "stock"}
    lines = preamble + ["", HEADER, "|---|---|---|---|---|---|---|"]
    lines += [format_row(r, stock.get((r["adapters"], r["skewed"]))) for r in rows]
    return "\n".join(lines + [""] + notes) + "\n"


def orchestrate(args: argparse.Namespace) -> int:
    start = time.time()
    out, work = args.out, args.work
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    (work / "prepare.failed").unlink(missing_ok=True)
    drop_stale_stamp(work, args.adapters)
    common = ["--work", str(work), "--requests", str(args.requests), "--seed", str(args.seed),
              "--capture-sizes", *map(str, args.capture_sizes)] + (["--skewed"] if args.skewed else [])
    me = [sys.executable, "-m", "serve_bridge.bench"]
    prep_log = open(out / "prepare.log", "w")
    prep = subprocess.Popen(me + ["--phase", "prepare", "--adapters", *map(str, args.adapters)] + common,
                            stdout=prep_log, stderr=subprocess.STDOUT)
    workloads = {n: make_workload(n, args.requests, skewed=args.skewed, seed=args.seed) for n in args.adapters}
    w0 = workloads[args.adapters[0]]
    preamble = [
        "LoRazor serve_bridge throughput: stock vLLM 0.26.0 vs the LoRazor plugin (StepTrim), same machine, "
        "back-to-back subprocesses",
        f"model: Llama-3.2-3B config, dummy weights, bf16; rank-{RANK} random peft adapters on q,k,v,o,gate,up,down",
        f"workload: {args.requests} requests, prompts {PROMPT_LEN[0]}-{PROMPT_LEN[1]} tokens, outputs "
        f"{OUTPUT_LEN[0]}-{OUTPUT_LEN[1]} tokens ({sum(w0.max_tokens)} in all), ignore_eos, seed {args.seed}, "
        f"{'skewed: 80% of requests on 20% of adapters' if args.skewed else 'uniform traffic'}",
        "schedule: profiled k per adapter for ~50% skipped decode forwards; planned skip "
        + ", ".join(f"N={n}: {w.planned_skip:.3f} (k {min(w.k)}-{max(w.k)})" for n, w in workloads.items()),
        f"engine: {json.dumps(engine_options(0, args.capture_sizes) | {'max_loras': 'N'})}",
    ]
    rows: list[dict[str, Any]] = []
    notes: list[str] = []

    def flush() -> None:
        (out / "bench.txt").write_text(render(preamble, rows, notes))
        (out / "bench.json").write_text(json.dumps({"preamble": preamble, "rows": rows, "notes": notes}, indent=1))

    flush()
    rc = 0
    for n in args.adapters:
        for mode in args.modes:
            left = args.budget_s - (time.time() - start)
            if left < args.min_run_s:
                notes.append(f"N={n} {mode}: not run, {left:.0f} s of the {args.budget_s:.0f} s budget left")
                flush()
                continue
            if mode == "steptrim" and prep.poll() is None:
                try:
                    prep.wait(timeout=left)
                except subprocess.TimeoutExpired:
                    notes.append(f"N={n} {mode}: adapters not written within the budget")
                    flush()
                    continue
            if prep.poll() not in (None, 0):
                notes.append(f"preparation failed (rc {prep.returncode}), see prepare.log")
                flush()
                return 1
            env = {k: v for k, v in os.environ.items() if not k.startswith("LORAZOR_")}
            if mode == "steptrim":
                names = ",".join(f"{adapter_name(a)}={work / 'adapters' / adapter_name(a)}" for a in range(n))
                env |= {"LORAZOR_BUNDLE": str(work / "bundles" / f"{_tag(n, args.skewed)}_r{args.requests}_s{args.seed}"),
                        "LORAZOR_ADAPTERS": names, "LORAZOR_LOG_INTERVAL_S": "0"}
            result = out / f"{_tag(n, args.skewed)}_{mode}.json"
            result.unlink(missing_ok=True)
            t = time.time()
            print(f"[{time.time() - start:5.0f} s] N={n} {mode}: starting ({left:.0f} s left)", flush=True)
            with open(out / f"{_tag(n, args.skewed)}_{mode}.log", "w") as log:
                try:
                    code = subprocess.run(me + ["--phase", "run", "--mode", mode, "--adapters", str(n),
                                                "--result", str(result)] + common,
                                          env=env, stdout=log, stderr=subprocess.STDOUT, timeout=left).returncode
                except subprocess.TimeoutExpired:
                    code = "timeout"
            if code == 0 and result.exists():
                row = json.loads(result.read_text())
                print(f"[{time.time() - start:5.0f} s] N={n} {mode}: {row['req_per_s']:.1f} req/s "
                      f"(generate {row['elapsed_s']:.1f} s, start-up {row['startup_s']:.0f} s, warm-up "
                      f"{row['warmup_s']:.1f} s)", flush=True)
                notes.append(f"N={n} {mode}: generate {row['elapsed_s']:.1f} s, engine start-up "
                             f"{row['startup_s']:.0f} s, warm-up {row['warmup_s']:.1f} s, "
                             f"subprocess {time.time() - t:.0f} s"
                             + ("" if row["counters"] is None else
                                f"; {row['counters']['skipped_forwards']}/{row['counters']['decode_forwards']} "
                                f"decode forwards skipped (planned {row['planned_skip']:.3f}), "
                                f"{row['counters']['released_requests']} requests released, decision "
                                f"{row['counters']['decision_ms_mean']:.2f} ms/step"))
            else:
                rc = 1
                row = {"mode": mode, "adapters": n, "skewed": args.skewed,
                       "error": "timed out" if code == "timeout" else f"failed (rc {code})"}
                tail = (out / f"{_tag(n, args.skewed)}_{mode}.log").read_text()[-3000:]
                print(f"N={n} {mode}: {row['error']}\n{tail}", flush=True)
            rows.append(row)
            flush()
    if prep.poll() is None:
        prep.kill()
    prep_log.close()
    print((out / "bench.txt").read_text(), flush=True)
    return rc


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/lorazor_bench_out")))
    ap.add_argument("--work", type=Path, default=Path("/tmp/lorazor_bench"))
    ap.add_argument("--adapters", type=int, nargs="+", default=[128, 4], help="adapter counts, run in this order")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--skewed", action="store_true", help="80%% of requests on 20%% of the adapters")
    ap.add_argument("--requests", type=int, default=N_REQUESTS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--capture-sizes", type=int, nargs="+", default=CAPTURE_SIZES,
                    help="decode CUDA graph batch sizes; each is captured once per adapter-count case, "
                         "so fewer sizes start the engine faster (both modes use the same)")
    ap.add_argument("--budget-s", type=float, default=3600, help="stop starting engines past this")
    ap.add_argument("--min-run-s", type=float, default=40, help="do not start an engine with less time left")
    ap.add_argument("--phase", choices=["all", "prepare", "run"], default="all", help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.phase == "prepare":
        try:
            prepare(args.work, args.adapters, args.skewed, args.requests, args.seed)
        except BaseException:
            import traceback

            args.work.mkdir(parents=True, exist_ok=True)
            (args.work / "prepare.failed").write_text(traceback.format_exc())
            raise
        return 0
    if args.phase == "run":
        run_engine(args.mode, args.adapters[0], args.skewed, args.requests, args.seed, args.work, args.result,
                   args.capture_sizes)
        return 0
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
