"""Calibration engine on vLLM 0.26.0, through serve_bridge's calibration mode (docs/design.md §3.3, §4).

:class:`VLLMEngine` has the interface of :class:`labeling.engines.hf.HFEngine` (``adapters``,
``hidden_size``, ``encode``, ``decode``, ``generate`` with the same GenRequest / GenResult), so
labeling, the sweep pass, the test stage and the agreement stage run on it unchanged.

How it maps the hf engine's semantics onto vLLM:

- **ON pass**: every request in one ``LLM.generate`` — greedy (temperature 0), its adapter's
  ``LoRARequest`` (slot i → ``adapters[i]``, NO_SLOT → none), ``max_tokens = max_new_tokens``,
  and exactly the hf engine's stop set: ``stop_token_ids`` = that set and ``ignore_eos=True``,
  which only turns off vLLM's own EOS lookup (``sampling_params.py:629-657``;
  ``v1/core/sched/utils.py:103-111`` then stops on ``stop_token_ids`` alone). The stop token
  is kept in ``token_ids`` (``v1/core/sched/scheduler.py:2013-2021``,
  ``v1/engine/detokenizer.py:41-42``), as the hf engine keeps it in ``tokens``.
- **Release, s_t, h_t**: the runner installed by ``LORAZOR_CALIBRATION=1`` makes StepTrim
  decisions with the pass's policy and records, per uid-tagged request, the realized release,
  the scorer's s_t at every forward and h_t at the capture set (:mod:`serve_bridge.calibration`),
  configured and read over ``collective_rpc`` around each ``generate``.
- **Forks** are decided post hoc: ``fork(result, t, s_t)`` is called in increasing t, exactly
  where the hf engine calls it (after forward t, for a request with an adapter, if token t+1
  is not its last and it is not released after forward t's decision), with a partial result
  holding what the hf engine's has at that point (scores and h_t up to t, release if ≤ t,
  no tokens yet).
- **OFF branches** by prefix replay: requests of prompt + ON tokens[:t+1] with the forced
  release position
  len(prompt) + t (``SamplingParams.extra_args``, :mod:`serve_bridge.runtime`): the adapter is
  applied to the positions ON consumed at forwards ≤ t and not from token t+1 on — OFF_t =
  profiled k = t — with ``max_tokens = max_new_tokens − (t+1)``. ``branches[t]`` = ON
  tokens[:t+1] + that output, the hf engine's layout. By default (``engine.pipeline``) a
  request's OFF branches join the ON pass's engine run as soon as its ON response finishes
  (:meth:`LocalBackend.run_pipelined`), so the ON pass's tail, when few long responses are
  left, runs next to OFF work instead of alone. Otherwise (``pipeline: false``, data-parallel
  replicas, or a pass with a release policy) they run as a second ``generate`` after it.
  Prefix caching is off by default (docs/design.md §4). With ``prefix_caching: true`` the bridge keys the
  KV blocks of forced releases by release position (:mod:`serve_bridge.vllm.prefix_cache`): an OFF
  branch then reuses the prompt and ON-prefix blocks its ON request computed with the adapter,
  instead of re-prefilling them, and passes with a release policy are refused.

The pure parts (capture set, fork planning, OFF requests, branch assembly, engine arguments,
sharding) are functions below, tested on CPU against the hf engine; the process-level part is
a backend holding ``LLM`` (:class:`LocalBackend`) or ``data_parallel_size`` of them in worker
processes (:class:`DataParallelBackend`).
"""
from __future__ import annotations

import atexit
import importlib
import json
import multiprocessing
import os
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from labeling.adapters import AdapterSpec, validate_adapter
from labeling.engines.chat import ChatIO
from labeling.engines.hf import ForkFn, GenRequest, GenResult
from serve_bridge.calibration import calibration_config, require_cacheable
from serve_bridge.runtime import REQUEST_ARGS_KEY
from serve_bridge.vllm.settings import BUNDLE_ENV, CALIBRATION_ENV, V2_RUNNER_ENV
from serve_bridge.steptrim import NO_SLOT, StepTrim

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # config/lora.py:27 MaxLoRARanks
ENGINE_OPTIONS = ("name", "dtype", "gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens",
                  "max_model_len", "tensor_parallel_size", "data_parallel_size", "enforce_eager", "max_lora_rank",
                  "max_cudagraph_capture_size", "progress", "pipeline", "prefix_caching")
