"""Offline throughput: stock vLLM vs vLLM with the LoRazor plugin, in one run.

    python -m benchmarks.serving.bench --out DIR [--adapters 128 4] [--modes stock gridtrim steptrim both nolora]
                                 [--passes P] [--repeats R [--interleave [--vllm-python A B]]]
                                 [--model llama3b|mistral7b|llama8b] [--rank R] [--skewed] [--arrival-rate R]

(``scripts/serve_bench.sh`` runs it with the plugin's entry point visible, installed or not.)
It serves a Llama-3.2-3B-shaped model (Mistral-7B-v0.3- or Llama-3.1-8B-shaped with
``--model``) with dummy weights and N random rank-8 (``--rank``) peft adapters on
q,k,v,o,gate,up,down. The workload follows the paper: 2048 requests with
prompts of 100–300 tokens and 20–100 output tokens (``ignore_eos``, per-request
``max_tokens``), spread uniformly over the adapters, or 80% of requests on 20% of them with
``--skewed``. StepTrim runs a P50-like profiled schedule: each adapter gets the k whose
release skips about half of its decode forwards, given its requests' output lengths
(:func:`serve_bridge.steptrim.skip_fraction`).

Every (adapters, mode) pair runs in its own subprocess, back to back on the same machine, in
the order of ``--modes`` (default stock, gridtrim, steptrim, both); ``--passes P`` repeats them
P times, each pass in the reverse order of the one before (:func:`schedule`), and every row's
ratio is to the stock row of its own pass. With ``--repeats R --interleave`` the modes' engines
start together and stay alive (each compiling into a vLLM cache of its own,
:func:`benchmarks.serving.placement.compile_cache`), sharing the GPU through KV caches sized for
the workload, and their R timed runs go in rounds, one engine at a time
(:mod:`benchmarks.serving.interleave`); the notes give both's ratio to every other mode and
gridtrim's to stock round by round. ``--vllm-python A B`` runs every mode once per interpreter,
each with its own vLLM install, all in the same rounds: two vLLM lines compared within one run,
each row naming its version. Under vLLM's defaults each engine's start-up compiles and captures
its graphs (minutes), so a table of several modes fits one call only this way. Every mode runs vLLM's default
``specialize_active_lora`` (off); ``--specialize-active-lora`` turns vLLM's adapter-count graphs on
where vLLM's LoRA kernels run (stock, steptrim, stockfix) for a second line. The modes:

- ``stock``: no ``LORAZOR_*`` variable, so the plugin stays inactive: vLLM's runner and
  punica wrapper.
- ``gridtrim``: ``LORAZOR_GRIDTRIM=1`` only: vLLM's runner, our punica wrapper
  (``serve_bridge.vllm.punica_wrapper``: LoRA linears on the work-list kernels). No release, so it
  measures the kernels alone. The kernels ignore the adapter count, so one LoRA CUDA graph per
  batch size serves every adapter mix.
- ``steptrim``: the bundle variables (``LORAZOR_BUNDLE``, ``LORAZOR_ADAPTERS``) only: the
  StepTrim runner with the profiled bundle, vLLM's LoRA kernels (released rows still launch
  their tiles).
- ``both``: both switches: StepTrim releases rows and GridTrim's kernels skip them.
- ``stockfix`` (only when asked for): stock, plus the plugin's one registry read per step in
  vLLM's worker LoRA manager (:mod:`serve_bridge.vllm.lora_manager`), installed in the engine's
  process (the engine runs in-process here: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one GPU). The
  plugin installs that fix in every LoRazor mode, so this is the baseline that isolates what the
  kernels and release add beyond it.
- ``nolora`` (only when asked for): the backbone with ``enable_lora`` off, serving the same
  requests without adapters. It is the ceiling: no LoRA speed-up can beat it, so its ratio to
  stock bounds what the other modes can reach on the workload.

Each engine checks that its runner class, its punica wrapper class and its adapter-registry
path are the mode's, and fails otherwise. The realized skip of the StepTrim modes comes from
the plugin's counters over ``collective_rpc``.

With ``--arrival-rate R`` each engine instead serves the requests open-loop: request i is added
through vLLM V1's ``LLMEngine.add_request`` at its Poisson arrival time (seeded,
:func:`benchmarks.serving.bench_workload.arrival_times`) while the harness drives ``step()``; the
table then gives P50/P90 TTFT and TPOT, and
"vs stock" is stock's TPOT P50 over the mode's.

The first stock engine starts while the adapters are being written. Each engine serves one
short request per adapter (loading every adapter) before the timed run of all requests:
offline, ``LLM.generate``'s own loop with each engine step timed (:func:`serve_offline`; the
notes give the step count and P50/P90/max step time). The table is rewritten to
``OUT/bench.txt`` after every run, so a run cut short still leaves the finished rows.

The workload (:mod:`benchmarks.serving.bench_workload`) is pure and seeded, and is tested on CPU; the
report is :mod:`benchmarks.serving.bench_table`.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.serving import interleave, placement, vllm_settings
from benchmarks.serving.bench_table import render, round_notes, run_note, slot_table
from benchmarks.serving.bench_workload import (N_REQUESTS, OUTPUT_LEN, PROMPT_LEN, TARGET_SKIP, Workload,
                                               arrival_times, workload_for)
from benchmarks.serving.host_memory import (adapter_bytes, host_bytes_needed, host_memory_available,
                                            host_memory_problem)
from benchmarks.serving.interleave import Turns
from benchmarks.serving.synthetic import (LLAMA31_8B, LLAMA32_3B, MISTRAL_7B, write_model_config,
                                          write_random_adapters)
from benchmarks.serving.vllm_settings import VllmSettings
from serve_bridge.command_line import Parser, number
from serve_bridge.vllm.versions import installed_version as installed_vllm


MODELS = {"llama3b": LLAMA32_3B, "mistral7b": MISTRAL_7B, "llama8b": LLAMA31_8B}
MODEL_NAME = {"llama3b": "Llama-3.2-3B", "mistral7b": "Mistral-7B-v0.3", "llama8b": "Llama-3.1-8B"}
RANK = 8  # the default adapter rank (--rank); alpha is 2 × rank, so every rank scales its update by 2
# distinct weight files; adapter a's is a hard link to file a mod K (synthetic.write_random_adapters)
DISTINCT_WEIGHTS = 32
MAX_NUM_SEQS = 256  # running requests per engine (every mode)
MODES = ("stock", "gridtrim", "steptrim", "both", "nolora", "stockfix")
# nolora: the backbone alone (enable_lora=False, the same requests without adapters), the ceiling
# any LoRA speed-up is bounded by; opt-in through --modes.
DEFAULT_MODES = ("stock", "gridtrim", "steptrim", "both")
STEPTRIM_MODES = ("steptrim", "both")  # the bundle variables are set
GRIDTRIM_MODES = ("gridtrim", "both")  # LORAZOR_GRIDTRIM=1
RUNNER = {"stock": "GPUModelRunner", "gridtrim": "GPUModelRunner", "steptrim": "LoRazorGPUModelRunner",
          "both": "LoRazorGPUModelRunner", "nolora": "GPUModelRunner", "stockfix": "GPUModelRunner"}
WRAPPER = {"stock": "PunicaWrapperGPU", "gridtrim": "GridTrimPunicaWrapper", "steptrim": "PunicaWrapperGPU",
           "both": "GridTrimPunicaWrapper", "nolora": None, "stockfix": "PunicaWrapperGPU"}
# How vLLM's LRU worker LoRA manager reads its registry per step (serve_bridge.vllm.lora_manager);
# None without LoRA.
REGISTRY = {mode: "once per step" for mode in MODES} | {"stock": "per adapter", "nolora": None}


# -- measurements of a run -----------------------------------------------------------------


def latency_summary(arrival: Sequence[float], first_token: Sequence[float], finish: Sequence[float],
                    n_tokens: Sequence[int]) -> dict[str, float]:
    """P50/P90 of TTFT (first token − arrival) and TPOT ((finish − first token) / (tokens − 1), over
    requests with ≥ 2 tokens), in milliseconds."""
    ttft = np.asarray(first_token) - np.asarray(arrival)
    multi = [i for i, n in enumerate(n_tokens) if n > 1]
    tpot = np.asarray([(finish[i] - first_token[i]) / (n_tokens[i] - 1) for i in multi])
    out = {}
    for name, values in (("ttft", ttft), ("tpot", tpot)):
        for q in (50, 90):
            out[f"{name}_p{q}_ms"] = float(np.percentile(values, q) * 1e3) if len(values) else float("nan")
    return out


def step_summary(step_s: Sequence[float]) -> dict[str, Any]:
    """The engine steps of a timed run: their number, and the mean, P50/P90/P99 and max wall time
    of one ``LLMEngine.step()`` in milliseconds. Decode-only steps replay a CUDA graph and mixed
    prefill/decode steps run eagerly, so a long P90 against a short P50 points at the mixed steps."""
    ms = np.asarray(step_s, np.float64) * 1e3
    if not ms.size:
        return {"steps": 0}
    q = np.percentile(ms, (50, 90, 99))
    return {"steps": int(ms.size), "step_ms_mean": float(ms.mean()), "step_ms_p50": float(q[0]),
            "step_ms_p90": float(q[1]), "step_ms_p99": float(q[2]), "step_ms_max": float(ms.max())}


def host_probe_ms(repeats: int = 5) -> float:
    """The best of ``repeats`` timings (ms) of a fixed host workload: a Python loop and small numpy
    ops, the kind of work an engine step does between kernels. Taken before and after each
    timed run, it shows whether the host itself was slower for one engine than for another (a
    shared machine's load, clocks), which the engines' ratios would otherwise absorb."""
    best = float("inf")
    for _ in range(repeats):
        x = np.arange(256)
        start = time.perf_counter()
        acc = 0
        for i in range(20000):
            acc += i * i % 7
        for _ in range(200):
            x = (x + 1) % 1000
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def device_probe_ms(repeats: int = 5, size: int = 4096, copy_mib: int = 128) -> dict[str, float]:
    """The best of ``repeats`` CUDA-event timings (ms) of two fixed GPU workloads: eight bf16
    matmuls of ``size``² (``matmul_ms``, the clocks) and a device copy of ``copy_mib`` MiB
    (``copy_ms``, the memory). Beside :func:`host_probe_ms` before each timed run, it tells a slower
    GPU from a slower host when runs of one engine, or of two calls, differ. Empty without CUDA or
    when its 224 MiB do not fit beside the engine."""
    import torch

    if not torch.cuda.is_available():
        return {}
    try:
        result = _device_work_ms(repeats, size, copy_mib)
    except torch.cuda.OutOfMemoryError:
        result = {}
    torch.cuda.empty_cache()  # the probe's blocks back to the engine
    return result


def _device_work_ms(repeats: int, size: int, copy_mib: int) -> dict[str, float]:
    """:func:`device_probe_ms`'s timings, its tensors freed on return."""
    import torch

    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    src = torch.empty(copy_mib << 20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)

    def best(work: Callable[[], None]) -> float:
        out = float("inf")
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            work()
            end.record()
            end.synchronize()
            out = min(out, start.elapsed_time(end))
        return out

    return {"matmul_ms": best(lambda: [torch.matmul(a, a, out=c) for _ in range(8)]),
            "copy_ms": best(lambda: dst.copy_(src))}


def probe() -> dict[str, float]:
    """:func:`host_probe_ms` and :func:`device_probe_ms` at one moment, as one run's ``probes`` entry."""
    return {"host_ms": host_probe_ms()} | device_probe_ms()


# -- files: model config, adapters, bundles -------------------------------------------------------

def adapter_name(a: int) -> str:
    """Served name of adapter a (tests/gpu/release_engines.py's naming)."""
    return f"a{a:02d}"


def write_model_and_adapters(work: Path, n_adapters: int, cfg: dict[str, Any] = LLAMA32_3B,
                             rank: int = RANK) -> dict[str, str]:
    """``work/model/config.json`` and ``work/adapters/aNN``: random rank-``rank`` peft adapters on
    q,k,v,o,gate,up,down of this model's shapes; returns adapter name → weights sha256."""
    write_model_config(work, cfg)
    fps = write_random_adapters(work, cfg, n_adapters, rank, 2 * rank, adapter_name, distinct=DISTINCT_WEIGHTS)
    return {adapter_name(a): fp for a, fp in fps.items()}


def write_profiled_bundle(directory: Path, wl: Workload, fingerprints: dict[str, str],
                          cfg: dict[str, Any] = LLAMA32_3B) -> Path:
    """The workload's profiled schedule as a bundle for its N adapters."""
    from serve_bridge.bundle import AdapterEntry, config_fingerprint, write_bundle

    entries = [AdapterEntry(adapter_name(a), fingerprints[adapter_name(a)], "profiled", k=int(wl.k[a]),
                            stats={"rule": "profiled k: ~50% of decode forwards skipped on the bench lengths",
                                   "target_skip": TARGET_SKIP})
               for a in range(wl.n_adapters)]
    backbone = {("mistral", 4096): "mistral-7b-v0.3-shape-dummy", ("llama", 4096): "llama-3.1-8b-shape-dummy"}.get(
        (cfg.get("model_type"), cfg["hidden_size"]), "llama-3.2-3b-shape-dummy")
    return write_bundle(directory, backbone=backbone, hidden_size=cfg["hidden_size"],
                        config_fingerprint=config_fingerprint(cfg), adapters=entries)


def _tag(n: int, skewed: bool) -> str:
    return f"n{n}_{'skewed' if skewed else 'uniform'}"


def bundle_dir(work: Path, n: int, skewed: bool, n_requests: int, seed: int) -> Path:
    """Where :func:`prepare` writes the profiled bundle of N adapters for this workload."""
    return work / "bundles" / f"{_tag(n, skewed)}_r{n_requests}_s{seed}"


def _prep_key(adapters: Sequence[int], cfg: dict[str, Any] = LLAMA32_3B, rank: int = RANK) -> dict[str, Any]:
    return {"config": cfg, "rank": rank, "adapters": max(adapters), "distinct": DISTINCT_WEIGHTS}


def drop_stale_stamp(work: Path, adapters: Sequence[int], cfg: dict[str, Any] = LLAMA32_3B, rank: int = RANK) -> None:
    """Remove ``work/prepared.json`` unless it was written for these adapters and this model."""
    stamp = work / "prepared.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("key") != _prep_key(adapters, cfg, rank):
        stamp.unlink()


def prepare(work: Path, adapters: Sequence[int], skewed: bool, n_requests: int, seed: int,
            cfg: dict[str, Any] = LLAMA32_3B, rank: int = RANK) -> None:
    """Adapters for max(adapters), a bundle per adapter count; ``work/prepared.json`` last.

    Adapters already written for the same model and adapter count (same stamp) are kept."""
    import shutil

    stamp = work / "prepared.json"
    drop_stale_stamp(work, adapters, cfg, rank)
    if stamp.exists():
        fps = json.loads(stamp.read_text())["fingerprints"]
    else:
        for stale in ("adapters", "bundle", "bundle_bad", "bundles"):
            shutil.rmtree(work / stale, ignore_errors=True)
        fps = write_model_and_adapters(work, max(adapters), cfg, rank)
    for n in adapters:
        wl = workload_for(n, n_requests, skewed, seed, cfg)
        directory = bundle_dir(work, n, skewed, n_requests, seed)
        if not directory.exists():
            write_profiled_bundle(directory, wl, fps, cfg)
    stamp.write_text(json.dumps({"key": _prep_key(adapters, cfg, rank), "fingerprints": fps}))


# -- one engine (subprocess) ----------------------------------------------------------------------

def engine_options(n_adapters: int, mode: str = "stock", lora_target_modules: Sequence[str] | None = None,
                   tensor_parallel_size: int = 1, settings: VllmSettings = VllmSettings(),
                   max_loras: int | None = None, max_cpu_loras: int | None = None, rank: int = RANK,
                   kv_cache_bytes: int | None = None) -> dict[str, Any]:
    """The engine options of a mode: the workload's batch limits, ``settings`` (vLLM's defaults
    unless a table says otherwise: :class:`~benchmarks.serving.vllm_settings.VllmSettings`, the same
    for every mode), max_loras = N (or ``max_loras``: the slot-bound workload), ``max_cpu_loras`` N
    (every adapter stays loaded in host memory after the warm-up request per adapter) or the given
    one, at least max_loras, and ``specialize_active_lora`` where ``settings`` ask for it and vLLM's
    LoRA kernels run (:func:`specializes`). Optional,
    the same for every mode: ``lora_target_modules`` (vLLM's ``LoRAConfig.target_modules``,
    ``config/lora.py:49-52``: which module suffixes get LoRA layers at all, matched against the
    runtime names such as ``qkv_proj`` in ``lora/utils.py:271-301``; by default vLLM also wraps
    ``embed_tokens`` and ``lm_head``) and ``tensor_parallel_size``. ``nolora`` has the same options
    without any LoRA one. With ``kv_cache_bytes`` (engines sharing the GPU,
    :func:`interleaved_kv_cache_bytes`) the KV cache has that size and the engine asks only a tenth
    of the GPU free at start-up (``kv_cache_memory_bytes``, docs/vllm_integration.md §13)."""
    opts = dict(load_format="dummy", skip_tokenizer_init=True, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=2048,
                dtype="bfloat16") | settings.engine_options()
    if kv_cache_bytes:
        opts |= {"gpu_memory_utilization": 0.1, "kv_cache_memory_bytes": int(kv_cache_bytes)}
    if mode == "nolora":
        return opts | ({"tensor_parallel_size": int(tensor_parallel_size)} if tensor_parallel_size > 1 else {})
    slots = max_loras or n_adapters
    opts |= dict(enable_lora=True, max_loras=slots, max_lora_rank=rank,
                 max_cpu_loras=max(max_cpu_loras or n_adapters, slots))
    if specializes(mode, settings):
        opts["specialize_active_lora"] = True
    if lora_target_modules:
        opts["lora_target_modules"] = list(lora_target_modules)
    if tensor_parallel_size > 1:
        opts["tensor_parallel_size"] = int(tensor_parallel_size)
    return opts


def specializes(mode: str, settings: VllmSettings) -> bool:
    """Whether ``mode`` runs with vLLM's adapter-count graphs: where ``settings`` ask for them and the
    mode runs vLLM's LoRA kernels (GridTrim's ignore the adapter count: one LoRA graph per batch size)."""
    return settings.specialize_active_lora and mode not in (*GRIDTRIM_MODES, "nolora")


def interleaved_kv_cache_bytes(cfg: dict[str, Any], block: int = 16, margin: float = 1.25) -> int:
    """A KV cache that holds every running request at its longest, with ``margin`` to spare, so an
    engine sharing the GPU schedules as one that has it alone (no preemption): max_num_seqs requests
    of the longest prompt plus output, rounded up to whole blocks plus one, at 2 (K, V) × layers ×
    KV heads × head dim × 2 bytes (bf16) per token. Llama-3.2-3B: about 14 GiB."""
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
    longest = PROMPT_LEN[1] + OUTPUT_LEN[1]
    tokens = MAX_NUM_SEQS * (-(-longest // block) + 1) * block
    return int(margin * tokens * per_token)


def mode_env(mode: str, environ: dict[str, str], bundle: Path, adapters: dict[str, Path],
             slots: bool = True) -> dict[str, str]:
    """The subprocess environment of a mode: ``environ`` without any ``LORAZOR_*`` variable, plus
    ``LORAZOR_GRIDTRIM=1`` for gridtrim/both and the bundle variables for steptrim/both; without
    ``slots``, ``LORAZOR_SLOTS=0`` there (released requests keep counting against max_loras). The
    plugin's default accepts async scheduling for the bench's profiled bundles."""
    env = {k: v for k, v in environ.items() if not k.startswith("LORAZOR_")}
    if mode in GRIDTRIM_MODES:
        env["LORAZOR_GRIDTRIM"] = "1"
    if mode in STEPTRIM_MODES:
        env |= {"LORAZOR_BUNDLE": str(bundle), "LORAZOR_ADAPTERS": ",".join(f"{k}={v}" for k, v in adapters.items()),
                "LORAZOR_LOG_INTERVAL_S": "0"}
        if not slots:
            env["LORAZOR_SLOTS"] = "0"
    return env


def engine_classes(worker: Any) -> dict[str, str | None]:
    """The worker's model runner class and its language model's punica wrapper class (vLLM 0.26.0):
    ``model_runner.lora_manager`` is the ``LRUCacheWorkerLoRAManager``
    (``v1/worker/lora_model_runner_mixin.py:41``), whose ``_adapter_manager`` is the
    ``LoRAModelManager`` (``lora/worker_manager.py:102``); it keeps the wrappers by prefix in
    ``punica_wrapper_mapping``, the language model's under ``"language_model"``
    (``lora/model_manager.py:51``, filled at :164-177); and whether that worker manager's
    ``_apply_adapters`` is the plugin's (``"once per step"``) or vLLM's (``"per adapter"``). Without
    LoRA the runner has no ``lora_manager`` (the mixin tests for it, :70), and both are None."""
    from serve_bridge.vllm.lora_manager import apply_adapters

    runner = worker.model_runner
    manager = getattr(runner, "lora_manager", None)
    if manager is None:
        return {"runner": type(runner).__name__, "punica_wrapper": None, "registry": None}
    wrapper = manager._adapter_manager.punica_wrapper_mapping["language_model"]
    registry = "once per step" if getattr(type(manager), "_apply_adapters", None) is apply_adapters else "per adapter"
    return {"runner": type(runner).__name__, "punica_wrapper": type(wrapper).__name__, "registry": registry}


def check_engine_classes(mode: str, found: dict[str, str | None]) -> None:
    """Refuse an engine whose runner, punica wrapper or registry path is not the mode's."""
    want = {"runner": RUNNER[mode], "punica_wrapper": WRAPPER[mode], "registry": REGISTRY[mode]}
    if found != want:
        raise RuntimeError(f"mode {mode}: the engine runs {found}, expected {want}")


class SlotStats:
    """Per scheduled step: running requests, distinct adapters holding a slot and distinct
    adapters scheduled (:func:`serve_bridge.vllm.scheduler.scheduled_occupancy`), and whether the
    step's tokens (``SchedulerOutput.total_num_scheduled_tokens``) exceed ``graph_tokens``, the
    engine's largest CUDA graph (:func:`largest_graph_tokens`): vLLM runs such a step without one.
    Read by wrapping the engine core's
    ``scheduler.schedule`` on the instance. Needs the engine core in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): ``LLMEngine.engine_core`` is then vLLM's
    ``InprocClient``, whose ``engine_core`` holds the ``scheduler`` (``v1/engine/core_client.py:287``,
    ``v1/engine/core.py:153``). Counting starts at :meth:`start`."""

    def __init__(self, scheduler: Any, graph_tokens: int = 0) -> None:
        from serve_bridge.vllm.scheduler import scheduled_occupancy

        self.graph_tokens = graph_tokens
        self._reset()
        self.on = False
        self.scheduler_class = type(scheduler).__name__
        original = scheduler.schedule

        def schedule(*args: Any, **kwargs: Any) -> Any:
            now = time.perf_counter()
            if self.on and self._last_busy is not None:  # the previous step, from its schedule to this one
                self.busy_s[self._last_past] += now - self._last_busy
                self.timed[self._last_past] += 1
            out = original(*args, **kwargs)
            self._last_busy = None
            if self.on:
                running, held, present = scheduled_occupancy(scheduler, out)
                if running:
                    self._last_busy = now
                    self._last_past = out.total_num_scheduled_tokens > self.graph_tokens
                    self.steps += 1
                    self.past_graphs += self._last_past
                    self.running += running
                    self.held += held
                    self.max_held = max(self.max_held, held)
                    self.max_present = max(self.max_present, present)
            return out

        scheduler.schedule = schedule

    @staticmethod
    def attach(llm: Any) -> SlotStats | None:
        """Stats on ``llm``'s scheduler, or None when the engine core runs in another process."""
        core = getattr(llm.llm_engine.engine_core, "engine_core", None)
        scheduler = getattr(core, "scheduler", None)
        return None if scheduler is None else SlotStats(scheduler, largest_graph_tokens(llm.llm_engine.vllm_config))

    def _reset(self) -> None:
        self.steps = self.past_graphs = self.running = self.held = self.max_held = self.max_present = 0
        self.busy_s, self.timed = [0.0, 0.0], [0, 0]  # [within the graphs, past them]
        self._last_busy, self._last_past = None, False

    def start(self) -> None:
        """Forget what was counted (warm-up) and count from the next step on."""
        self._reset()
        self.on = True

    def stop(self) -> None:
        """Stop counting (what was counted stays)."""
        self.on = False

    def summary(self) -> dict[str, float | None]:
        """Means over the steps that scheduled work; ``step_ms`` is the mean time from such a
        step's schedule to the next one's (the last step of the run is not timed), and
        ``step_ms_within_graphs`` / ``step_ms_past_graphs`` the same over the steps of at most / more
        than ``graph_tokens`` tokens (None where no such step was timed)."""
        n = max(1, self.steps)

        def mean_ms(past: bool) -> float | None:
            return self.busy_s[past] * 1e3 / self.timed[past] if self.timed[past] else None

        return {"slot_steps": self.steps, "mean_running": self.running / n, "mean_slots_held": self.held / n,
                "max_slots_held": self.max_held, "max_adapters_scheduled": self.max_present,
                "step_ms": sum(self.busy_s) * 1e3 / max(1, self.steps - 1), "graph_tokens": self.graph_tokens,
                "steps_past_graphs": self.past_graphs, "step_ms_within_graphs": mean_ms(False),
                "step_ms_past_graphs": mean_ms(True)}


def largest_graph_tokens(vllm_config: Any) -> int:
    """The token count of the engine's largest CUDA graph: ``CompilationConfig.max_cudagraph_capture_size``
    (``config/compilation.py:695`` in vLLM 0.33.0, :847 in 0.34.0; 512 on Hopper under vLLM's defaults,
    ``config/vllm.py:2460-2470`` of 0.33.0), 0 with CUDA graphs off. vLLM dispatches a step of more tokens
    without a graph (``v1/worker/gpu/cudagraph_utils.py:523-550`` in 0.33.0, the V2 runner's)."""
    cc = vllm_config.compilation_config
    if getattr(cc.cudagraph_mode, "name", "NONE") == "NONE":
        return 0
    return int(cc.max_cudagraph_capture_size or 0)


def expected_scheduler(bundle: bool, async_scheduling: bool) -> str:
    """The engine core's scheduler class for a run: LoRazor's wherever a bundle is served (it keys
    released blocks for the prefix cache; slot hand-back, ``LORAZOR_SLOTS``, is a switch inside it),
    else vLLM's; their async variants with async scheduling (``config/scheduler.py:231-239``)."""
    name = "AsyncScheduler" if async_scheduling else "Scheduler"
    return "Release" + name if bundle else name


def predicted_slots(wl: Workload, max_loras: int, release: bool, opts: dict[str, Any],
                    arrival_steps: Sequence[int] | None = None, graph_tokens: int | None = None) -> dict[str, float]:
    """The capacity model (:func:`serve_bridge.capacity.simulate`) on exactly this workload:
    its steps, mean running requests, mean slots held, slot loads and share of token forwards
    with an adapter, under the engine's ``max_num_seqs`` and token budget; open loop with each
    arrival's step (``arrival_steps``); with ``graph_tokens``, also its steps of more tokens."""
    from serve_bridge import capacity

    n = len(wl.adapter)
    reqs = capacity.Requests(np.asarray(wl.adapter), np.asarray([len(p) for p in wl.prompt]),
                             np.asarray(wl.max_tokens), np.asarray(wl.releases()),
                             np.zeros(n, np.int64) if arrival_steps is None else np.asarray(arrival_steps, np.int64))
    res = capacity.simulate(reqs, max_loras, release=release, max_num_seqs=opts["max_num_seqs"],
                            token_budget=opts["max_num_batched_tokens"], graph_tokens=graph_tokens)
    return {"model_steps": res.steps, "model_mean_running": res.mean_running,
            "model_mean_slots_held": res.mean_occupancy, "model_slot_loads": res.slot_loads,
            "model_lora_share": res.lora_share} | (
        {} if graph_tokens is None else {"model_steps_past_graphs": res.steps_past_graphs})


def _wait_prepared(work: Path, timeout_s: float = 900) -> None:
    start = time.time()
    while not (work / "prepared.json").exists():
        if (work / "prepare.failed").exists():
            raise RuntimeError(f"preparation failed: {(work / 'prepare.failed').read_text()[-2000:]}")
        if time.time() - start > timeout_s:
            raise TimeoutError(f"{work}/prepared.json did not appear within {timeout_s:.0f} s")
        time.sleep(0.2)


def serve_open_loop(engine: Any, prompts: Sequence[Any], params: Sequence[Any], loras: Sequence[Any],
                    arrival: Sequence[float]) -> tuple[float, dict[str, float], list[int]]:
    """Submit request i at ``arrival[i]`` seconds through vLLM V1's ``LLMEngine.add_request`` and drive
    ``step()`` until all finish (``v1/engine/llm_engine.py:218`` and :296; outputs hold the request id
    given to add_request, ``v1/engine/output_processor.py:371``). Returns the wall time, the latency
    summary (TTFT counted from the scheduled arrival) and each request's token count."""
    n = len(prompts)
    first = [float("nan")] * n
    finish = [float("nan")] * n
    tokens = [0] * n
    done, nxt = 0, 0
    start = time.perf_counter()
    while done < n:
        now = time.perf_counter() - start
        while nxt < n and arrival[nxt] <= now:
            engine.add_request(f"r{nxt}", prompts[nxt], params[nxt], lora_request=loras[nxt])
            nxt += 1
        if not engine.has_unfinished_requests():
            if nxt >= n:
                raise RuntimeError(f"the engine has no unfinished request but {n - done} never finished")
            time.sleep(max(0.0, min(arrival[nxt] - now, 0.05)))
            continue
        for out in engine.step():
            i = int(out.request_id[1:])
            t = time.perf_counter() - start
            tokens[i] = len(out.outputs[0].token_ids)
            if tokens[i] and first[i] != first[i]:  # NaN: no token seen yet
                first[i] = t
            if out.finished:
                finish[i] = t
                done += 1
    return time.perf_counter() - start, latency_summary(arrival, first, finish, tokens), tokens


def serve_offline(engine: Any, prompts: Sequence[Any], params: Sequence[Any],
                  loras: Sequence[Any]) -> tuple[float, list[int], list[float]]:
    """``LLM.generate``'s loop with each step timed: every request added at once through vLLM V1's
    ``LLMEngine.add_request``, then ``step()`` until none is unfinished, as ``LLM._run_engine`` does
    (``entrypoints/offline_utils.py:573-630``). ``params`` must ask for final outputs only
    (``RequestOutputKind.FINAL_ONLY``, what ``LLM`` sets, :561). Returns the wall time, each
    request's token count and each step's wall time (s). Prompts are raw token prompts, which
    ``add_request`` preprocesses itself (``v1/engine/input_processor.py:281-294``)."""
    n = len(prompts)
    for i in range(n):
        engine.add_request(f"r{i}", prompts[i], params[i], lora_request=loras[i])
    tokens = [-1] * n
    steps: list[float] = []
    clock = time.perf_counter
    start = clock()
    while engine.has_unfinished_requests():
        t = clock()
        outs = engine.step()
        steps.append(clock() - t)
        for out in outs:
            if out.finished:
                tokens[int(out.request_id[1:])] = len(out.outputs[0].token_ids)
    elapsed = clock() - start
    if -1 in tokens:
        raise RuntimeError(f"{tokens.count(-1)} of {n} requests never finished")
    return elapsed, tokens, steps


def timed_runs(engine: Any, prompts: Sequence[Any], params: Sequence[Any], loras: Sequence[Any], repeats: int,
               after_first: Callable[[], None] | None = None, turns: Turns | None = None,
               before_each: Callable[[], None] | None = None) -> tuple[list[float], list[int], list[float]]:
    """:func:`serve_offline` ``repeats`` times in the same engine: every run's wall time, and the
    first run's token counts and step times (``after_first`` is called right after it, e.g. to stop
    counting). Every run must produce the first run's token counts. With ``turns`` each run waits
    for its turn and reports its time (:mod:`benchmarks.serving.interleave`), and the runs end early
    where the orchestrator ends the rounds (at least one run); else back to back. ``before_each``
    is called right before each run, inside its turn (e.g. :func:`probe`: no other engine runs then)."""
    runs: list[float] = []
    tokens: list[int] = []
    steps: list[float] = []
    for i in range(repeats):
        if turns is not None and not turns.wait():
            if not runs:
                raise RuntimeError("the orchestrator ended the rounds before this engine's first turn")
            break
        if before_each is not None:
            before_each()
        elapsed, got, step_s = serve_offline(engine, prompts, params, loras)
        if turns is not None:
            turns.done(elapsed)
        if i == 0:
            tokens, steps = got, step_s
            if after_first is not None:
                after_first()
        elif got != tokens:
            raise RuntimeError(f"run {i + 1} produced other token counts than the first")
        runs.append(elapsed)
    return runs, tokens, steps


def run_engine(mode: str, n: int, skewed: bool, n_requests: int, seed: int, work: Path, result: Path,
               settings: VllmSettings = VllmSettings(), model: str = "llama3b",
               arrival_rate: float | None = None, lora_target_modules: Sequence[str] | None = None,
               tensor_parallel_size: int = 1, profile_steps: int = 0, profile_python: bool = False,
               max_loras: int | None = None, slots: bool = True, max_cpu_loras: int | None = None,
               rank: int = RANK, repeats: int = 1, turns: Turns | None = None) -> None:
    """Start one engine, serve one warm-up request per adapter, then time the workload offline
    ``repeats`` times (:func:`timed_runs`; req/s from the median run; with ``turns``, each run when
    the orchestrator says, the engine sharing the GPU with the other modes' through a KV cache of
    :func:`interleaved_kv_cache_bytes`), or serve it open-loop at
    ``arrival_rate`` requests/s (Poisson). Slot statistics (:class:`SlotStats`), step times and the
    release counters of the first timed run go into the result beside the capacity model's
    prediction for it (:func:`predicted_slots`).
    With ``profile_steps`` > 0, afterwards profile that many steps of a fresh copy of the workload
    (:func:`profile_workload`; with ``profile_python`` also under cProfile) into ``<result stem>_profile.md``."""
    import torch
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import RequestOutputKind

    wl = workload_for(n, n_requests, skewed, seed, MODELS[model])
    if mode == "stockfix":  # in this process, where the in-process engine's worker runs
        from serve_bridge.vllm import lora_manager, versions

        lora_manager.install(versions.current().sync_allowed)
    t0 = time.time()
    opts = engine_options(n, mode, lora_target_modules, tensor_parallel_size, settings, max_loras, max_cpu_loras, rank,
                          interleaved_kv_cache_bytes(MODELS[model]) if turns is not None else None)
    llm = LLM(model=str(work / "model"), **opts)
    startup = time.time() - t0
    stats = SlotStats.attach(llm)
    per_rank = llm.collective_rpc(engine_classes)  # one per tensor-parallel rank
    for classes in per_rank:
        check_engine_classes(mode, classes)
    classes = per_rank[0]
    waited = time.time()
    _wait_prepared(work)
    waited = time.time() - waited

    def lora(a: int) -> LoRARequest | None:
        if mode == "nolora":
            return None
        return LoRARequest(adapter_name(a), a + 1, str(work / "adapters" / adapter_name(a)))

    t = time.time()
    llm.generate([{"prompt_token_ids": wl.prompt[a % n_requests][:16]} for a in range(n)],
                 [SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False) for _ in range(n)],
                 lora_request=[lora(a) for a in range(n)], use_tqdm=False)
    warmup = time.time() - t
    counters = None
    if mode in STEPTRIM_MODES:
        from serve_bridge.vllm.rpc import lorazor_counters

        before = llm.collective_rpc(lorazor_counters)[0]
    after: dict[str, Any] = {}

    def first_run_done() -> None:
        if stats is not None:
            stats.stop()
        if mode in STEPTRIM_MODES:
            after.update(llm.collective_rpc(lorazor_counters)[0])
    # Offline, only final outputs, as LLM.generate asks for; open-loop needs every step's (TTFT).
    kind = RequestOutputKind.CUMULATIVE if arrival_rate else RequestOutputKind.FINAL_ONLY
    params = [SamplingParams(max_tokens=m, ignore_eos=True, detokenize=False, output_kind=kind)
              for m in wl.max_tokens]
    prompts = [{"prompt_token_ids": p} for p in wl.prompt]
    loras = [lora(a) for a in wl.adapter]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    probes: list[dict[str, float]] = []  # each run's, taken in its turn
    if turns is not None:
        turns.ready()
    if stats is not None:
        stats.start()
    timing: dict[str, Any] = {}  # open loop: TTFT/TPOT percentiles; offline: engine steps
    # LLM keeps its V1 LLMEngine as llm_engine (entrypoints/llm.py:338)
    if arrival_rate:
        probes.append(probe())
        elapsed, timing, lengths = serve_open_loop(llm.llm_engine, prompts, params, loras,
                                                    arrival_times(n_requests, arrival_rate, seed))
        first_run_done()
    else:
        runs, lengths, step_s = timed_runs(llm.llm_engine, prompts, params, loras, repeats, first_run_done, turns,
                                           lambda: probes.append(probe()))
        elapsed = float(np.median(runs))
        timing = step_summary(step_s) | {"elapsed_runs_s": runs}
    probed = {"probes": probes, "loadavg": list(os.getloadavg())}
    slot_info: dict[str, Any] = {"max_loras": opts.get("max_loras"), "slot_release": mode in STEPTRIM_MODES and slots}
    if stats is not None and mode != "nolora":
        want = expected_scheduler(mode in STEPTRIM_MODES, settings.async_scheduling)
        if stats.scheduler_class != want:
            raise RuntimeError(f"mode {mode}: the engine core runs {stats.scheduler_class}, expected {want}")
        slot_info |= stats.summary() | {"scheduler": stats.scheduler_class}
        step_s = max(slot_info["step_ms"], 1e-3) / 1e3  # open loop: arrivals to steps at the measured step time
        arrival = ([int(t / step_s) for t in arrival_times(n_requests, arrival_rate, seed)]
                   if arrival_rate else None)
        slot_info |= predicted_slots(wl, opts["max_loras"], slot_info["slot_release"], opts, arrival,
                                     slot_info["graph_tokens"])
    if lengths != wl.max_tokens:
        bad = sum(a != b for a, b in zip(lengths, wl.max_tokens))
        raise RuntimeError(f"{bad} requests did not produce max_tokens tokens")
    if mode in STEPTRIM_MODES:
        decode = after["decode_forwards"] - before["decode_forwards"]
        skipped = after["skipped_forwards"] - before["skipped_forwards"]
        counters = {"decode_forwards": decode, "skipped_forwards": skipped,
                    "released_requests": after["released_requests"] - before["released_requests"],
                    "realized_skip": skipped / decode if decode else 0.0,
                    "decision_ms_mean": after["decision_ms_mean"], "decision_steps": after["decision_steps"],
                    "mapping_ms_total": after["mapping_ms_total"] - before["mapping_ms_total"],
                    "runner_steps": after["steps"] - before["steps"],
                    "resolve_host_ms_mean": after["resolve_host_ms_mean"]}
    out = {"mode": mode, "model": model, "adapters": n, "skewed": skewed, "requests": n_requests, "seed": seed,
           "elapsed_s": elapsed, "req_per_s": n_requests / elapsed, "output_tokens": sum(lengths),
           "output_tok_per_s": sum(lengths) / elapsed, "planned_skip": wl.planned_skip,
           "k_min": min(wl.k), "k_max": max(wl.k), "startup_s": startup, "waited_for_prepare_s": waited,
           "warmup_s": warmup, **classes, "specialize_active_lora": specializes(mode, settings),
           "settings": settings.as_dict(),
           "arrival_rate": arrival_rate, **timing, **probed, **slot_info,
           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "counters": counters}
    result.write_text(json.dumps(out, indent=1))
    if profile_steps > 0:  # after the result is written: a failing profiler loses no measurement
        try:
            report = profile_workload(llm.llm_engine, prompts, params, loras, profile_steps, profile_python)
        except Exception as e:  # noqa: BLE001 - reported in the file the reader looks at
            report = f"profiling failed: {type(e).__name__}: {e}\n"
        result.with_name(result.stem + "_profile.md").write_text(
            f"# {mode}, N={n}: {profile_steps} engine steps of the workload, after {PROFILE_SKIP} unprofiled\n\n"
            + report)


PROFILE_SKIP = 40  # steps before the profiled window: past the ramp-up, to the steady mixed steps


def profile_workload(engine: Any, prompts: Sequence[Any], params: Sequence[Any], loras: Sequence[Any],
                     n_steps: int, python: bool = False) -> str:
    """Add the workload again (request ids ``p<i>``), run :data:`PROFILE_SKIP` steps, profile the
    next ``n_steps`` (:mod:`benchmarks.serving.step_profile`), with ``python`` the ``n_steps`` after those
    under cProfile too, abort what is left, and return the summary.
    With every request queued at once, the running batch fills up over the first steps (about ten
    new prompts per 2048-token step); after that, each step decodes the running requests and
    prefills the few that replace those finished: the mixed steps that make up most of an offline
    run."""
    from benchmarks.serving.step_profile import profile_steps, python_profile, summarize

    ids = [f"p{i}" for i in range(len(prompts))]
    for i, rid in enumerate(ids):
        engine.add_request(rid, prompts[i], params[i], lora_request=loras[i])
    prof, wall, done = profile_steps(engine.step, engine.has_unfinished_requests, n_steps, skip=PROFILE_SKIP)
    report = summarize(prof, wall, done)
    if python:
        report += "\n" + python_profile(engine.step, engine.has_unfinished_requests, n_steps)[0]
    engine.abort_request(ids)  # external ids (v1/engine/llm_engine.py:212-216)
    while engine.has_unfinished_requests():
        engine.step()
    return report


# -- orchestration ----------------------------------------------------------------------------


VERSION_OF_VLLM = "import importlib.metadata as m; print(m.version('vllm'))"


def vllm_lines(pythons: Sequence[str]) -> list[tuple[str, str]]:
    """(vLLM version, interpreter) of each interpreter, the version read from its own package metadata
    in a subprocess; ValueError names an interpreter that cannot run, one without vLLM, and two with
    the same version."""
    lines: dict[str, str] = {}  # version → interpreter
    for python in pythons:
        try:
            found = subprocess.run([python, "-c", VERSION_OF_VLLM], capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ValueError(f"--vllm-python {python}: cannot run it ({e})") from None
        version = found.stdout.strip()
        if found.returncode != 0 or not version:
            raise ValueError(f"--vllm-python {python}: no vLLM installed for that interpreter")
        if version in lines:
            raise ValueError(f"--vllm-python: {lines[version]} and {python} both have vLLM {version}")
        lines[version] = python
    return list(lines.items())


def line_tag(line: str | None) -> str:
    """``"_vllm0_34_0"``: what an engine's file and cache names add for its vLLM line (the dots as
    underscores: a result's stem has no dot); empty for the one installed."""
    return "" if line is None else "_vllm" + line.replace(".", "_")


def versions_named(lines: Sequence[tuple[str | None, str]]) -> str:
    """``"0.33.0 and 0.34.0"``: the versions of :func:`vllm_lines`."""
    return " and ".join(str(v) for v, _ in lines)


def schedule(modes: Sequence[str], passes: int) -> list[tuple[int, str]]:
    """(pass, mode) in run order: pass 0 runs ``modes`` as given, and each later pass reverses
    the previous one's order, so a drift of the machine over the call (the host's load, the
    GPU's clocks) falls on every mode alike once ratios are taken within each pass
    (:func:`benchmarks.serving.interleave.round_order`, the order of interleaved rounds too)."""
    return [(k, m) for k in range(passes) for m in interleave.round_order(modes, k)]


def orchestrate(args: argparse.Namespace) -> int:
    start = time.time()
    out, work = args.out, args.work
    cfg = MODELS[args.model]
    settings = vllm_settings.from_arguments(args)
    needed = max(host_bytes_needed(cfg, args.rank, n, args.max_loras, args.max_cpu_loras) for n in args.adapters)
    try:
        lines = vllm_lines(args.vllm_python) if args.vllm_python else [(None, sys.executable)]
    except ValueError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    if args.interleave:  # every LoRA mode's engine alive at once
        needed *= max(1, sum(m != "nolora" for m in args.modes)) * len(lines)
    available = host_memory_available()
    if problem := host_memory_problem(needed, available):  # before anything is written
        print(f"bench: {problem}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    (work / "prepare.failed").unlink(missing_ok=True)
    runs = schedule(args.modes, args.passes)
    drop_stale_stamp(work, args.adapters, cfg, args.rank)
    common = ["--work", str(work), "--requests", str(args.requests), "--seed", str(args.seed), "--model", args.model,
              "--rank", str(args.rank),
              *settings.arguments()] + (["--skewed"] if args.skewed else []) + (
        ["--arrival-rate", str(args.arrival_rate)] if args.arrival_rate else []) + (
        ["--lora-target-modules", *args.lora_target_modules] if args.lora_target_modules else []) + (
        ["--tensor-parallel-size", str(args.tensor_parallel_size)]) + (["--profile-python"] if args.profile_python else []) + (
        ["--profile-steps", str(args.profile_steps)] if args.profile_steps else []) + (
        ["--max-loras", str(args.max_loras)] if args.max_loras else []) + (
        ["--max-cpu-loras", str(args.max_cpu_loras)] if args.max_cpu_loras else []) + (
        ["--no-slot-release"] if args.no_slot_release else []) + (
        ["--repeats", str(args.repeats)] if args.repeats > 1 else [])
    latency = bool(args.arrival_rate)
    me = [sys.executable, "-m", "benchmarks.serving.bench"]
    prep_log = open(out / "prepare.log", "w")
    prep = subprocess.Popen(me + ["--phase", "prepare", "--adapters", *map(str, args.adapters)] + common,
                            stdout=prep_log, stderr=subprocess.STDOUT)
    workloads = {n: workload_for(n, args.requests, args.skewed, args.seed, cfg) for n in args.adapters}
    w0 = workloads[args.adapters[0]]
    preamble = [
        f"LoRazor serve_bridge throughput: stock vLLM {versions_named(lines) if args.vllm_python else installed_vllm()} "
        "vs the LoRazor plugin (GridTrim kernels, "
        "StepTrim release, both), same machine, back-to-back subprocesses; vLLM settings of every mode: "
        + settings.described(),
        f"model: {MODEL_NAME[args.model]} config ({cfg['architectures'][0]}), dummy weights, bf16; rank-{args.rank} "
        f"random peft adapters on q,k,v,o,gate,up,down ({DISTINCT_WEIGHTS} distinct weight files hard-linked under the "
        "N adapter names: each name is loaded from disk and written into its slot on its own, as vLLM does)",
        f"workload: {args.requests} requests, prompts {PROMPT_LEN[0]}-{PROMPT_LEN[1]} tokens, outputs "
        f"{OUTPUT_LEN[0]}-{OUTPUT_LEN[1]} tokens ({sum(w0.max_tokens)} in all), ignore_eos, seed {args.seed}, "
        f"{'skewed: 80% of requests on 20% of adapters' if args.skewed else 'uniform traffic'}, "
        + (f"open-loop Poisson arrivals at {args.arrival_rate:g} req/s through LLMEngine.add_request/step "
           "(TTFT from the scheduled arrival; TPOT = (finish - first token) / (tokens - 1))"
           if latency else "offline: all requests added at once, then LLMEngine.step() until done (LLM.generate's "
           "loop, with each step timed)" + (f"; {args.repeats} timed runs per engine, req/s from the median, steps "
                                             "and slot statistics from the first" if args.repeats > 1 else "")
           + ("; interleaved: every mode's engine alive at once (KV cache "
              f"{interleaved_kv_cache_bytes(cfg) / 2**30:.1f} GiB each), the runs in rounds, one engine at a time, "
              "every other round reversed" if args.interleave else "")),
        "schedule: profiled k per adapter for ~50% skipped decode forwards; planned skip "
        + ", ".join(f"N={n}: {w.planned_skip:.3f} (k {min(w.k)}-{max(w.k)})" for n, w in workloads.items()),
        "engine: " + json.dumps(engine_options(0, lora_target_modules=args.lora_target_modules,
                                               tensor_parallel_size=args.tensor_parallel_size, settings=settings,
                                               rank=args.rank)
                                | {"max_loras": args.max_loras or "N",
                                   "max_cpu_loras": f"max({args.max_cpu_loras or 'N'}, max_loras)"}),
        f"host: one adapter {adapter_bytes(cfg, args.rank) / 2**20:.1f} MiB; a LoRA engine keeps up to "
        f"{needed / 2**30:.1f} GiB of adapters in host memory (loaded and a pinned slot image each)"
        + (f", {available / 2**30:.0f} GiB available at the start" if available else ""),
        "slots: " + ("steptrim/both keep vLLM's accounting (LORAZOR_SLOTS=0)" if args.no_slot_release else
                     "steptrim/both hand a released request's adapter slot on (LoRazor's scheduler); mean running "
                     "requests and slots held per scheduled step, beside the capacity model's prediction "
                     "(serve_bridge.capacity on the same requests; open loop at the measured step time)"),
        "modes: stock = vLLM's runner and LoRA kernels; gridtrim = LORAZOR_GRIDTRIM=1 (our punica wrapper, "
        "work-list LoRA kernels, no release); steptrim = LORAZOR_BUNDLE (StepTrim runner, profiled release, vLLM's "
        "LoRA kernels); both = the two together; nolora = the backbone without LoRA (same requests, no adapter); "
        "stockfix = stock with the plugin's one registry read per step in vLLM's worker LoRA manager, which every "
        "LoRazor mode has. Each engine's runner, punica wrapper and registry path are checked.",
        "specialize_active_lora: " + (
            "on for stock, steptrim and stockfix (one decode graph per batch size and adapter-count bucket); off for "
            "gridtrim and both, whose kernels ignore the adapter count" if settings.specialize_active_lora else
            "off (vLLM's default) in every mode: one LoRA graph per batch size (plus the no-LoRA one)"),
    ]
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    if args.append and (out / "bench.json").exists():  # one table from several calls
        earlier = json.loads((out / "bench.json").read_text())
        if earlier["preamble"][:3] != preamble[:3]:
            print(f"{out}/bench.json holds another vLLM, model, workload or timing: give another --out", file=sys.stderr)
            prep.kill()
            prep_log.close()
            return 2
        ran = {(m, line) for m in args.modes for line, _ in lines}
        rows, notes = [r for r in earlier["rows"] if (r["mode"], r.get("vllm")) not in ran], earlier["notes"]
    notes.append(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: modes {' '.join(args.modes)}")

    def flush() -> None:
        (out / "bench.txt").write_text(render(preamble, rows, notes, latency) + slot_table(rows))
        (out / "bench.json").write_text(json.dumps({"preamble": preamble, "rows": rows, "notes": notes}, indent=1))

    flush()

    def stem_of(n: int, mode: str, pass_: int = 0, line: str | None = None) -> Path:
        """Where the engine of (n, mode, pass, vLLM line) writes: its ``.json`` result and ``.log``,
        without suffix."""
        return out / (_tag(n, args.skewed) + (f"_m{args.max_loras}" if args.max_loras else "")
                      + (f"_p{pass_ + 1}" if pass_ else "") + f"_{mode}{line_tag(line)}")

    def env_of(mode: str, n: int) -> dict[str, str]:
        return mode_env(mode, dict(os.environ), bundle_dir(work, n, args.skewed, args.requests, args.seed),
                        {adapter_name(a): work / "adapters" / adapter_name(a) for a in range(n)},
                        slots=not args.no_slot_release)

    def record(n: int, mode: str, pass_: int, label: str, stem: Path, error: str | None, took_s: float,
               line: str | None = None) -> int:
        """Add the row of the engine whose result is ``stem``.json (or an error row), with its vLLM
        ``line`` where the run has several; 1 on error."""
        result = stem.with_suffix(".json")
        if error is None and not result.exists():
            error = "wrote no result"
        named = {"vllm": line} if line else {}
        if error is None:
            row = json.loads(result.read_text()) | {"pass": pass_} | named
            print(f"[{time.time() - start:5.0f} s] {label}: {row['req_per_s']:.1f} req/s "
                  f"(generate {row['elapsed_s']:.1f} s, start-up {row['startup_s']:.0f} s, warm-up "
                  f"{row['warmup_s']:.1f} s)", flush=True)
            notes.append(run_note(label, row, took_s))
        else:
            row = {"mode": mode, "adapters": n, "skewed": args.skewed, "pass": pass_, "error": error,
                   "settings": settings.as_dict()} | named
            print(f"{label}: {error}\n{stem.with_suffix('.log').read_text()[-3000:]}", flush=True)
        rows.append(row)
        flush()
        return int(error is not None)

    def interleaved(n: int) -> int:
        """Every mode's engine alive at once, the timed runs in rounds (:mod:`benchmarks.serving.interleave`)."""
        left = args.budget_s - (time.time() - start)
        try:
            prep.wait(timeout=max(1.0, left))
        except subprocess.TimeoutExpired:
            notes.append(f"N={n}: adapters not written within the budget")
            flush()
            return 1
        if prep.returncode != 0:
            notes.append(f"preparation failed (rc {prep.returncode}), see prepare.log")
            flush()
            return 1
        t = time.time()
        print(f"[{t - start:5.0f} s] N={n}: starting {', '.join(args.modes)} together"
              + (f", each on vLLM {versions_named(lines)}" if len(lines) > 1 else ""), flush=True)
        engines, logs = [], []
        for line, python in lines:
            for mode in args.modes:
                stem = stem_of(n, mode, line=line)
                stem.with_suffix(".json").unlink(missing_ok=True)
                logs.append(open(stem.with_suffix(".log"), "w"))
                engines.append(interleave.spawn(
                    mode, [python, *me[1:], "--phase", "run", "--mode", mode, "--adapters", str(n),
                           "--result", str(stem.with_suffix(".json"))] + common,
                    env_of(mode, n) | placement.compile_cache(work, mode + line_tag(line)),
                    logs[-1], line))
        deadline = start + args.budget_s
        interleave.await_ready(engines, deadline)
        rounds = interleave.run_rounds(engines, args.repeats, deadline)
        codes = interleave.finish(engines, max(30.0, deadline - time.time()))
        for log in logs:
            log.close()
        notes.extend(round_notes(n, engines, rounds.orders))
        if rounds.stopped:
            notes.append(f"N={n}: {rounds.stopped}")
        failed = 0
        for e in engines:
            code = codes[e.name]
            error = e.error or (None if code == 0 else "timed out" if code == "timeout" else f"failed (rc {code})")
            failed |= record(n, e.mode, 0, f"N={n} {e.name}", stem_of(n, e.mode, line=e.line), error,
                             time.time() - t, e.line)
        return failed

    rc = 0
    for n in args.adapters:
        if args.interleave:
            rc |= interleaved(n)
            continue
        for pass_, mode in runs:
            stem = stem_of(n, mode, pass_)
            label = f"N={n} {mode}" + (f" (pass {pass_ + 1})" if pass_ else "")
            left = args.budget_s - (time.time() - start)
            if left < args.min_run_s:
                notes.append(f"{label}: not run, {left:.0f} s of the {args.budget_s:.0f} s budget left")
                flush()
                continue
            if mode in STEPTRIM_MODES and prep.poll() is None:
                try:
                    prep.wait(timeout=left)
                except subprocess.TimeoutExpired:
                    notes.append(f"{label}: adapters not written within the budget")
                    flush()
                    continue
            if prep.poll() not in (None, 0):
                notes.append(f"preparation failed (rc {prep.returncode}), see prepare.log")
                flush()
                return 1
            env = env_of(mode, n)
            result = stem.with_suffix(".json")
            result.unlink(missing_ok=True)
            t = time.time()
            print(f"[{time.time() - start:5.0f} s] {label}: starting ({left:.0f} s left)", flush=True)
            with open(stem.with_suffix(".log"), "w") as log:
                try:
                    code = subprocess.run(me + ["--phase", "run", "--mode", mode, "--adapters", str(n),
                                                "--result", str(result)] + common,
                                          env=env, stdout=log, stderr=subprocess.STDOUT, timeout=left).returncode
                except subprocess.TimeoutExpired:
                    code = "timeout"
            rc |= record(n, mode, pass_, label, stem, None if code == 0 else
                         "timed out" if code == "timeout" else f"failed (rc {code})", time.time() - t)
    if prep.poll() is None:
        prep.kill()
    prep_log.close()
    print((out / "bench.txt").read_text(), flush=True)
    return rc


def main(argv: Sequence[str] | None = None) -> int:
    ap = Parser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/lorazor_bench_out")))
    ap.add_argument("--work", type=Path, default=Path("/tmp/lorazor_bench"))
    ap.add_argument("--adapters", type=number("positive_int"), nargs="+", default=[128, 4],
                    help="adapter counts, run in this order")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(DEFAULT_MODES),
                    help="modes to run, in this order (default: stock gridtrim steptrim both; nolora, the "
                         "backbone without LoRA, is the ceiling; stockfix, stock with the plugin's registry fix "
                         "alone, isolates what the kernels and release add)")
    ap.add_argument("--append", action="store_true",
                    help="keep the rows of OUT/bench.json (same model and workload) from other modes: a table "
                         "built over several calls, one mode or two each")
    ap.add_argument("--passes", type=number("positive_int"), default=1,
                    help="run the modes this many times per adapter count, each pass in the reverse order of "
                         "the one before; each row's ratio is to the stock row of its own pass")
    ap.add_argument("--repeats", type=number("positive_int"), default=1, metavar="R",
                    help="offline: time the workload R times in each engine, back to back, and report the "
                         "median run's req/s (steps, slot statistics and counters are the first run's); each "
                         "repeat costs one run, not an engine start")
    ap.add_argument("--interleave", action="store_true",
                    help="offline, with --repeats R ≥ 2: keep every mode's engine alive at once (each with a KV "
                         "cache just large enough, so they share the GPU) and time the R runs in rounds, one "
                         "engine at a time, every other round reversed: a drift of the machine falls on every "
                         "mode alike; the notes give each round's ratios")
    ap.add_argument("--vllm-python", nargs="+", default=None, metavar="PYTHON",
                    help="with --interleave: run every mode once per interpreter, each with its own vLLM install "
                         "(e.g. two virtual environments' bin/python), all engines taking turns in the same "
                         "rounds; each row names its vLLM version")
    ap.add_argument("--lora-target-modules", nargs="+", default=None, metavar="SUFFIX",
                    help="give LoRA layers only to these module suffixes in every mode (e.g. qkv_proj o_proj "
                         "gate_up_proj down_proj); default: vLLM's, which also wraps embed_tokens and lm_head")
    ap.add_argument("--tensor-parallel-size", type=number("positive_int"), default=1,
                    help="GPUs per engine (every mode)")
    vllm_settings.add_arguments(ap)
    ap.add_argument("--model", choices=sorted(MODELS), default="llama3b",
                    help="dummy-weight model shape: Llama-3.2-3B (default), Mistral-7B-v0.3 or Llama-3.1-8B")
    ap.add_argument("--rank", type=number("positive_int"), default=RANK,
                    help="the adapters' LoRA rank (alpha = 2 × rank; default 8)")
    ap.add_argument("--skewed", action="store_true", help="80%% of requests on 20%% of the adapters")
    ap.add_argument("--max-loras", type=number("positive_int"), default=None, metavar="M",
                    help="adapter slots (vLLM's max_loras) in every LoRA mode; default: one per adapter. The "
                         "slot-bound workload: e.g. --adapters 512 --max-loras 32")
    ap.add_argument("--max-cpu-loras", type=number("positive_int"), default=None, metavar="C",
                    help="adapters vLLM keeps loaded in host memory (default: all of them, as a server that keeps "
                         "its tenants' adapters in host memory; raised to max_loras); with fewer than the adapters "
                         "served, adapters are reloaded from disk while serving")
    ap.add_argument("--no-slot-release", action="store_true",
                    help="steptrim/both keep vLLM's slot accounting (LORAZOR_SLOTS=0): released requests keep "
                         "their adapter's slot")
    ap.add_argument("--requests", type=number("positive_int"), default=N_REQUESTS)
    ap.add_argument("--seed", type=number("seed"), default=0)
    ap.add_argument("--arrival-rate", type=number("positive_number"), default=None, metavar="R",
                    help="serve open-loop with Poisson arrivals at R requests/s (LLMEngine add_request/step) "
                         "and report P50/P90 TTFT and TPOT; default: offline throughput (LLM.generate's loop)")
    ap.add_argument("--profile-steps", type=number("non_negative_int"), default=0, metavar="S",
                    help="after each timed run, profile S engine steps of a fresh copy of the workload "
                         "(torch.profiler: GPU busy fraction, top kernels, top host operators) into "
                         "OUT/<run>_profile.md")
    ap.add_argument("--profile-python", action="store_true",
                    help="with --profile-steps S: also S further steps under cProfile (Python functions by "
                         "cumulative and own time), in the same file")
    ap.add_argument("--budget-s", type=number("positive_number"), default=3600, help="stop starting engines past this")
    ap.add_argument("--min-run-s", type=number("non_negative_number"), default=40,
                    help="do not start an engine with less time left")
    ap.add_argument("--phase", choices=["all", "prepare", "run"], default="all", help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--turns", help=argparse.SUPPRESS)  # R,W: the interleaving pipes (interleave.spawn)
    args = ap.parse_args(argv)
    if args.repeats < 1 or (args.repeats > 1 and args.arrival_rate):
        ap.error("--repeats takes a whole number ≥ 1, and times offline runs only (not with --arrival-rate)")
    if args.interleave and (args.repeats < 2 or args.arrival_rate or args.passes > 1 or args.profile_steps):
        ap.error("--interleave times offline runs in rounds: give --repeats R ≥ 2, and no --arrival-rate, --passes "
                 "or --profile-steps")
    if args.vllm_python and not args.interleave:
        ap.error("--vllm-python compares vLLM installs in interleaved rounds: give --interleave --repeats R ≥ 2")
    if args.profile_python and not args.profile_steps:
        ap.error("--profile-python needs --profile-steps S (it profiles S steps after the torch-profiler window)")
    if args.phase == "prepare":
        try:
            prepare(args.work, args.adapters, args.skewed, args.requests, args.seed, MODELS[args.model], args.rank)
        except BaseException:
            import traceback

            args.work.mkdir(parents=True, exist_ok=True)
            (args.work / "prepare.failed").write_text(traceback.format_exc())
            raise
        return 0
    if args.phase == "run":
        run_engine(args.mode, args.adapters[0], args.skewed, args.requests, args.seed, args.work, args.result,
                   vllm_settings.from_arguments(args), args.model, args.arrival_rate, args.lora_target_modules,
                   args.tensor_parallel_size, args.profile_steps, args.profile_python, args.max_loras,
                   not args.no_slot_release, args.max_cpu_loras, args.rank, args.repeats,
                   Turns.from_arg(args.turns) if args.turns else None)
        return 0
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
