"""Engines of the StepTrim-in-vLLM token-exactness test (``test_release_in_vllm.py``).

A SmolLM2-135M-shaped Llama (dummy weights), 32 random rank-8 peft adapters on q,k,v,o,gate,up,
down and a request set (prompts of 8–1000 tokens, so long ones are chunked; 4–64 output tokens).
Each engine runs in its own process (``python -m tests.gpu.release_engines --phase ...``):

- ``stock``: plain vLLM: full-LoRA and no-adapter outputs.
- ``plugin``: vLLM with the bridge; every adapter is served under three names, ``-off``
  (policy none, or absent from the bundle), ``-prof`` (profiled k) and ``-learn`` (random
  learned heads), and the request set runs once per name family.
- ``badbundle``: start-up with a bundle of another hidden size must fail with one clear error.
- ``stock-defaults`` and ``plugin-defaults``: the same with vLLM's defaults (torch.compile in its
  default CUDA-graph mode, async scheduling, prefix caching; ``test_release_defaults.py``), every
  family included.

:func:`compare` turns their outputs into check rows (name, passed, detail), the async pair's
against each other: (a) policy off ≡ stock token for token; (b) profiled k: release points, tokens up to the release step equal full
LoRA, realized skip (runtime counters) = steptrim.skip_fraction of the output lengths; (c)
learned: decisions happen, tokens up to the release step equal full LoRA, every forward after
release skips (one-way); (d) the wrong bundle's error; (e) at tensor parallelism N > 1, every
rank agrees (runner class, per-request release records, counters without timings). Where N does
not divide MODEL's 9 attention and 3 KV heads the model is :data:`TP_MODEL` (hidden 512).

Without ``-defaults``, both engines capture decode CUDA graphs (FULL_DECODE_ONLY, no torch.compile)
with ``specialize_active_lora``, so released rows exercise the adapter-count graph key. The learned
heads have decision lag 1 (docs/design.md §2), as calibration exports them. vLLM's LoRA
shrink is pinned to split_k=1 (``VLLM_TUNED_CONFIG_FOLDER``): its default split-K sums with float
atomics, whose order varies run to run.
"""
from __future__ import annotations

import argparse
import json
import random
import time
import traceback
from pathlib import Path

from benchmarks.serving.check_slots import ENGINE_MEMORY
from benchmarks.serving.synthetic import write_model_config, write_random_adapters
from serve_bridge.bundle import AdapterEntry, write_bundle
from serve_bridge.steptrim import skip_fraction, skipped_decode_forwards

MODEL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
         "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
         "head_dim": 64, "vocab_size": 49152, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
         "rope_theta": 100000.0, "hidden_act": "silu", "tie_word_embeddings": True, "torch_dtype": "bfloat16",
         "bos_token_id": 1, "eos_token_id": 2}
