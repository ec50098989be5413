"""Write an adapter into a GPU LoRA slot with one host-to-device copy.

Semantics: :meth:`SlotWriter.image` renders, once per loaded adapter, what each LoRA layer's own
``reset_lora(slot)`` followed by ``set_lora(slot, lora_a, lora_b)`` (only ``reset_lora`` when the
adapter has no weights for that layer) leaves in the layer's stacked slot tensors: the layer's
stacked tensors are swapped for one-slot host shadows while its own method runs, so every slicing
rule (merged and QKV slices, tensor-parallel shards) stays the layer's. :meth:`SlotWriter.write`
then overwrites the slot's slice of every stacked tensor from that image, with one non-blocking
copy into a device staging buffer and one ``torch._foreach_copy_``. Afterwards each stacked
tensor's slot slice equals what the layer's own methods would have left there. Layers whose
stacked weights are not tuples of tensors of one dtype and device (embeddings, the LM head) are
written by their own methods.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

# module name -> (lora_a, lora_b) as the layer's set_lora takes them, or None: no weights there
LayerWeights = Callable[[str], "tuple[Any, Any] | None"]


@dataclass(frozen=True)
class SlotImage:
    """One adapter rendered for :meth:`SlotWriter.write`: ``flat`` holds every stacked layer's slot
    slice (host memory, pinned when CUDA is available); ``direct`` the weights of the other layers."""

    flat: torch.Tensor
    direct: dict[str, tuple[Any, Any] | None]


def _stacked(module: Any) -> tuple[torch.Tensor, ...] | None:
    a, b = getattr(module, "lora_a_stacked", None), getattr(module, "lora_b_stacked", None)
    if not (isinstance(a, tuple) and isinstance(b, tuple) and a and b):
        return None
    tensors = a + b
    return tensors if all(isinstance(t, torch.Tensor) for t in tensors) else None


class SlotWriter:
    """Writes adapters into the slots of ``modules`` (name -> LoRA layer), as the module doc says."""

    def __init__(self, modules: Mapping[str, Any]) -> None:
        self.modules = dict(modules)
        stacked = {name: ts for name, m in self.modules.items() if (ts := _stacked(m)) is not None}
        first = next(iter(stacked.values()), (torch.empty(0),))[0]
        self.fast = {name: ts for name, ts in stacked.items()
                     if all(t.dtype == first.dtype and t.device == first.device for t in ts)}
        self._shapes = [t.shape[1:] for ts in self.fast.values() for t in ts]
        self._sizes = [math.prod(s) for s in self._shapes]
        # A normal tensor even when vLLM first activates an adapter under inference mode (its warm-up
        # dummy LoRAs): ``vllm serve --lora-modules`` writes later slots outside inference mode.
        with torch.inference_mode(False):
            self.staging = torch.empty(sum(self._sizes), dtype=first.dtype, device=first.device)
            self.sources = self._slices(self.staging)
        self._targets: dict[int, list[torch.Tensor]] = {}

    def _slices(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """``flat`` cut into views shaped as one slot of each fast layer's stacked tensors, in order."""
        return [v.view(s) for v, s in zip(torch.split(flat, self._sizes), self._shapes)]

    def image(self, weights: LayerWeights) -> SlotImage:
        """Render one adapter (``weights``: its layer weights by module name). The layers write
        into views of the image itself, zeroed and pinned once: no other copy of it is made."""
        flat = torch.zeros(sum(self._sizes), dtype=self.staging.dtype, pin_memory=torch.cuda.is_available())
        shadows = iter([v.unsqueeze(0) for v in self._slices(flat)])
        for name, tensors in self.fast.items():
            shadow = tuple(next(shadows) for _ in tensors)
            lora = weights(name)
            if lora is not None:
                module = self.modules[name]
                n = len(module.lora_a_stacked)
                saved = module.lora_a_stacked, module.lora_b_stacked
                module.lora_a_stacked, module.lora_b_stacked = shadow[:n], shadow[n:]
                try:
                    module.set_lora(0, *lora)
                finally:
                    module.lora_a_stacked, module.lora_b_stacked = saved
        return SlotImage(flat, {name: weights(name) for name in self.modules if name not in self.fast})

    def write(self, image: SlotImage, slot: int) -> None:
        """Overwrite ``slot`` of every layer with ``image``."""
        if self.fast:
            targets = self._targets.get(slot)
            if targets is None:
                targets = self._targets[slot] = [t[slot] for ts in self.fast.values() for t in ts]
            self.staging.copy_(image.flat, non_blocking=True)
            torch._foreach_copy_(targets, self.sources)
        for name, lora in image.direct.items():
            module = self.modules[name]
            if lora is None:
                module.reset_lora(slot)
            else:
                module.set_lora(slot, *lora)
