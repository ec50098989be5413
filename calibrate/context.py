"""Builds the pipeline's components from the composed Hydra config, lazily.

The backbone and engine load only when a stage that needs them runs, so a resumed run
whose generation stages are cached starts in a second.
"""
from __future__ import annotations

from dataclasses import asdict
from functools import cached_property
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from calibrate.config import Config, check_config
from calibrate.errors import ConfigError, UserError
from calibrate.rundir import RunDir
from labeling.adapters import AdapterError, AdapterSpec, validate_adapter, weights_file
from labeling.answer_cut import RESPONSE_END
from labeling.backbone import (BackboneError, BackboneSpec, load_backbone, parameter_count, resolve_backbone_dir,
                               stop_token_ids)
from labeling.engines.auto import AutoOptions, EngineChoice, MachineFacts, probe_facts, resolve_engine
from labeling.engines.batch_workers import resolve_workers
from labeling.engines.cpu_matmul import resolve_cpu_matmul
from labeling.engines.hf import HFOptions
from labeling.engines.vllm.options import SUPPORTED_VLLM, VLLMOptions
from labeling.tasks import Task, build_task
from serve_bridge.bundle import file_sha256

# vLLM 0.26's max_num_seqs for LLM(...) on GPUs with >= 70 GiB (engine/arg_utils.py:2466-2469).
VLLM_DEFAULT_MAX_NUM_SEQS = 1024
# The engine keys that stage fingerprints include (see Context.fingerprint_section).
ENGINE_IDENTITY = ("name", "dtype", "device")