RUNNER = "LoRazorGPUModelRunner"


@dataclass(frozen=True)
class VLLMRequest:
    """One request handed to vLLM.

    uid: the calibration record's key (ON pass), None for OFF branches.
    release_position: forced release (OFF branches): positions ≥ it run without the adapter.
    """

    prompt_ids: tuple[int, ...]
    slot: int
    max_tokens: int
    uid: str | None = None
    release_position: int | None = None

    def extra_args(self) -> dict[str, Any] | None:
        """``SamplingParams.extra_args`` (:func:`serve_bridge.runtime.request_args` layout)."""
        spec = {k: v for k, v in (("uid", self.uid), ("release_position", self.release_position)) if v is not None}
        return {REQUEST_ARGS_KEY: spec} if spec else None


# follow(k, tokens, record): the requests to start when request k of a pipelined run finishes.
FollowFn = Callable[[int, list[int], "dict[str, Any] | None"], Sequence[VLLMRequest]]


@dataclass
class Batch:
    """One ``generate``: generated tokens per request (in order) and the records by uid."""

    tokens: list[list[int]]
    records: dict[str, dict[str, Any]] = field(default_factory=dict)


# -- the pure parts ----------------------------------------------------------------------------

def capture_set(capture: Callable[[int], bool] | None, max_new_tokens: int) -> frozenset[int]:
    """The forwards t ∈ [0, max_new_tokens) whose h_t the hf engine would record."""
    return frozenset() if capture is None else frozenset(t for t in range(max_new_tokens) if capture(t))


def on_requests(requests: Sequence[GenRequest], max_new_tokens: int) -> list[VLLMRequest]:
    """The ON pass: each request tagged with its index as uid (GenRequest uids need not be unique)."""
    return [VLLMRequest(tuple(r.prompt_ids), r.slot, int(max_new_tokens), uid=str(i)) for i, r in enumerate(requests)]


def on_result(req: GenRequest, tokens: Sequence[int], record: Mapping[str, Any] | None, scored: bool) -> GenResult:
    """A GenResult from the ON tokens and the request's calibration record."""
    if record is None:
        raise RuntimeError(f"request {req.uid}: vLLM returned no LoRazor record; every vLLM process must run the "
                           f"LoRazor runner ({CALIBRATION_ENV}=1 and {V2_RUNNER_ENV}=0 before vLLM starts).")
    tokens = [int(x) for x in tokens]
    if record["forwards"] != len(tokens):
        raise RuntimeError(f"request {req.uid}: the runtime saw {record['forwards']} forwards for {len(tokens)} "
                           f"generated tokens (speculative decoding or a runner mismatch?).")
    res = GenResult(uid=req.uid, slot=req.slot, tokens=tokens, release=record["release"])
    if scored:
        res.scores = [float(s) for s in record["scores"]]
        if len(res.scores) != len(tokens):
            raise RuntimeError(f"request {req.uid}: {len(res.scores)} scores for {len(tokens)} forwards.")
    res.hidden = {int(t): torch.tensor(h, dtype=torch.float32) for t, h in record["hidden"].items()}
    return res


def fork_points(res: GenResult, fork: ForkFn) -> list[int]:
    """The t of every OFF branch the hf engine would fork from this finished ON result, calling
    ``fork`` exactly as it does: for a request with an adapter, in increasing t, after forward
    t's decision, only while token t+1 is not the last and the request is not released; with a
    partial result (scores and h_t up to t, release if ≤ t, tokens empty until it finishes)."""
    if res.slot == NO_SLOT:
        return []
    points = []
    partial = GenResult(uid=res.uid, slot=res.slot)
    for t in range(len(res.tokens)):
        s = res.scores[t] if res.scores else None
        if s is not None:
            partial.scores.append(s)
        if t in res.hidden:
            partial.hidden[t] = res.hidden[t]
        if res.release == t:
            partial.release = t
        if t == len(res.tokens) - 1 or partial.release is not None:
            break  # done (token t+1 is the last), or released: no fork now or later
        if fork(partial, t, s):
            points.append(t)
    return points


def plan_forks(results: Sequence[GenResult], fork: ForkFn) -> list[tuple[int, int]]:
    """(result index, t) of every OFF branch (:func:`fork_points`), request by request."""
    return [(i, t) for i, res in enumerate(results) for t in fork_points(res, fork)]


