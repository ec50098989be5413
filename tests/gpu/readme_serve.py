"""Servers of the README-command test (``test_readme_serve.py``): ``vllm serve`` as the README says.

The demo run (``make demo``: SmolLM2-135M-Instruct, adapters arith-a and counter-a, a bundle with a
learned head for counter-a and never-release for arith-a) is served by ``vllm serve`` with vLLM's
defaults (torch.compile in its default CUDA-graph mode, async scheduling, prefix caching), each
server in its own process group (``python -m tests.gpu.readme_serve --server NAME``):

- ``lorazor``: the README's command (``LORAZOR_BUNDLE``, ``LORAZOR_GRIDTRIM=1``, the worker
  extension). The demo's test requests one at a time, twice: cold, then warm (the prefix cache holds
  the first pass's blocks). Tokens and each position's most likely tokens, each request's release
  point, the StepTrim counters and the scheduler's prefix-cache hits of each pass.
- ``lorazor-sync``: the same plus ``--no-async-scheduling`` (the one flag that turns a default
  off, to compare): the cold pass.
- ``stock``: vLLM without the plugin; every request of the demo's three splits, one at a time.
- ``off``: the plugin with the bundle (StepTrim's runner, release-aware scheduler, prefix-cache
  keys), the adapters served under names the bundle lacks (policy off): the same requests.

One request at a time is the batch-invariant setting: every step then holds one request in both
servers (batches sent over HTTP are split into steps by arrival, differently in two servers). It is
not a bitwise-reproducible one for stock vLLM's LoRA kernels: their shrink splits K into partials
summed with atomic adds (split_k 64 below 128 rows, ``lora/ops/triton_ops/utils.py:218``,
``kernel_utils.py:356``, 0.33.0 and 0.34.0), in whatever order the GPU finishes them, so two runs of
the same request may flip a token where the logits nearly tie (2026-12-06, vLLM 0.34.0 on an H100,
commit 34a6c2d: policy off equalled stock on 415 of 416 requests one at a time; that run kept no
logprobs to tell whether the other one was such a near-tie). The ``stock`` and
``off`` servers therefore also return each position's most likely tokens, and the test allows a
near-tie (``check_slots.divergence``) but no far difference. Batched policy off against stock, with one
schedule for both engines, is check_slots' check (a) and ``test_release_defaults``.

Beside the command the servers get only what sharing a GPU and reading the counters need: a free
port, a tenth of the GPU and a 4 GiB KV cache (``check_slots.ENGINE_MEMORY``), and
``VLLM_SERVER_DEV_MODE=1`` for ``POST /collective_rpc``.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.serving.check_slots import ENGINE_MEMORY, TOP_LOGPROBS
from benchmarks.serving.vllm_server import free_port, http_json, start_server, stop_server, wait_ready
from tests.gpu.harness import ROOT, SERVER_READY_S, demo_arguments, engine_environ
from tests.gpu.real_engines import backbone_dir

ADAPTERS = {"arith": "arith-a", "counter": "counter-a"}  # task part → the adapter serving it (conf/adapter/demo.yaml)
SERVERS = ("lorazor", "lorazor-sync", "stock", "off")
OFF_SUFFIX = "-off"  # served names the bundle lacks: full LoRA (policy off)


def adapter_path(name: str) -> str:
    return str(ROOT / "labeling" / "data" / "adapters" / name)


def demo_task():
    """The demo's task (conf/task/demo.yaml's parts, read from the product's config)."""
    from omegaconf import OmegaConf

    from labeling.tasks import build_task

    parts = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "task" / "demo.yaml").options.parts)
    return build_task("mix", parts=parts)


def requests(model_dir: str, splits: tuple[str, ...]) -> dict[str, Any]:
    """The demo's chat-templated prompts of ``splits``, per adapter, with the stop tokens and each
    example's uid (for scoring)."""
    from transformers import AutoTokenizer, GenerationConfig

    from labeling.backbone import SMOLLM2, stop_token_ids
    from labeling.engines.chat import ChatIO
    from labeling.tasks.mix import PART_KEY

    io = ChatIO()
    io.tokenizer = AutoTokenizer.from_pretrained(model_dir)
    task = demo_task()
    out: dict[str, Any] = {"stop_ids": sorted(stop_token_ids(GenerationConfig.from_pretrained(model_dir),
                                                               io.tokenizer, SMOLLM2)),
                           "max_tokens": {}, "prompts": {}, "uids": {}}
    for part, adapter in ADAPTERS.items():
        examples = [ex for split in splits for ex in task.load_split(split) if ex.meta[PART_KEY] == part]
        out["prompts"][adapter] = [io.encode(task.messages(ex)) for ex in examples]
        out["uids"][adapter] = [ex.uid for ex in examples]
        out["max_tokens"][adapter] = task.parts[part].max_new_tokens
    return out


def complete(url: str, model: str, prompts: list[list[int]], max_tokens: int, stop_ids: list[int],
             top: int = 0) -> tuple[str, list[list[int]], list[list[list[int]]]]:
    """One ``/v1/completions`` call for ``prompts`` (token ids), greedy: (its id, tokens per prompt,
    per prompt and position the ``top`` most likely token ids, none when ``top`` is 0)."""
    body = {"model": model, "prompt": prompts, "max_tokens": max_tokens, "temperature": 0.0,
            "stop_token_ids": stop_ids, "return_token_ids": True}
    if top:
        body |= {"logprobs": top, "return_tokens_as_token_ids": True}
    resp = http_json(url + "/v1/completions", body, timeout_s=600)
    tokens: list[list[int]] = [[] for _ in prompts]
    tops: list[list[list[int]]] = [[] for _ in prompts]
    for choice in resp["choices"]:
        tokens[choice["index"]] = choice["token_ids"]
        if top:
            tops[choice["index"]] = top_token_ids(choice["logprobs"]["top_logprobs"])
    return resp["id"], tokens, tops


