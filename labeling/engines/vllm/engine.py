"""The facade: :class:`VLLMEngine`, the hf engine's interface on vLLM (package docstring)."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from labeling.adapters import AdapterSpec, validate_adapter
from labeling.answer_cut import cut_result
from labeling.engines.chat import ChatIO
from labeling.engines.hf import GenRequest, GenResult
from labeling.engines.vllm.backend import build_local_backend
from labeling.engines.vllm.data_parallel import DataParallelBackend
from labeling.engines.vllm.options import VLLMOptions, llm_kwargs, prepare_environment, stop_ids_for
from labeling.engines.vllm.requests import (VLLMRequest, assemble_branches, capture_set, fork_points, off_request,
                                            on_requests, on_result, plan_forks)
from labeling.forks import ForkFn
from serve_bridge.calibration import calibration_config, require_cacheable
from serve_bridge.steptrim import NO_SLOT, StepTrim


class VLLMEngine(ChatIO):
    """Greedy multi-adapter generation on vLLM with StepTrim release, s_t / h_t capture and
    OFF branches by prefix replay; the interface of :class:`labeling.engines.hf.HFEngine`.

    backend: a :class:`LocalBackend` / :class:`DataParallelBackend` (or a stand-in with
    ``run`` and ``max_model_len``); build one from the config with :meth:`from_config`.
    prefix_caching: whether the backend's engines cache prefixes (then passes with a release
    policy are refused, :func:`serve_bridge.calibration.require_cacheable`).
    early_stop: cut each ON response where its answer is decided (:mod:`labeling.answer_cut`)
    before planning its OFF branches, so none is forked past that point, and stop each OFF branch
    at the step its answer is decided (a :class:`LocalBackend` aborts it there; data-parallel
    replicas generate it to its end); every result is cut afterwards either way.
    """

    def __init__(self, backend: Any, tokenizer: Any, adapters: Sequence[AdapterSpec], stop_ids: Iterable[int],
                 hidden_size: int, progress: bool = True, pipeline: bool = True, prefix_caching: bool = False,
                 early_stop: bool = True) -> None:
        self.backend = backend
        self.pipeline = pipeline
        self.prefix_caching = prefix_caching
        self.tokenizer = tokenizer
        self.adapters = list(adapters)
        self.eos_ids = set(int(i) for i in stop_ids)
        self.hidden_size = int(hidden_size)
        self.progress = progress
        self.early_stop = early_stop
        self.generated_tokens = 0  # tokens vLLM generated so far, before any cut
        self.name = "vllm"

    @classmethod
    def from_config(cls, spec: Any, adapters: Sequence[AdapterSpec], options: VLLMOptions,
                    early_stop: bool = True) -> VLLMEngine:
        """Resolve the backbone (``labeling.backbone.resolve_backbone_dir``), check the adapters,
        and start vLLM with ``options`` (one process, or ``data_parallel_size`` replicas)."""
        from transformers import AutoConfig, AutoTokenizer

        from labeling.backbone import resolve_backbone_dir

        model_dir = resolve_backbone_dir(spec)
        hidden = AutoConfig.from_pretrained(model_dir).hidden_size
        for a in adapters:
            validate_adapter(a, hidden)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        stops = stop_ids_for(model_dir, tokenizer, spec)
        args = llm_kwargs(model_dir, list(adapters), options)
        prepare_environment()  # before vLLM starts anywhere (and inherited by replicas)
        if options.data_parallel_size > 1:
            backend = DataParallelBackend(options.data_parallel_size, options.tensor_parallel_size,
                                          "labeling.engines.vllm.backend:build_local_backend",
                                          (args, list(adapters), sorted(stops)))
        else:
            backend = build_local_backend(args, adapters, stops)
        return cls(backend, tokenizer, adapters, stops, hidden, progress=options.progress, pipeline=options.pipeline,
                   prefix_caching=options.prefix_caching, early_stop=early_stop)

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
            results = self._generate_pipelined(requests, max_new_tokens, config, scorer is not None, fork, desc)
        else:
            on = self.backend.run(on_requests(requests, max_new_tokens), config, desc, self.progress)
            self.generated_tokens += sum(map(len, on.tokens))
            results = [self._on_result(r, toks, on.records.get(str(i)), scorer is not None)
                       for i, (r, toks) in enumerate(zip(requests, on.tokens, strict=True))]
            if fork is not None:
                plan = plan_forks(results, fork)
                if plan:
                    off = [off_request(requests[i], results[i], t, max_new_tokens, self._branch_decode)
                           for i, t in plan]
                    out = self.backend.run(off, self._config(), f"{desc}: {len(off)} OFF branches", self.progress)
                    self.generated_tokens += sum(map(len, out.tokens))
                    assemble_branches(results, plan, out.tokens)
        for r, res in zip(requests, results):
            cut_result(res, r.stop, self.decode)
        return results

    @property
    def _branch_decode(self) -> Callable[[list[int]], str] | None:
        """The decode that lets OFF branches stop where decided (:func:`off_request`), with ``early_stop``."""
        return self.decode if self.early_stop else None

    def _on_result(self, req: GenRequest, tokens: Sequence[int], record: dict[str, Any] | None,
                   scored: bool) -> GenResult:
        """:func:`on_result`, cut where its answer is decided with ``early_stop``."""
        res = on_result(req, tokens, record, scored)
        if self.early_stop:
            cut_result(res, req.stop, self.decode)
        return res

    def _generate_pipelined(self, requests: Sequence[GenRequest], max_new_tokens: int, config: dict[str, Any],
                            scored: bool, fork: ForkFn, desc: str) -> list[GenResult]:
        """:meth:`generate` with each request's OFF branches added as its ON response finishes."""
        results: list[GenResult] = [GenResult(uid=r.uid, slot=r.slot) for r in requests]  # filled by follow
        plan: list[tuple[int, int]] = []

        def follow(k: int, tokens: list[int], record: dict[str, Any] | None) -> list[VLLMRequest]:
            res = results[k] = self._on_result(requests[k], tokens, record, scored)
            points = fork_points(res, fork)
            plan.extend((k, t) for t in points)
            return [off_request(requests[k], res, t, max_new_tokens, self._branch_decode) for t in points]

        on, off_tokens = self.backend.run_pipelined(on_requests(requests, max_new_tokens), config, follow,
                                                    f"{desc} (ON + OFF branches)", self.progress)
        self.generated_tokens += sum(map(len, on.tokens)) + sum(map(len, off_tokens))
        assemble_branches(results, plan, off_tokens)
        return results