# TP_MODEL: MODEL with heads that 2, 4 and 8 ranks divide (9 and 3 heads do not; see module docstring).
TP_MODEL = {**MODEL, "hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 4}
N_ADAPTERS, RANK, ALPHA = 32, 8, 16
PROFILED_K = [0, 1, 2, 4, 8, 16, 32, 64, 128]
FAMILIES = ("off", "prof", "learn")
LEARNED_LAG = 1
ENGINE = dict(load_format="dummy", skip_tokenizer_init=True, enable_lora=True, max_loras=N_ADAPTERS,
              max_lora_rank=RANK, max_cpu_loras=3 * N_ADAPTERS, max_num_seqs=128, max_num_batched_tokens=512,
              max_model_len=2048, enable_prefix_caching=False, async_scheduling=False, specialize_active_lora=True,
              **ENGINE_MEMORY, dtype="bfloat16",
              compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                  "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64, 128]})
SHRINK = {"block_m": 32, "block_n": 16, "block_k": 256, "split_k": 1, "num_warps": 4, "num_ctas": 1,
          "group_size_m": 8, "num_stages": 2, "max_nreg": None}


def model_for(tp: int) -> dict:
    """MODEL when ``tp`` ranks divide its attention and KV heads, else TP_MODEL."""
    fits = MODEL["num_attention_heads"] % tp == 0 and MODEL["num_key_value_heads"] % tp == 0
    return MODEL if fits else TP_MODEL


def engine_options(tp: int = 1, fully_sharded: bool = False, defaults: bool = False) -> dict:
    """ENGINE, with ``tensor_parallel_size`` and vLLM's ``fully_sharded_loras`` when asked; with
    ``defaults``, vLLM's own compilation, CUDA-graph mode, async scheduling, prefix caching and
    adapter-count graphs in place of ENGINE's (synchronous on 0.26's V1 runner, as the plugin
    serves it there: docs/serving.md)."""
    from serve_bridge.vllm import versions

    opts = dict(ENGINE)
    if defaults:
        for key in ("compilation_config", "specialize_active_lora"):
            del opts[key]
        version = versions.installed_version()  # read without importing vLLM
        v1_runner = version in versions.SEAMS and versions.seam(version).RUNNER == "V1"
        opts |= {"enable_prefix_caching": True, "async_scheduling": not v1_runner}
    if tp > 1:
        opts["tensor_parallel_size"] = tp
    if fully_sharded:
        opts["fully_sharded_loras"] = True
    return opts


def timing_free(counters: dict) -> dict:
    """Counters without the per-rank timings (keys with ``_ms``), which differ between ranks."""
    return {k: timing_free(v) if isinstance(v, dict) else v for k, v in counters.items() if "_ms" not in k}


def ranks_agree(per_rank: list) -> bool:
    """Whether every rank's ``collective_rpc`` result equals rank 0's (counters: timings aside)."""
    norm = [timing_free(r) if isinstance(r, dict) else r for r in per_rank]
    return all(r == norm[0] for r in norm[1:])


def adapter_name(a: int, family: str | None = None) -> str:
    return f"a{a:02d}" if family is None else f"a{a:02d}-{family}"


def profiled_k(a: int) -> int:
    return PROFILED_K[a % len(PROFILED_K)]


def learned_group(a: int) -> str:
    """Random heads: 'sign' (b=0, τ=0: fires where wᵀh<0), 'always' (fires at t=0), 'never'."""
    return ("sign", "always", "never", "sign")[(a // 8) % 4]


# -- preparation (CPU) ------------------------------------------------------------------------

def prepare(work: Path, n_requests: int, model: dict = MODEL) -> None:
    """Model config, adapters, bundles, request set and the split_k=1 shrink config."""
    import numpy as np
    import torch

    work.mkdir(parents=True, exist_ok=True)
    write_model_config(work, model)
    fps = write_random_adapters(work, model, N_ADAPTERS, RANK, ALPHA, adapter_name)
    rng = np.random.default_rng(0)
    entries = []
    for a in range(N_ADAPTERS):
        if a < N_ADAPTERS // 2:  # the other '-off' adapters are absent: full LoRA with a warning
            entries.append(AdapterEntry(adapter_name(a, "off"), fps[a], "none"))
        entries.append(AdapterEntry(adapter_name(a, "prof"), fps[a], "profiled", k=profiled_k(a)))
        w = (rng.standard_normal(model["hidden_size"]) / model["hidden_size"] ** 0.5).astype(np.float32)
        bias = {"sign": 0.0, "always": -1e4, "never": 1e4}[learned_group(a)]
        entries.append(AdapterEntry(adapter_name(a, "learn"), fps[a], "learned", tau=0.0, weight=w, bias=bias,
                                    lag=LEARNED_LAG))
    bad = [AdapterEntry(adapter_name(0, "prof"), fps[0], "profiled", k=1)]
    for name, hidden, chosen in (("bundle", model["hidden_size"], entries), ("bundle_bad", 64, bad)):
        if not (work / name).exists():
            write_bundle(work / name, backbone="smollm2-135m-shape-dummy", hidden_size=hidden,
                         config_fingerprint="0" * 64, adapters=chosen)

    rnd = random.Random(0)
    requests = []
    for i in range(n_requests):
        long = i % 20 == 7
        plen = rnd.randint(600, 1000) if long else rnd.randint(8, 200)
        requests.append({"adapter": i % N_ADAPTERS, "max_tokens": rnd.randint(4, 64),
                         "prompt": [rnd.randrange(3, model["vocab_size"]) for _ in range(plen)]})
    (work / "requests.json").write_text(json.dumps(requests))

    gpu = torch.cuda.get_device_name().replace(" ", "_").replace("-", "_")
    (work / "lora_configs").mkdir(exist_ok=True)
    (work / "lora_configs" / f"{gpu}_SHRINK.json").write_text(json.dumps(
        {"1": {str(s): {"1": {"1": {"1": SHRINK}}} for s in (1, 2, 3)}}))


# -- engines (one process each) -------------------------------------------------------------

def _llm(work: Path, tp: int = 1, fully_sharded: bool = False, defaults: bool = False):
    from vllm import LLM

    return LLM(model=str(work / "model"), **engine_options(tp, fully_sharded, defaults))


def _scheduler_name(llm) -> str | None:
    """The engine core's scheduler class, when the engine core runs in this process."""
    scheduler = getattr(getattr(llm.llm_engine.engine_core, "engine_core", None), "scheduler", None)
    return None if scheduler is None else type(scheduler).__name__


def _runner_name(worker) -> str:
    return type(worker.model_runner).__name__


def _generate(llm, requests: list[dict], work: Path, family: str,
              id_base: int) -> tuple[list[list[int]], list[str]]:
    """Greedy outputs and request ids; family 'full' = adapters by plain name, 'base' = none."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True, detokenize=False)
              for r in requests]
    loras = None
    if family != "base":
        fam = None if family == "full" else family
        loras = [LoRARequest(adapter_name(r["adapter"], fam), id_base + r["adapter"] + 1,
                             str(work / "adapters" / adapter_name(r["adapter"]))) for r in requests]
    outs = llm.generate([{"prompt_token_ids": r["prompt"]} for r in requests], params, lora_request=loras,
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [o.request_id for o in outs]


def serve(phase: str, work: Path, out: Path, tp: int = 1, fully_sharded: bool = False) -> None:
    """Run ``phase`` (``stock`` or ``plugin``, ``-defaults`` for vLLM's defaults) into ``out/<phase>.json``."""
    mode, defaults = phase.removesuffix("-defaults"), phase.endswith("-defaults")
    requests = json.loads((work / "requests.json").read_text())
    t0 = time.time()
    llm = _llm(work, tp, fully_sharded, defaults)
    runners = llm.collective_rpc(_runner_name)  # one per rank
    result = {"startup_s": time.time() - t0, "ranks": len(runners), "scheduler": _scheduler_name(llm),
              "runner": runners[0] if ranks_agree(runners) else f"ranks differ: {runners}"}
    if mode == "stock":
        for fam in ("full", "base"):
            t = time.time()
            result[fam], _ = _generate(llm, requests, work, fam, 0)
            result[f"{fam}_s"] = time.time() - t
    else:
        from serve_bridge.vllm.rpc import lorazor_counters, lorazor_requests

        for i, fam in enumerate(FAMILIES):
            t = time.time()
            tokens, ext_ids = _generate(llm, requests, work, fam, (i + 1) * 1000)
            result[f"{fam}_s"] = time.time() - t
            index = {rid: j for j, rid in enumerate(ext_ids)}
            records = [None] * len(requests)
            per_rank = llm.collective_rpc(lorazor_requests, kwargs={"clear": True})
            for rec in per_rank[0]:
                j = index.get(rec["req_id"].rsplit("-", 1)[0])  # internal id = external id + "-" + 8 chars
                if j is not None:  # (records of the previous family may still be tracked)
                    records[j] = rec
            counters = llm.collective_rpc(lorazor_counters)
            result[fam] = {"tokens": tokens, "records": records, "counters": counters[0],
                           "ranks_agree": ranks_agree(per_rank) and ranks_agree(counters)}
    (out / f"{phase}.json").write_text(json.dumps(result))


def bad_bundle(work: Path, out: Path) -> None:
    try:
        _llm(work)  # TP = 1 only (module docstring)
        result = {"raised": False, "message": ""}
    except Exception as err:  # the engine may wrap the bridge's error; keep the whole chain
        text = "".join(traceback.format_exception(err))
        result = {"raised": True, "type": type(err).__name__, "message": text[-4000:]}
    (out / "badbundle.json").write_text(json.dumps(result))


# -- comparison -----------------------------------------------------------------------------

def compare(work: Path, out: Path, suffix: str = "") -> list[tuple[str, bool, str]]:
    """The check rows of ``stock<suffix>.json`` against ``plugin<suffix>.json`` (module doc)."""
    requests = json.loads((work / "requests.json").read_text())
    hidden = json.loads((work / "model" / "config.json").read_text())["hidden_size"]
    stock = json.loads((out / f"stock{suffix}.json").read_text())
    plug = json.loads((out / f"plugin{suffix}.json").read_text())
    full, base = stock["full"], stock["base"]
    n = len(requests)
    lengths = [len(t) for t in full]
    rows = [("stock engine is vLLM's runner", stock["runner"] == "GPUModelRunner", stock["runner"]),
            ("plugin engine is the LoRazor runner", plug["runner"] == "LoRazorGPUModelRunner", plug["runner"]),
            ("output lengths = max_tokens", lengths == [r["max_tokens"] for r in requests],
             f"{sum(lengths)} tokens")]
    differs = sum(f != b for f, b in zip(full, base))
    rows.append(("adapters change outputs (non-vacuous)", differs > n // 2, f"{differs}/{n} differ from no-adapter"))

    off = plug["off"]
    same = sum(a == b for a, b in zip(off["tokens"], full))
    c = off["counters"]
    off_released = sum(v["released"] for k, v in c["adapters"].items() if k.endswith("-off"))
    rows.append(("(a) policy off ≡ stock, token for token", same == n, f"{same}/{n} identical"))
    rows.append(("(a) policy off never releases", off_released == 0 and all(
        r is not None and r["release"] is None for r in off["records"]), f"{off_released} released"))

    if suffix == "-defaults":
        schedulers = (stock["scheduler"], plug["scheduler"])
        rows.append(("async: the engine cores schedule asynchronously", schedulers == ("AsyncScheduler",
                     "ReleaseAsyncScheduler"), f"stock {schedulers[0]}, plugin {schedulers[1]}"))
    for fam, release_of in (("prof", lambda i: profiled_k(requests[i]["adapter"])), ("learn", None)):
        if fam not in plug:
            continue
        part = plug[fam]
        recs, toks = part["records"], part["tokens"]
        tag = "(b) profiled k" if fam == "prof" else "(c) learned"
        rel = [r["release"] if r else None for r in recs]
        if release_of is not None:
            expect = [release_of(i) if release_of(i) <= lengths[i] - 1 else None for i in range(n)]
            rows.append((f"{tag}: release points = k", rel == expect,
                         f"{sum(x is not None for x in rel)} released"))
        else:
            groups = [learned_group(r["adapter"]) for r in requests]
            always_ok = all(rel[i] == LEARNED_LAG for i in range(n) if groups[i] == "always")  # fires at t = 0
            never_ok = all(rel[i] is None for i in range(n) if groups[i] == "never")
            later = sum(1 for i in range(n) if groups[i] == "sign" and rel[i] not in (None, LEARNED_LAG))
            rows.append((f"{tag}: decisions happen (τ always/never/sign)", always_ok and never_ok and later > 0,
                         f"{sum(x is not None for x in rel)} released, {later} at t>0"))
        forwards_ok = all(r is not None and r["forwards"] == lengths[i] for i, r in enumerate(recs))
        rows.append((f"{tag}: runtime saw every forward", forwards_ok, "forwards = output length"))
        prefix_ok, tails = 0, 0
        for i in range(n):
            keep = lengths[i] if rel[i] is None else rel[i] + 1
            prefix_ok += toks[i][:keep] == full[i][:keep] and len(toks[i]) == lengths[i]
            tails += rel[i] is not None and toks[i] != full[i]
        rows.append((f"{tag}: tokens up to release = full LoRA", prefix_ok == n, f"{prefix_ok}/{n}"))
        rows.append((f"{tag}: release changes later tokens", tails > 0, f"{tails} released requests differ after r"))
        cnt = {k: v for k, v in part["counters"]["adapters"].items() if k.endswith(f"-{fam}")}
        decode = sum(v["decode_forwards"] for v in cnt.values())
        skipped = sum(v["skipped_forwards"] for v in cnt.values())
        want_decode = sum(max(0, L - 1) for L in lengths)
        want_skipped = sum(skipped_decode_forwards(L, r) for L, r in zip(lengths, rel))
        want = skip_fraction(lengths, rel)
        rows.append((f"{tag}: realized skip = skip_fraction", decode == want_decode and skipped == want_skipped,
                     f"{skipped}/{decode} = {skipped / max(decode, 1):.4f} vs {want:.4f}"))
        if fam == "learn":  # profiled k is applied on the host: no decision to time
            lat = part["counters"]
            rows.append((f"{tag}: decision latency", lat["decision_steps"] > 0,
                         f"{lat['decision_ms_mean'] * 1e3:.0f} µs/step GPU, {lat['decided_rows']} rows"))
    if plug.get("ranks", 1) > 1:
        agree = {fam: plug[fam].get("ranks_agree", False) for fam in FAMILIES if fam in plug}
        rows.append((f"(e) the {plug['ranks']} TP ranks agree (runner, release records, counters)",
                     all(agree.values()) and not str(plug["runner"]).startswith("ranks differ"),
                     ", ".join(f"{f}: {'same' if ok else 'DIFFER'}" for f, ok in agree.items())))
    if not suffix and (out / "badbundle.json").exists():
        bad = json.loads((out / "badbundle.json").read_text())
        needle = f"'hidden_size' is 64 but the served model has {hidden}"
        rows.append(("(d) wrong bundle fails at start-up", bad["raised"] and needle in bad["message"],
                     bad.get("type", "no error")))
    return rows


def phase_env(work: Path, base_env: dict[str, str], phase: str) -> dict[str, str]:
    """The environment of one engine process: ``base_env`` (no ``LORAZOR_*``) with the pinned shrink
    config, plus, for ``plugin`` and ``plugin-defaults``, the bundle and its served adapters, for
    ``badbundle`` the bad bundle."""
    env = {**base_env, "VLLM_TUNED_CONFIG_FOLDER": str(work / "lora_configs")}
    if phase in ("plugin", "plugin-defaults"):
        served = ",".join(f"{adapter_name(a, f)}={work / 'adapters' / adapter_name(a)}"
                          for a in range(N_ADAPTERS) for f in FAMILIES)
        env |= {"LORAZOR_BUNDLE": str(work / "bundle"), "LORAZOR_ADAPTERS": served, "LORAZOR_LOG_INTERVAL_S": "5"}
    elif phase == "badbundle":
        env["LORAZOR_BUNDLE"] = str(work / "bundle_bad")
    return env


def engine_arguments(description: str, phases: list[str], **extra: type) -> argparse.Namespace:
    """The command line of one engine process: ``--phase`` (one of ``phases``), ``--work``, ``--out``
    (created), the parallel layout, and a required ``--<name>`` of the given type per ``extra``."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--phase", choices=phases, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    for name, kind in extra.items():
        ap.add_argument(f"--{name}", type=kind, required=True)
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--fully-sharded-loras", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def main() -> None:
    args = engine_arguments("one engine of the token-exactness test, in this process",
                            ["stock", "plugin", "badbundle", "stock-defaults", "plugin-defaults"])
    if args.phase == "badbundle":
        bad_bundle(args.work, args.out)
    else:
        serve(args.phase, args.work, args.out, args.tensor_parallel_size, args.fully_sharded_loras)


if __name__ == "__main__":
    main()