def off_request(req: GenRequest, res: GenResult, t: int, max_new_tokens: int) -> VLLMRequest:
    """OFF_t by prefix replay: prompt + ON tokens[:t+1], adapter off from position len(prompt)+t
    (token t+1, consumed by forward t+1), for the tokens the ON response had left."""
    if not 0 <= t < len(res.tokens) - 1:
        raise ValueError(f"request {req.uid}: no OFF branch at t={t} for an ON response of {len(res.tokens)} tokens")
    return VLLMRequest(tuple(req.prompt_ids) + tuple(res.tokens[:t + 1]), req.slot, max_new_tokens - (t + 1),
                       release_position=len(req.prompt_ids) + t)


def assemble_branches(results: Sequence[GenResult], plan: Sequence[tuple[int, int]],
                      outputs: Sequence[Sequence[int]]) -> None:
    """``results[i].branches[t]`` = ON tokens[:t+1] + the OFF continuation (hf engine layout)."""
    for (i, t), out in zip(plan, outputs, strict=True):
        results[i].branches[t] = results[i].tokens[:t + 1] + [int(x) for x in out]


def lora_rank(adapters: Sequence[AdapterSpec]) -> int:
    """The smallest vLLM ``max_lora_rank`` that holds every adapter's rank (rank_pattern included)."""
    rank = 1
    for spec in adapters:
        cfg = json.loads((Path(spec.path) / "adapter_config.json").read_text())
        rank = max([rank, int(cfg.get("r", 8)), *(int(v) for v in (cfg.get("rank_pattern") or {}).values())])
    for allowed in LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(f"adapter rank {rank} exceeds vLLM's largest max_lora_rank {LORA_RANKS[-1]}")


def llm_kwargs(model_dir: str, adapters: Sequence[AdapterSpec], options: Mapping[str, Any]) -> dict[str, Any]:
    """``vllm.LLM`` arguments from ``conf/engine/vllm.yaml`` options.

    Fixed by the bridge (``serve_bridge.vllm.settings.require_supported_engine``): LoRA on, async
    scheduling off. Prefix caching follows ``prefix_caching`` (default off): the bridge keys the
    blocks of forced releases (:mod:`serve_bridge.vllm.prefix_cache`), so OFF branches reuse their ON
    request's prefix blocks, and passes with a release policy are refused.
    ``max_lora_rank: auto`` → the adapters' largest rank, rounded up to a rank vLLM supports.
    ``max_cudagraph_capture_size`` (null: vLLM's ``min(2 · max_num_seqs, 512)``) goes into
    ``compilation_config``. ``data_parallel_size`` is not
    an ``LLM`` argument (vLLM 0.26 refuses it in one process, ``entrypoints/llm.py:280-292``): see
    :class:`DataParallelBackend`.
    """
    unknown = sorted(set(options) - set(ENGINE_OPTIONS))
    if unknown:
        raise ValueError(f"engine options {unknown} are not known to engine=vllm (conf/engine/vllm.yaml); known: "
                         f"{list(ENGINE_OPTIONS)}")
    if not adapters:
        raise ValueError("engine=vllm needs at least one adapter (the bridge runs with LoRA enabled).")
    rank = options.get("max_lora_rank", "auto")
    kw = {"model": str(model_dir), "tokenizer": str(model_dir), "dtype": options.get("dtype", "bfloat16"),
          "enable_lora": True, "max_loras": len(adapters), "max_cpu_loras": len(adapters),
          "max_lora_rank": lora_rank(adapters) if rank in (None, "auto") else int(rank),
          "enable_prefix_caching": bool(options.get("prefix_caching", False)), "async_scheduling": False,
          "gpu_memory_utilization": float(options.get("gpu_memory_utilization", 0.85)),
          "tensor_parallel_size": int(options.get("tensor_parallel_size", 1)),
          "enforce_eager": bool(options.get("enforce_eager", False)), "seed": 0}
    for key in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
        if options.get(key) is not None:
            kw[key] = int(options[key])
    if options.get("max_cudagraph_capture_size") is not None:
        kw["compilation_config"] = {"max_cudagraph_capture_size": int(options["max_cudagraph_capture_size"])}
    return kw


