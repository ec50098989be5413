"""One ``vllm.LLM`` in this process: plain ``generate`` passes under a calibration config, and the
pipelined engine loop that starts each request's OFF branches as soon as its ON response ends."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from tqdm.auto import tqdm

from labeling.adapters import AdapterSpec
from labeling.engines.vllm.options import prepare_environment
from labeling.engines.vllm.requests import Batch, FollowFn, VLLMRequest
from serve_bridge.steptrim import NO_SLOT

RUNNER = "LoRazorGPUModelRunner"


def _progress(desc: str) -> Callable[..., tqdm]:
    """A ``use_tqdm`` callable naming the pass (vLLM passes its own ``desc``,
    ``entrypoints/offline_utils.py:582-588``)."""
    def bar(*args: Any, **kwargs: Any) -> tqdm:
        inner = kwargs.pop("desc", "")
        return tqdm(*args, desc=f"{desc}: {inner.lower()}" if inner else desc, **kwargs)
    return bar


def _runner_name(worker: Any) -> str:
    return type(worker.model_runner).__name__


class LocalBackend:
    """One ``vllm.LLM`` in this process (tensor parallel inside it)."""

    def __init__(self, llm: Any, adapters: Sequence[AdapterSpec], stop_ids: Iterable[int],
                 sampling_params_cls: Any = None, lora_request_cls: Any = None, output_kinds: Any = None) -> None:
        if sampling_params_cls is None or lora_request_cls is None:
            from vllm import SamplingParams
            from vllm.lora.request import LoRARequest
            from vllm.sampling_params import RequestOutputKind

            sampling_params_cls, lora_request_cls, output_kinds = SamplingParams, LoRARequest, RequestOutputKind
        self.llm = llm
        # SamplingParams.output_kind of the driven loop's requests: FINAL_ONLY, DELTA for watched ones
        self._kinds = output_kinds
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
                               f"loaded in every vLLM process. Install the package (pip install -e .) or, on a device "
                               f"without it, `source scripts/device_plugin_env.sh`.")

    def run(self, reqs: Sequence[VLLMRequest], config: Mapping[str, Any], desc: str, progress: bool) -> Batch:
        from serve_bridge.vllm.rpc import lorazor_calibrate, lorazor_captures

        if not reqs:
            return Batch([])
        if any(r.decided is not None for r in reqs):
            return self.run_pipelined(reqs, config, lambda k, tokens, record: (), desc, progress)[0]
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
        outputs only as ``LLM`` does (``output_kind`` FINAL_ONLY, :561), except for requests with a
        ``decided`` watch: those stream their new tokens (DELTA) and are aborted at the step that
        decides them, keeping the tokens up to there. Request ids are ours
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
        self.watched: dict[str, tuple[Callable[[Sequence[int]], int | None], list[int]]] = {}  # id → (watch, tokens)
        self.start, self.tokens = time.perf_counter(), 0  # for the bar's generated tokens/s

    def add(self, request_id: str, r: VLLMRequest) -> None:
        # A raw token prompt: LLMEngine.add_request preprocesses it itself (v1/engine/input_processor.py:
        # 281-294, deprecated in favour of the Renderer's output but accepted by 0.26.0).
        kinds = self.backend._kinds
        kind = None if kinds is None else kinds.DELTA if r.decided is not None else kinds.FINAL_ONLY
        self.engine.add_request(request_id, {"prompt_token_ids": list(r.prompt_ids)},
                                self.backend.sampling_params(r, kind), lora_request=self.backend.lora_request(r))
        self.pending.add(request_id)
        if r.decided is not None:
            self.watched[request_id] = (r.decided, [])

    def _tokens(self, out: Any) -> list[int] | None:
        """A finished request's tokens from a step output, or None while it runs; a watched
        request's delta is added to its tokens, and where they are decided it is aborted."""
        new = [int(x) for x in out.outputs[0].token_ids]
        if out.request_id not in self.watched:
            return new if out.finished else None
        decided, tokens = self.watched[out.request_id]
        tokens += new
        n = decided(tokens)
        if n is None and not out.finished:
            return None
        del self.watched[out.request_id]
        if n is not None and not out.finished:
            self.engine.abort_request([out.request_id])
        return tokens if n is None else tokens[:n]

    def drive(self) -> None:
        """Step until no request is unfinished; after each step, read the records of the ON
        requests that finished in it and add their follow-ups."""
        from serve_bridge.vllm.rpc import lorazor_captures

        while self.engine.has_unfinished_requests():
            finished = []
            for out in self.engine.step():
                rid = out.request_id
                if rid not in self.pending or (tokens := self._tokens(out)) is None:
                    continue  # still running (or aborted where decided)
                self.pending.discard(rid)
                if rid.startswith("on"):
                    self.on_tokens[int(rid[2:])] = tokens
                    finished.append(int(rid[2:]))
                else:
                    self.off_tokens[int(rid[3:])] = tokens
                if self.bar is not None:
                    self.tokens += len(tokens)
                    self.bar.set_postfix_str(f"{self.tokens / (time.perf_counter() - self.start):.0f} tokens/s",
                                             refresh=False)
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

    from serve_bridge.vllm.versions import current

    # vLLM builds the runner from a module attribute (the seam's install_runner names it): patching
    # it here covers an engine in this process; worker processes (tensor parallel) rely on the
    # entry point, and check_runner() says so if they lack it.
    current().install_runner()
    backend = LocalBackend(vllm.LLM(**llm_args), adapters, stop_ids)
    backend.check_runner()
    return backend