def top_token_ids(top_logprobs: list[dict[str, float] | None]) -> list[list[int]]:
    """A completion choice's ``top_logprobs`` under ``return_tokens_as_token_ids`` (keys
    ``token_id:<id>``, ``format_token_id_placeholder`` in ``entrypoints/generate/base/serving.py``
    of 0.33.0 and 0.34.0) as token ids per position, most likely first as vLLM lists them."""
    return [[int(key.rsplit(":", 1)[1]) for key in position or {}] for position in top_logprobs]


def rpc(url: str, method: str, **kwargs: Any) -> Any:
    """A ``LoRazorWorkerExtension`` method over ``POST /collective_rpc`` (the one worker's result)."""
    return http_json(url + "/collective_rpc", {"method": method, "kwargs": kwargs})["results"][0]


def releases(records: list[dict[str, Any]], ids: list[str]) -> list[int | None]:
    """Release point of prompt i of call ``ids[i]`` (vLLM's engine id is ``<call id>-<index>-<8 chars>``)."""
    by_prefix = {rec["req_id"].rsplit("-", 1)[0]: rec["release"] for rec in records}
    return [by_prefix.get(f"{call}-0") for call in ids]


def alone(url: str, reqs: dict[str, Any], adapter: str, model: str,
          top: int = 0) -> tuple[list[str], list[list[int]], list[list[list[int]]]]:
    """``adapter``'s prompts one call each, served as ``model``: the calls' ids, tokens and most
    likely tokens (:func:`complete`)."""
    calls = [complete(url, model, [p], reqs["max_tokens"][adapter], reqs["stop_ids"], top)
             for p in reqs["prompts"][adapter]]
    return [call for call, _, _ in calls], [toks for _, (toks,), _ in calls], [t for _, _, (t,) in calls]


def tokens_alone(url: str, reqs: dict[str, Any], model_of: dict[str, str]) -> dict[str, Any]:
    """Every prompt alone, adapter after adapter: tokens per adapter and, for the near-tie test
    (``check_slots.divergence``), each position's TOP_LOGPROBS most likely tokens."""
    runs = {adapter: alone(url, reqs, adapter, model_of[adapter], TOP_LOGPROBS) for adapter in reqs["prompts"]}
    return {"tokens": {adapter: run[1] for adapter, run in runs.items()},
            "top": {adapter: run[2] for adapter, run in runs.items()}}


def one_by_one(url: str, reqs: dict[str, Any], model_of: dict[str, str]) -> dict[str, Any]:
    """Every prompt alone, adapter after adapter: tokens, most likely tokens (as
    :func:`tokens_alone`) and release points per adapter, the StepTrim counters and the prefix-cache
    hits."""
    out: dict[str, Any] = {"tokens": {}, "top": {}, "release": {}}
    rpc(url, "lorazor_requests", clear="true")
    for adapter in reqs["prompts"]:
        ids, out["tokens"][adapter], out["top"][adapter] = alone(url, reqs, adapter, model_of[adapter], TOP_LOGPROBS)
        out["release"][adapter] = releases(rpc(url, "lorazor_requests", clear="true"), ids)
    out["counters"] = rpc(url, "lorazor_counters")
    out["prefix_cache"] = rpc(url, "lorazor_prefix_cache")
    return out


def serve(name: str, run: Path, gguf_dir: str | None, work: Path) -> None:
    """Start server ``name`` (module doc), run its passes, write ``work/<name>.json``."""
    model = backbone_dir(gguf_dir)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    plugin = name != "stock"
    served = {a: a + (OFF_SUFFIX if name == "off" else "") for a in ADAPTERS.values()}
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, "--enable-lora",
           "--lora-modules", *(f"{served[a]}={adapter_path(a)}" for a in ADAPTERS.values())]
    if plugin:
        cmd += ["--worker-extension-cls", "serve_bridge.vllm.rpc.LoRazorWorkerExtension"]
    if name == "lorazor-sync":
        cmd += ["--no-async-scheduling"]
    cmd += ["--port", str(port), "--gpu-memory-utilization", str(ENGINE_MEMORY["gpu_memory_utilization"]),
            "--kv-cache-memory-bytes", str(ENGINE_MEMORY["kv_cache_memory_bytes"])]
    env = engine_environ()
    env |= {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "LORAZOR_LOG_INTERVAL_S": "0"}
    if plugin:
        env |= {"LORAZOR_BUNDLE": str(run / "bundle")}
    if name in ("lorazor", "lorazor-sync"):
        env |= {"LORAZOR_GRIDTRIM": "1"}
    log = work / f"{name}.log"
    t0 = time.monotonic()
    server = start_server(cmd, env, log)
    try:
        ready_s = wait_ready(url, server, log, SERVER_READY_S, list(served.values()))
        out: dict[str, Any] = {"command": cmd, "ready_s": ready_s}
        if name in ("stock", "off"):
            out |= tokens_alone(url, requests(model, ("train", "validation", "test")), served)
        else:
            reqs = requests(model, ("test",))
            out["cold"] = one_by_one(url, reqs, served)
            if name == "lorazor":
                out["warm"] = one_by_one(url, reqs, served)
        out["seconds"] = time.monotonic() - t0
        (work / f"{name}.json").write_text(json.dumps(out))
    finally:
        stop_server(server)


def main() -> None:
    args = demo_arguments("one server of the README-command test, in its own process group", "server", SERVERS)
    serve(args.server, args.run, args.gguf_dir, args.work)


if __name__ == "__main__":
    main()