def shard(costs: Sequence[int], n: int) -> list[list[int]]:
    """Split request indices into ``n`` groups of about equal total cost (longest first onto the
    lightest group); each group in increasing index order."""
    groups: list[list[int]] = [[] for _ in range(n)]
    load = [0] * n
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        g = min(range(n), key=load.__getitem__)
        groups[g].append(i)
        load[g] += costs[i]
    return [sorted(g) for g in groups]


def stop_ids_for(model_dir: str, tokenizer: Any, spec: Any) -> set[int]:
    """The hf engine's stop set (``labeling.backbone.stop_token_ids``) without loading weights:
    the generation config as ``from_pretrained`` would give it to the model."""
    from transformers import AutoConfig, GenerationConfig

    from labeling.backbone import stop_token_ids

    try:
        gen = GenerationConfig.from_pretrained(model_dir)
    except OSError:
        gen = GenerationConfig.from_model_config(AutoConfig.from_pretrained(model_dir))
    return stop_token_ids(gen, tokenizer, spec)


def prepare_environment(environ: dict[str, str] | os._Environ = os.environ) -> None:
    """The variables every vLLM process must see before ``LLM`` starts: the calibration runtime
    (no bundle), the V1 runner, and the engine core in this process (so ``collective_rpc``
    callables need no insecure serialization, see :mod:`serve_bridge.vllm.rpc`)."""
    environ.pop(BUNDLE_ENV, None)
    environ[CALIBRATION_ENV] = "1"
    environ[V2_RUNNER_ENV] = "0"
    environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def _progress(desc: str) -> Callable[..., tqdm]:
    """A ``use_tqdm`` callable naming the pass (vLLM passes its own ``desc``,
    ``entrypoints/offline_utils.py:582-588``)."""
    def bar(*args: Any, **kwargs: Any) -> tqdm:
        inner = kwargs.pop("desc", "")
        return tqdm(*args, desc=f"{desc}: {inner.lower()}" if inner else desc, **kwargs)
    return bar


def _runner_name(worker: Any) -> str:
    return type(worker.model_runner).__name__


# -- backends: where LLM runs -------------------------------------------------------------------

