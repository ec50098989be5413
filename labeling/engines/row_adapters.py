"""One adapter per batch row on a peft model, with the hooks registered once.

Semantics: ``RowAdapters(model)(names, **inputs)`` (``names``: one adapter name per batch row,
:data:`BASE` for the backbone alone) returns what ``model(**inputs, adapter_names=names)`` returns,
through the same peft code path (every LoRA layer's ``forward(..., adapter_names=names)``), so with
the same numbers. peft 0.21 scans the whole module tree twice and registers a pre-forward hook on
every LoRA layer at each such call (``tuners/lora/model.py:567-683``): 22-27 ms per decode step of
SmolLM2-135M on one CPU thread, about a seventh of a one-row step
(``python -m benchmarks.engines.bench_row_adapters``, 2026-12-03); here those hooks are registered
once and read the names of the current call.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

BASE = "__base__"  # peft's name for "no adapter" in a mixed batch


class RowAdapters:
    """Calls ``model`` (a peft model in eval mode) with per-row adapters, as the module doc says."""

    def __init__(self, model: Any) -> None:
        from peft.tuners.lora import LoraLayer
        from peft.utils.other import AuxiliaryTrainingWrapper

        self.model = model
        self._names: Sequence[str] | None = None
        self.known: set[str] = set()
        for module in model.modules():
            if isinstance(module, LoraLayer):
                self.known |= module.lora_A.keys() | module.lora_embedding_A.keys()
            if isinstance(module, (LoraLayer, AuxiliaryTrainingWrapper)):
                module.register_forward_pre_hook(self._inject, with_kwargs=True)

    def _inject(self, module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self._names is not None:
            kwargs["adapter_names"] = self._names
        return args, kwargs

    def __call__(self, names: Sequence[str], **inputs: Any) -> Any:
        unknown = set(names) - self.known - {BASE}
        if unknown:
            raise ValueError(f"no adapter named {', '.join(sorted(unknown))} (have {', '.join(sorted(self.known))})")
        self._names = list(names)
        try:
            return self.model(**inputs)
        finally:
            self._names = None