class Context:
    """Config + run dir + lazily built task, backbone and engine.

    config: ``cfg`` as its dataclasses, every value checked (a ConfigError here on a bad one).
    facts: the machine facts ``engine=auto`` decides on (:mod:`labeling.engines.auto`); probed
    when first needed unless given (tests inject them).
    """

    def __init__(self, cfg: DictConfig, run: RunDir, facts: MachineFacts | None = None) -> None:
        self.cfg = cfg
        self.config: Config = check_config(cfg)
        self.run = run
        self._facts = facts

    def section(self, name: str) -> dict[str, Any]:
        """A plain-dict copy of one config group (for fingerprints and kwargs)."""
        return OmegaConf.to_container(self.cfg[name], resolve=True)  # type: ignore[return-value]

    def fingerprint_section(self, name: str) -> dict[str, Any]:
        """What of config group ``name`` a stage's cached output depends on (calibrate/rundir.py).

        Every key, except:

        - ``engine``: only what changes the generated tokens — which engine, and its numerics
          (``dtype``, ``device``, and the hf engine's ``cpu_matmul`` as resolved on this machine
          where it differs from the model's dtype), of the engine the run resolved to
          (``engine=auto`` counts as the engine it chose). Switching hf↔vllm therefore recomputes
          the generation stages, while throughput knobs (batch sizes, memory fraction,
          parallelism, progress bars) keep a run's cache;
        - ``backbone.gguf_dir``: where the GGUF file lies, not which model it is (``gguf_file``
          names it);
        - ``adapter``: each adapter by name and content (sha256 of its weights and its
          ``adapter_config.json``), not by path. New weights at the same path recompute; the same
          adapter elsewhere (another machine, the installed package) keeps the cache;
        - ``labeling.early_stop``: it changes how much is generated, not the results. The section
          names the rule where responses end instead (:data:`labeling.answer_cut.RESPONSE_END`),
          so outputs cached before that rule are recomputed.
        """
        if name == "engine":
            options = asdict(self.engine_options)
            identity = {k: options[k] for k in ENGINE_IDENTITY if k in options}
            if isinstance(self.engine_options, HFOptions) and self.hf_matmul != self.backbone_spec.dtype:
                identity["matmul"] = self.hf_matmul
            return identity
        section = self.section(name)
        if name == "backbone":
            section.pop("gguf_dir", None)
        if name == "adapter":
            section["adapters"] = self._adapter_identities
        if name == "labeling":
            section.pop("early_stop", None)
            section["response_end"] = RESPONSE_END
        return section

    @cached_property
    def engine_choice(self) -> EngineChoice | None:
        """What ``engine=auto`` resolved to and why (None for an explicit engine)."""
        options = self.config.engine
        if not isinstance(options, AutoOptions):
            return None
        return resolve_engine(self.facts, lambda: parameter_count(self.backbone_spec), self.backbone_spec.name, options)

    @cached_property
    def facts(self) -> MachineFacts:
        """This machine's CUDA and vLLM facts (injected, or probed when first needed)."""
        return self._facts if self._facts is not None else probe_facts()

    @cached_property
    def engine_options(self) -> HFOptions | VLLMOptions:
        """The options of the engine this run uses: the explicit ``engine=hf|vllm``, or what
        ``engine=auto`` chose."""
        if self.engine_choice is not None:
            return self.engine_choice.options
        return self.config.engine  # type: ignore[return-value]

    @cached_property
    def _adapter_identities(self) -> list[dict[str, str]]:
        """Name and content hashes of every adapter (AdapterError if one is missing)."""
        out = []
        for spec in self.adapters:
            weights = weights_file(spec)
            out.append({"name": spec.name, "task": spec.task, "weights_sha256": file_sha256(weights),
                        "config_sha256": file_sha256(weights.with_name("adapter_config.json"))})
        return out

    @property
    def shard_requests(self) -> int:
        """Requests per labeling shard: ``labeling.shard_requests``, or with ``auto`` what keeps
        the engine busy — two hf batches (``batch_size``), or every vLLM replica's full batch
        (``max_num_seqs`` × ``data_parallel_size``; ``max_num_seqs`` None counts as 1024, vLLM's
        default on ≥ 70 GiB GPUs)."""
        n = self.config.labeling.shard_requests
        if n == "auto":
            e = self.engine_options
            if isinstance(e, VLLMOptions):
                return (e.max_num_seqs or VLLM_DEFAULT_MAX_NUM_SEQS) * e.data_parallel_size
            return 2 * e.batch_size
        return int(n)

    @cached_property
    def task(self) -> Task:
        t = self.section("task")
        return build_task(t["name"], sizes=t["sizes"], **t["options"])

    @cached_property
    def adapters(self) -> list[AdapterSpec]:
        specs = [AdapterSpec(name=a["name"], path=str(a["path"]), task=a.get("task"))
                 for a in self.config.adapter.adapters]
        self._check_parts(specs)
        return specs

    def _check_parts(self, specs: list[AdapterSpec]) -> None:
        """Each adapter's ``task`` names a part of the run's mix task (or is unset), and with a
        mix task every part has an adapter and every adapter a part."""
        parts = getattr(self.task, "parts", None)
        for s in specs:
            if s.task is not None and (parts is None or s.task not in parts):
                known = f"the mix task's parts are {sorted(parts)}" if parts else "the run's task is not a mix"
                raise AdapterError(f"adapter '{s.name}': task '{s.task}' is not a part of this run's task ({known}); "
                                   f"fix adapter.adapters[].task, choose task=demo, or pick adapters without a task "
                                   f"(adapter=arith_demo for task=arith, or adapter=custom).")
        if parts is not None:
            unset = [s.name for s in specs if s.task is None]
            if unset:
                raise AdapterError(f"adapter(s) {unset}: task=mix needs each adapter's `task` (one of {sorted(parts)}).")
            idle = sorted(set(parts) - {s.task for s in specs})
            if idle:
                raise AdapterError(f"task part(s) {idle} have no adapter; add one with `task: {idle[0]}` to "
                                   f"adapter.adapters or drop the part from task.options.parts.")

    @property
    def adapter_parts(self) -> dict[int, str | None]:
        """Slot → the task part its adapter serves (None: every request)."""
        return {i: s.task for i, s in enumerate(self.adapters)}

    @property
    def label_points(self) -> dict[int, list[int]]:
        """Slot → the release points T its training requests are labeled at: ``labeling.task_points``
        of the task (part) its adapter serves, else ``labeling.points``."""
        lab = self.config.labeling
        return {i: list(lab.task_points.get(part or self.task.name, lab.points)) for i, part in self.adapter_parts.items()}

    @property
    def adapter_names(self) -> list[str]:
        return [s.name for s in self.adapters]

    @cached_property
    def backbone_spec(self) -> BackboneSpec:
        b = self.section("backbone")
        return BackboneSpec(**{**b, "extra_stop_tokens": tuple(b["extra_stop_tokens"])})

    @cached_property
    def backbone_config(self) -> Any:
        """The backbone's transformers config (no weights read); BackboneError if it cannot be read."""
        from transformers import AutoConfig

        b = self.backbone_spec
        try:
            return AutoConfig.from_pretrained(resolve_backbone_dir(b))
        except OSError as err:
            raise BackboneError(f"backbone '{b.name}': cannot read its config ({str(err).splitlines()[0]}).") from err

    def check_adapters(self) -> None:
        """Validate every adapter against the backbone (hidden size, base model), before loading weights."""
        b, config = self.backbone_spec, self.backbone_config
        names = [n for n in (b.name, b.hf_id, b.gguf_file, config.name_or_path) if n]
        for spec in self.adapters:
            validate_adapter(spec, config.hidden_size, names)

    def check_response_limit(self) -> None:
        """The task's ``max_new_tokens`` lies below the backbone's context (``max_position_embeddings``),
        which bounds every generation; ConfigError otherwise."""
        context = getattr(self.backbone_config, "max_position_embeddings", None)
        n = self.task.max_new_tokens
        if context is not None and n >= context:
            raise ConfigError(f"task '{self.task.name}': max_new_tokens={n} (task.options.max_new_tokens) is not below "
                              f"the context of backbone '{self.backbone_spec.name}' ({context} tokens); use fewer.")

    @cached_property
    def engine(self):
        e = self.engine_options
        if isinstance(e, VLLMOptions):
            return self.vllm_engine(e)
        from labeling.engines.hf import HFEngine

        self.check_adapters()
        model, tok = load_backbone(self.backbone_spec, device=e.device)
        try:
            workers = resolve_workers(e.workers, next(model.parameters()).device)
        except ValueError as err:  # the environment's LORAZOR_HF_WORKERS
            raise ConfigError(str(err)) from err
        if workers > 1:
            print(f"hf engine: {workers} worker processes, one torch thread each (engine.workers={e.workers})", flush=True)
        if self.hf_matmul != self.backbone_spec.dtype:
            print(f"hf engine: {self.backbone_spec.dtype} model, linear layers multiply in {self.hf_matmul} "
                  f"(engine.cpu_matmul={e.cpu_matmul})", flush=True)
        return HFEngine(model, tok, self.adapters, stop_token_ids(model.generation_config, tok, self.backbone_spec),
                        batch_size=e.batch_size, progress=e.progress, early_stop=self.config.labeling.early_stop,
                        workers=workers, matmul=self.hf_matmul)

    @cached_property
    def hf_matmul(self) -> str:
        """The dtype the hf engine's linear layers multiply in (``engine.cpu_matmul`` resolved for
        this machine, :func:`labeling.engines.cpu_matmul.resolve_cpu_matmul`)."""
        e = self.engine_options
        return resolve_cpu_matmul(e.cpu_matmul, torch.device(e.device).type, self.backbone_spec.dtype)

    def vllm_engine(self, options: VLLMOptions):
        """A :class:`labeling.engines.vllm.engine.VLLMEngine` with ``options``."""
        try:
            import vllm  # noqa: F401
        except ImportError as err:
            raise ConfigError(f"engine=vllm needs vLLM ({' or '.join(SUPPORTED_VLLM)}) and a GPU: pip install "
                              "'lorazor[vllm]'") from err
        from labeling.engines.vllm.engine import VLLMEngine

        self.check_adapters()
        try:
            return VLLMEngine.from_config(self.backbone_spec, self.adapters, options, self.config.labeling.early_stop)
        except UserError:
            raise
        except ValueError as err:  # an adapter rank beyond vLLM's, a bad max_lora_rank, too few GPUs
            raise ConfigError(f"engine=vllm: {err}") from err

    @property
    def agreement_options(self) -> HFOptions | VLLMOptions:
        """The options of the engine the agreement stage realizes the bundle on: the run's
        engine if it is vLLM, else vLLM with its defaults."""
        return self.engine_options if isinstance(self.engine_options, VLLMOptions) else VLLMOptions()

    @cached_property
    def agreement_engine(self):
        """The engine of :attr:`agreement_options` (tests inject another)."""
        if isinstance(self.engine_options, VLLMOptions):
            return self.engine
        return self.vllm_engine(self.agreement_options)