class LocalBackend:
    """One ``vllm.LLM`` in this process (tensor parallel inside it)."""

    def __init__(self, llm: Any, adapters: Sequence[AdapterSpec], stop_ids: Iterable[int],
                 sampling_params_cls: Any = None, lora_request_cls: Any = None, final_only: Any = None) -> None:
        if sampling_params_cls is None or lora_request_cls is None:
            from vllm import SamplingParams
            from vllm.lora.request import LoRARequest
            from vllm.sampling_params import RequestOutputKind

            sampling_params_cls, lora_request_cls = SamplingParams, LoRARequest
            final_only = RequestOutputKind.FINAL_ONLY
        self.llm = llm
        self._final_only = final_only  # SamplingParams.output_kind of run_pipelined's requests
        self.slot_names = [a.name for a in adapters]
        self.stop_ids = sorted(int(i) for i in stop_ids)
        self._params = sampling_params_cls
        # lora_int_id must be > 0 and unique per adapter (lora/request.py:39-41)
        self.loras = [lora_request_cls(a.name, i + 1, str(a.path)) for i, a in enumerate(adapters)]
        self.max_model_len = int(llm.model_config.max_model_len)  # entrypoints/llm.py:341

    def check_runner(self) -> None:
        names = self.llm.collective_rpc(_runner_name)
        if any(n != RUNNER for n in names):
            raise RuntimeError(f"vLLM's workers run {names}, not the LoRazor runner: the serve_bridge plugin was not "
                               f"loaded in every vLLM process. Install the package (pip install -e .) or, on a machine "
                               f"without it, `source scripts/env.sh`.")

    def run(self, reqs: Sequence[VLLMRequest], config: Mapping[str, Any], desc: str, progress: bool) -> Batch:
        from serve_bridge.vllm.rpc import lorazor_calibrate, lorazor_captures

        if not reqs:
            return Batch([])
        params = [self.sampling_params(r) for r in reqs]
        loras = [self.lora_request(r) for r in reqs]
        self.llm.collective_rpc(lorazor_calibrate, args=(dict(config),))
        outs = self.llm.generate([{"prompt_token_ids": list(r.prompt_ids)} for r in reqs], params,
                                 lora_request=loras, use_tqdm=_progress(desc) if progress else False)
        records = self.llm.collective_rpc(lorazor_captures)[0]  # tensor-parallel ranks hold the same rows
        return Batch([list(o.outputs[0].token_ids) for o in outs], records)

    def run_pipelined(self, reqs: Sequence[VLLMRequest], config: Mapping[str, Any], follow: FollowFn,
                      desc: str, progress: bool) -> tuple[Batch, list[list[int]]]:
        """:meth:`run` of ``reqs``, with follow-up requests joining the same engine run as soon as
        the request they follow finishes: when request k returns its last token, its record is
        read by uid and ``follow(k, tokens, record)`` returns the requests to add now (OFF
        branches). They run under the same calibration config, so it must suit them too: being
        untagged, they are not recorded; and since an OFF branch's forced release must be its only
        release, the config must hold no release policy (:meth:`VLLMEngine.generate` pipelines
        full-LoRA passes only). Returns ``reqs``' Batch and the follow-ups' tokens, in the order
        ``follow`` returned them.

        It drives vLLM V1's ``LLMEngine`` as ``LLM.generate`` does (``add_request``, then ``step()``
        while requests are unfinished: ``entrypoints/offline_utils.py:573-630``), asking for final
        outputs only as ``LLM`` does (``output_kind`` FINAL_ONLY, :561). Request ids are ours
        (``on<k>``, ``off<j>``); outputs hold them (``v1/engine/output_processor.py:371``). On an
        error, the requests still running are aborted (``v1/engine/llm_engine.py:212``)."""
        from serve_bridge.vllm.rpc import lorazor_calibrate

        if config.get("policy") is not None:
            raise ValueError("run_pipelined: the calibration config holds a release policy, which would also act on "
                             "the OFF branches; run the pass with run() and the branches after it.")
        engine = self.llm.llm_engine  # entrypoints/llm.py:338
        if engine.has_unfinished_requests():
            raise RuntimeError("the vLLM engine has unfinished requests from another caller")
        self.llm.collective_rpc(lorazor_calibrate, args=(dict(config),))
        run = _PipelinedRun(self, engine, reqs, follow, tqdm(total=len(reqs), desc=desc) if progress else None)
        try:
            for k, r in enumerate(reqs):
                run.add(f"on{k}", r)
            run.drive()
        except BaseException:
            if run.pending:  # leave the engine clean for the next caller, as offline_utils.py:545-548 does
                engine.abort_request(sorted(run.pending))
            raise
        finally:
            if run.bar is not None:
                run.bar.close()
        return Batch(run.on_tokens, run.records), run.off_tokens

    def sampling_params(self, r: VLLMRequest, output_kind: Any = None) -> Any:
        """Greedy decoding with the hf engine's stop set (module docstring), ``r``'s token budget
        and LoRazor arguments; ``output_kind`` when given."""
        kind = {} if output_kind is None else {"output_kind": output_kind}
        return self._params(temperature=0.0, max_tokens=r.max_tokens, stop_token_ids=self.stop_ids, ignore_eos=True,
                            detokenize=False, extra_args=r.extra_args(), **kind)

    def lora_request(self, r: VLLMRequest) -> Any:
        return None if r.slot == NO_SLOT else self.loras[r.slot]

    def close(self) -> None:
        self.llm = None


