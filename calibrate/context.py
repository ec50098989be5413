"""Builds the pipeline's components from the composed Hydra config, lazily.

The backbone and engine load only when a stage that needs them runs, so a resumed run
whose generation stages are cached starts in a second.
"""
from __future__ import annotations

from functools import cached_property
from typing import Any

from omegaconf import DictConfig, OmegaConf

from calibrate.errors import ConfigError
from calibrate.rundir import RunDir
from labeling.adapters import AdapterError, AdapterSpec, validate_adapter
from labeling.backbone import BackboneSpec, load_backbone, resolve_backbone_dir, stop_token_ids
from labeling.tasks import Task, build_task


class Context:
    """Config + run dir + lazily built task, backbone and engine."""

    def __init__(self, cfg: DictConfig, run: RunDir) -> None:
        self.cfg = cfg
        self.run = run

    def section(self, name: str) -> dict[str, Any]:
        """A plain-dict copy of one config group (for fingerprints and kwargs)."""
        return OmegaConf.to_container(self.cfg[name], resolve=True)  # type: ignore[return-value]

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
                            gguf_file=b.get("gguf_file"), dtype=b.get("dtype", "float32"),
                            extra_stop_tokens=tuple(b.get("extra_stop_tokens") or ()))

    def check_adapters(self) -> None:
        """Validate every adapter against the backbone's hidden size, before loading weights."""
        from transformers import AutoConfig

        hidden = AutoConfig.from_pretrained(resolve_backbone_dir(self.backbone_spec)).hidden_size
        for spec in self.adapters:
            validate_adapter(spec, hidden)

    @cached_property
    def engine(self):
        e = self.section("engine")
        if e["name"] != "hf":
            raise ConfigError(f"engine={e['name']!r} is not available in this version; use engine=hf "
                             f"(engine.device=cuda on a GPU box).")
        from labeling.engines.hf import HFEngine

        self.check_adapters()
        model, tok = load_backbone(self.backbone_spec, device=e.get("device", "cpu"))
        return HFEngine(model, tok, self.adapters, stop_token_ids(model, tok, self.backbone_spec),
                        batch_size=e.get("batch_size", 16), progress=e.get("progress", True))
