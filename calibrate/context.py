"""Builds the pipeline's components from the composed Hydra config, lazily.

The backbone and engine load only when a stage that needs them runs, so a resumed run
whose generation stages are cached starts in a second.
"""
from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from calibrate.errors import ConfigError, UserError
from calibrate.rundir import RunDir
from labeling.adapters import AdapterError, AdapterSpec, validate_adapter, weights_file
from labeling.backbone import BackboneError, BackboneSpec, load_backbone, resolve_backbone_dir, stop_token_ids
from labeling.tasks import Task, build_task
from serve_bridge.bundle import file_sha256

# vLLM 0.26's max_num_seqs for LLM(...) on GPUs with >= 70 GiB (engine/arg_utils.py:2466-2469).
VLLM_DEFAULT_MAX_NUM_SEQS = 1024
# The engine keys that stage fingerprints include (see Context.fingerprint_section).
ENGINE_IDENTITY = ("name", "dtype", "device")
VLLM_DEFAULTS = Path(__file__).resolve().parents[1] / "conf" / "engine" / "vllm.yaml"


class Context:
    """Config + run dir + lazily built task, backbone and engine."""

    def __init__(self, cfg: DictConfig, run: RunDir) -> None:
        self.cfg = cfg
        self.run = run

    def section(self, name: str) -> dict[str, Any]:
        """A plain-dict copy of one config group (for fingerprints and kwargs)."""
        return OmegaConf.to_container(self.cfg[name], resolve=True)  # type: ignore[return-value]

    def fingerprint_section(self, name: str) -> dict[str, Any]:
        """What of config group ``name`` a stage's cached output depends on (calibrate/rundir.py).

        Every key, except:

        - ``engine``: only what changes the generated tokens — which engine, and its numerics
          (``dtype``, ``device``). Switching hf↔vllm therefore recomputes the generation stages,
          while throughput knobs (batch sizes, memory fraction, parallelism, progress bars) keep
          a run's cache;
        - ``backbone.gguf_dir``: where the GGUF file lies, not which model it is (``gguf_file``
          names it);
        - ``adapter``: each adapter by name and content (sha256 of its weights and its
          ``adapter_config.json``), not by path. New weights at the same path recompute; the same
          adapter elsewhere (another machine, the installed package) keeps the cache.
        """
        section = self.section(name)
        if name == "engine":
            return {k: section[k] for k in ENGINE_IDENTITY if k in section}
        if name == "backbone":
            section.pop("gguf_dir", None)
        if name == "adapter":
            section["adapters"] = self._adapter_identities
        return section

    @cached_property
    def _adapter_identities(self) -> list[dict[str, str]]:
        """Name and content hashes of every adapter (AdapterError if one is missing)."""
        out = []
        for spec in self.adapters:
            weights = weights_file(spec)
            out.append({"name": spec.name, "weights_sha256": file_sha256(weights),
                        "config_sha256": file_sha256(weights.with_name("adapter_config.json"))})
        return out

    @property
    def shard_requests(self) -> int:
        """Requests per labeling shard: ``labeling.shard_requests``, or with ``auto`` what keeps
        the engine busy — two hf batches (``engine.batch_size``), or every vLLM replica's full
        batch (``max_num_seqs`` × ``data_parallel_size``; ``max_num_seqs: null`` counts as
        1024, vLLM's default on ≥ 70 GiB GPUs, see conf/engine/vllm.yaml)."""
        n = self.section("labeling")["shard_requests"]
        if n == "auto":
            e = self.section("engine")
            if e["name"] == "vllm":
                return int(e.get("max_num_seqs") or VLLM_DEFAULT_MAX_NUM_SEQS) * int(e.get("data_parallel_size", 1))
            return 2 * int(e.get("batch_size", 16))
        if not isinstance(n, int) or n < 1:
            raise ConfigError(f"labeling.shard_requests={n!r}: use a positive integer or auto.")
        return n

    @cached_property
    def task(self) -> Task:
        t = self.section("task")
        return build_task(t["name"], sizes=t.get("sizes"), **t.get("options", {}))

    @cached_property
    def adapters(self) -> list[AdapterSpec]:
        specs = [AdapterSpec(name=a["name"], path=str(a["path"])) for a in self.section("adapter")["adapters"]]
        if not specs:
            raise AdapterError("adapter.adapters is empty: list at least one {name, path} "
                               "(see conf/adapter/custom.yaml).")
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise AdapterError(f"adapter names must be unique, got {names} (conf/adapter).")
        return specs

    @property
    def adapter_names(self) -> list[str]:
        return [s.name for s in self.adapters]

    @cached_property
    def backbone_spec(self) -> BackboneSpec:
        b = self.section("backbone")
        return BackboneSpec(name=b["name"], hf_id=b.get("hf_id"), gguf_package=b.get("gguf_package"),
                            gguf_file=b.get("gguf_file"), gguf_dir=b.get("gguf_dir"),  # +backbone.gguf_dir=…
                            dtype=b.get("dtype", "float32"), extra_stop_tokens=tuple(b.get("extra_stop_tokens") or ()))

    def check_adapters(self) -> None:
        """Validate every adapter against the backbone (hidden size, base model), before loading weights."""
        from transformers import AutoConfig

        b = self.backbone_spec
        try:
            config = AutoConfig.from_pretrained(resolve_backbone_dir(b))
        except OSError as err:
            raise BackboneError(f"backbone '{b.name}': cannot read its config ({str(err).splitlines()[0]}).") from err
        names = [n for n in (b.name, b.hf_id, b.gguf_file, config.name_or_path) if n]
        for spec in self.adapters:
            validate_adapter(spec, config.hidden_size, names)

    @cached_property
    def engine(self):
        e = self.section("engine")
        if e["name"] == "vllm":
            return self.vllm_engine(e)
        if e["name"] != "hf":
            raise ConfigError(f"engine={e['name']!r} is unknown; use engine=hf (transformers + peft, CPU or GPU) "
                              f"or engine=vllm (GPU).")
        from labeling.engines.hf import HFEngine

        self.check_adapters()
        model, tok = load_backbone(self.backbone_spec, device=e.get("device", "cpu"))
        return HFEngine(model, tok, self.adapters, stop_token_ids(model.generation_config, tok, self.backbone_spec),
                        batch_size=e.get("batch_size", 16), progress=e.get("progress", True))

    def vllm_engine(self, options: dict[str, Any]):
        """A :class:`labeling.engines.vllm.VLLMEngine` with ``options`` (conf/engine/vllm.yaml keys)."""
        try:
            import vllm  # noqa: F401
        except ImportError as err:
            raise ConfigError("engine=vllm needs vllm==0.26.0 and a GPU: pip install 'lorazor[vllm]'") from err
        from labeling.engines.vllm import VLLMEngine

        self.check_adapters()
        try:
            return VLLMEngine.from_config(self.backbone_spec, self.adapters, options)
        except UserError:
            raise
        except ValueError as err:  # an unknown option, an adapter rank beyond vLLM's
            raise ConfigError(f"engine=vllm: {err}") from err

    @cached_property
    def agreement_engine(self):
        """The engine the agreement stage realizes the bundle on: the run's engine if it is
        vLLM, else a vLLM engine with conf/engine/vllm.yaml's defaults (tests inject another)."""
        if self.section("engine")["name"] == "vllm":
            return self.engine
        defaults = OmegaConf.to_container(OmegaConf.load(VLLM_DEFAULTS), resolve=True)
        return self.vllm_engine(defaults)  # type: ignore[arg-type]