class _PipelinedRun:
    """The state of one :meth:`LocalBackend.run_pipelined`: requests ``on<k>`` (``reqs``) and
    ``off<j>`` (follow-ups) in one vLLM engine run, their tokens, the ON records, and the ids
    not finished yet (aborted on an error)."""

    def __init__(self, backend: LocalBackend, engine: Any, reqs: Sequence[VLLMRequest], follow: FollowFn,
                 bar: tqdm | None) -> None:
        self.backend, self.engine, self.reqs, self.follow, self.bar = backend, engine, reqs, follow, bar
        self.on_tokens: list[list[int]] = [[] for _ in reqs]
        self.off_tokens: list[list[int]] = []
        self.records: dict[str, dict[str, Any]] = {}
        self.pending: set[str] = set()

    def add(self, request_id: str, r: VLLMRequest) -> None:
        # A raw token prompt: LLMEngine.add_request preprocesses it itself (v1/engine/input_processor.py:
        # 281-294, deprecated in favour of the Renderer's output but accepted by 0.26.0).
        self.engine.add_request(request_id, {"prompt_token_ids": list(r.prompt_ids)},
                                self.backend.sampling_params(r, self.backend._final_only),
                                lora_request=self.backend.lora_request(r))
        self.pending.add(request_id)

    def drive(self) -> None:
        """Step until no request is unfinished; after each step, read the records of the ON
        requests that finished in it and add their follow-ups."""
        from serve_bridge.vllm.rpc import lorazor_captures

        while self.engine.has_unfinished_requests():
            finished = []
            for out in self.engine.step():
                if not out.finished:
                    continue
                rid, tokens = out.request_id, [int(x) for x in out.outputs[0].token_ids]
                self.pending.discard(rid)
                if rid.startswith("on"):
                    self.on_tokens[int(rid[2:])] = tokens
                    finished.append(int(rid[2:]))
                else:
                    self.off_tokens[int(rid[3:])] = tokens
                if self.bar is not None:
                    self.bar.update(1)
            uids = [self.reqs[k].uid for k in finished if self.reqs[k].uid is not None]
            # tensor-parallel ranks hold the same records; rank 0's are read
            got = self.backend.llm.collective_rpc(lorazor_captures, kwargs={"uids": uids})[0] if uids else {}
            self.records |= got
            for k in finished:
                uid = self.reqs[k].uid
                for r in self.follow(k, self.on_tokens[k], None if uid is None else got.get(uid)):
                    self.add(f"off{len(self.off_tokens)}", r)
                    self.off_tokens.append([])
                    if self.bar is not None:
                        self.bar.total += 1
                        self.bar.refresh()


def build_local_backend(llm_args: Mapping[str, Any], adapters: Sequence[AdapterSpec],
                        stop_ids: Iterable[int]) -> LocalBackend:
    """Start ``LLM`` with the calibration runtime in every vLLM process and check its runner."""
    prepare_environment()
    import vllm

    from serve_bridge.vllm.settings import require_vllm_version

    require_vllm_version(vllm.__version__)
    from serve_bridge.vllm.model_runner import install

    # vLLM builds the runner from this module attribute (v1/worker/gpu_worker.py:412-416): patching
    # it here covers an engine in this process; worker processes (tensor parallel) rely on the
    # entry point, and check_runner() says so if they lack it.
    install()
    backend = LocalBackend(vllm.LLM(**llm_args), adapters, stop_ids)
    backend.check_runner()
    return backend


def _dp_worker(conn: Any, devices: str, factory: str, factory_args: tuple) -> None:
    """A data-parallel replica: builds a backend on ``devices`` and serves ``run`` calls."""
    os.environ["CUDA_VISIBLE_DEVICES"] = devices
    try:
        module, _, name = factory.partition(":")
        backend = getattr(importlib.import_module(module), name)(*factory_args)
        conn.send(("ready", backend.max_model_len))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            backend.close()
            conn.send(("stopped", None))
            return
        try:
            conn.send(("ok", backend.run(*msg[1:])))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


class DataParallelBackend:
    """``n`` independent engines, one process each on its own ``devices_per_replica`` GPUs;
    each ``run``'s requests are split among them by cost (prompt + max tokens).

    vLLM 0.26's ``LLM`` refuses ``data_parallel_size > 1`` in one process
    (``entrypoints/llm.py:280-292``); for the dense backbones calibrated here independent
    replicas are equivalent (no expert parallelism to coordinate). ``factory`` ("module:function")
    builds each replica's backend from ``factory_args`` in its process.
    """

    def __init__(self, n: int, devices_per_replica: int, factory: str, factory_args: tuple,
                 visible: Sequence[str] | None = None) -> None:
        if visible is None:
            env = os.environ.get("CUDA_VISIBLE_DEVICES")
            visible = env.split(",") if env else [str(i) for i in range(torch.cuda.device_count())]
        if len(visible) < n * devices_per_replica:
            raise ValueError(f"data_parallel_size={n} × tensor_parallel_size={devices_per_replica} needs "
                             f"{n * devices_per_replica} GPUs, {len(visible)} visible.")
        ctx = multiprocessing.get_context("spawn")
        self.conns, self.procs = [], []
        for rank in range(n):
            parent, child = ctx.Pipe()
            devices = ",".join(visible[rank * devices_per_replica:(rank + 1) * devices_per_replica])
            proc = ctx.Process(target=_dp_worker, args=(child, devices, factory, tuple(factory_args)),
                               name=f"lorazor-dp{rank}")
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        lens = [self._recv(rank, "ready") for rank in range(n)]
        self.max_model_len = min(lens)
        atexit.register(self.close)

    def _recv(self, rank: int, want: str) -> Any:
        kind, payload = self.conns[rank].recv()
        if kind == "error":
            raise RuntimeError(f"data-parallel replica {rank} failed:\n{payload}")
        if kind != want:
            raise RuntimeError(f"data-parallel replica {rank}: expected {want!r}, got {kind!r}")
        return payload

    def run(self, reqs: Sequence[VLLMRequest], config: Mapping[str, Any], desc: str, progress: bool) -> Batch:
        parts = shard([len(r.prompt_ids) + r.max_tokens for r in reqs], len(self.conns))
        for rank, idx in enumerate(parts):
            self.conns[rank].send(("run", [reqs[i] for i in idx], dict(config), f"{desc} [replica {rank}]",
                                   progress and rank == 0))
        tokens: list[list[int]] = [[] for _ in reqs]
        records: dict[str, dict[str, Any]] = {}
        for rank, idx in enumerate(parts):
            batch = self._recv(rank, "ok")
            for i, toks in zip(idx, batch.tokens, strict=True):
                tokens[i] = toks
            records.update(batch.records)  # uids are unique over the whole run
        return Batch(tokens, records)

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs):
            if proc.is_alive():
                try:
                    conn.send(("stop",))
                    conn.recv()
                except (EOFError, OSError, BrokenPipeError):
                    pass
                proc.join(timeout=60)
        self.conns, self.procs = [], []


# -- the engine ---------------------------------------------------------------------------------

class VLLMEngine(ChatIO):
    """Greedy multi-adapter generation on vLLM with StepTrim release, s_t / h_t capture and
    OFF branches by prefix replay; the interface of :class:`labeling.engines.hf.HFEngine`.

    backend: a :class:`LocalBackend` / :class:`DataParallelBackend` (or a stand-in with
    ``run`` and ``max_model_len``); build one from the config with :meth:`from_config`.
    prefix_caching: whether the backend's engines cache prefixes (then passes with a release
    policy are refused, :func:`serve_bridge.calibration.require_cacheable`).
    """

    def __init__(self, backend: Any, tokenizer: Any, adapters: Sequence[AdapterSpec], stop_ids: Iterable[int],
                 hidden_size: int, progress: bool = True, pipeline: bool = True, prefix_caching: bool = False) -> None:
        self.backend = backend
        self.pipeline = pipeline
        self.prefix_caching = prefix_caching
        self.tokenizer = tokenizer
        self.adapters = list(adapters)
        self.eos_ids = set(int(i) for i in stop_ids)
        self.hidden_size = int(hidden_size)
        self.progress = progress
        self.name = "vllm"

    @classmethod
    def from_config(cls, spec: Any, adapters: Sequence[AdapterSpec], options: Mapping[str, Any]) -> VLLMEngine:
        """Resolve the backbone (``labeling.backbone.resolve_backbone_dir``), check the adapters,
        and start vLLM with the options of ``conf/engine/vllm.yaml``."""
        from transformers import AutoConfig, AutoTokenizer

        from labeling.backbone import resolve_backbone_dir

        model_dir = resolve_backbone_dir(spec)
        hidden = AutoConfig.from_pretrained(model_dir).hidden_size
        for a in adapters:
            validate_adapter(a, hidden)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        stops = stop_ids_for(model_dir, tokenizer, spec)
        args = llm_kwargs(model_dir, adapters, options)
        dp = int(options.get("data_parallel_size", 1))
        prepare_environment()  # before vLLM starts anywhere (and inherited by replicas)
        if dp > 1:
            backend = DataParallelBackend(dp, args["tensor_parallel_size"], "labeling.engines.vllm:build_local_backend",
                                          (args, list(adapters), sorted(stops)))
        else:
            backend = build_local_backend(args, adapters, stops)
        return cls(backend, tokenizer, adapters, stops, hidden, progress=bool(options.get("progress", True)),
                   pipeline=bool(options.get("pipeline", True)), prefix_caching=args["enable_prefix_caching"])

    def close(self) -> None:
        self.backend.close()

    def _config(self, policy: StepTrim | None = None, scorer: StepTrim | None = None,
                capture: Iterable[int] = ()) -> dict[str, Any]:
        for name, st in (("steptrim", policy), ("scorer", scorer)):
            if st is not None and st.hidden_size != self.hidden_size:
                raise ValueError(f"{name}: hidden size {st.hidden_size}, the engine's model has {self.hidden_size}")
        require_cacheable(policy, self.prefix_caching)
        return calibration_config([a.name for a in self.adapters], policy, scorer, capture)

    def generate(self, requests: Sequence[GenRequest], max_new_tokens: int, steptrim: StepTrim | None = None,
                 scorer: StepTrim | None = None, capture: Callable[[int], bool] | None = None,
                 fork: ForkFn | None = None, desc: str = "generate") -> list[GenResult]:
        """Generate for all requests (order preserved); arguments as :meth:`HFEngine.generate`.

        steptrim: release policy of the ON pass (None = full LoRA). scorer: StepTrim whose
        learned heads give s_t at every forward. capture(t): record h_t at forward t.
        fork(result, t, s_t): fork OFF_t (module docstring: post hoc, in the hf engine's order
        for each request). With ``pipeline`` (and a backend that can, :class:`LocalBackend`), a
        request's OFF branches start as soon as its ON response finishes, in the same engine run
        as the other ON requests (:meth:`LocalBackend.run_pipelined`), instead of in a second
        ``generate`` after all of them. That needs a full-LoRA ON pass (``steptrim`` None, as the
        labeling and sweep passes are): the OFF branches then share its calibration config.
        ``fork`` is called per request in increasing t either way; only the order across requests
        changes, so it must keep per-request state only (as the labels' and ForkPlanner's do).
        """
        for r in requests:
            if r.slot != NO_SLOT and not 0 <= r.slot < len(self.adapters):
                raise ValueError(f"request {r.uid}: slot {r.slot} has no adapter (have {len(self.adapters)})")
            if len(r.prompt_ids) + max_new_tokens > self.backend.max_model_len:
                raise ValueError(f"request {r.uid}: {len(r.prompt_ids)} prompt tokens + {max_new_tokens} new tokens "
                                 f"exceed vLLM's max_model_len {self.backend.max_model_len}; raise "
                                 f"engine.max_model_len.")
        if not requests:
            return []
        cap = capture_set(capture, max_new_tokens)
        config = self._config(steptrim, scorer, cap)
        if fork is not None and steptrim is None and self.pipeline and hasattr(self.backend, "run_pipelined"):
            return self._generate_pipelined(requests, max_new_tokens, config, scorer is not None, fork, desc)
        on = self.backend.run(on_requests(requests, max_new_tokens), config, desc, self.progress)
        results = [on_result(r, toks, on.records.get(str(i)), scored=scorer is not None)
                   for i, (r, toks) in enumerate(zip(requests, on.tokens, strict=True))]
        if fork is not None:
            plan = plan_forks(results, fork)
            if plan:
                off = [off_request(requests[i], results[i], t, max_new_tokens) for i, t in plan]
                out = self.backend.run(off, self._config(), f"{desc}: {len(off)} OFF branches", self.progress)
                assemble_branches(results, plan, out.tokens)
        return results

    def _generate_pipelined(self, requests: Sequence[GenRequest], max_new_tokens: int, config: dict[str, Any],
                            scored: bool, fork: ForkFn, desc: str) -> list[GenResult]:
        """:meth:`generate` with each request's OFF branches added as its ON response finishes."""
        results: list[GenResult] = [GenResult(uid=r.uid, slot=r.slot) for r in requests]  # filled by follow
        plan: list[tuple[int, int]] = []

        def follow(k: int, tokens: list[int], record: dict[str, Any] | None) -> list[VLLMRequest]:
            res = results[k] = on_result(requests[k], tokens, record, scored)
            points = fork_points(res, fork)
            plan.extend((k, t) for t in points)
            return [off_request(requests[k], res, t, max_new_tokens) for t in points]

        _, off_tokens = self.backend.run_pipelined(on_requests(requests, max_new_tokens), config, follow,
                                                   f"{desc} (ON + OFF branches)", self.progress)
        assemble_branches(results, plan, off_tokens)
        return results

