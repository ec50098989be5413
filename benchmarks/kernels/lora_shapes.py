"""Shapes and random inputs shared by the benchmark of the LoRA kernels and their GPU test
(``tests/gpu/test_lora_ops.py``)."""
from __future__ import annotations

from dataclasses import dataclass

import torch



@dataclass(frozen=True)
class LoRAOp:
    """One LoRA'd linear of a decoder layer: input width and the output width of each slice."""

    name: str
    hidden: int
    widths: tuple[int, ...]


def layer_ops(hidden: int, q: int, kv: int, mlp: int) -> list[LoRAOp]:
    """The four LoRA linears of a Llama-style layer: qkv, o, gate_up and down."""
    return [LoRAOp("qkv", hidden, (q, kv, kv)), LoRAOp("o", q, (hidden,)),
            LoRAOp("gate_up", hidden, (mlp, mlp)), LoRAOp("down", mlp, (hidden,))]


MODELS = {
    "llama-3.2-3b": layer_ops(3072, 3072, 1024, 8192),
    "mistral-7b-v0.3": layer_ops(4096, 4096, 1024, 14336),
    "smollm2-135m": layer_ops(576, 576, 192, 1536),
}


def mapping_from_groups(groups: dict[int, int], gen: torch.Generator) -> torch.Tensor:
    """A shuffled int32 token→adapter mapping with `groups[id]` tokens per id (-1 = none)."""
    ids = torch.cat([torch.full((n,), lora, dtype=torch.int32) for lora, n in groups.items()])
    return ids[torch.randperm(ids.numel(), generator=gen)]


def release(mapping: torch.Tensor, fraction: float, gen: torch.Generator) -> torch.Tensor:
    """Map a random `fraction` of the tokens to no adapter (-1), as StepTrim's release does."""
    out = mapping.clone()
    picked = torch.randperm(out.numel(), generator=gen)[: int(out.numel() * fraction)]
    out[picked] = -1
    return out


@dataclass
class OpTensors:
    """Random weights (vLLM's stacked layout), input and output of one op."""

    lora_a: list[torch.Tensor]
    lora_b: list[torch.Tensor]
    x: torch.Tensor
    y: torch.Tensor


def random_op(op: LoRAOp, max_loras: int, rank: int, tokens: int, dtype: torch.dtype,
              device: str, gen: torch.Generator) -> OpTensors:
    """Weights scaled so that x @ Aᵀ and its expand are O(1), like y itself."""
    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device=device, generator=gen) * scale).to(dtype)

    return OpTensors(
        lora_a=[rand(max_loras, 1, rank, op.hidden, scale=op.hidden ** -0.5) for _ in op.widths],
        lora_b=[rand(max_loras, 1, n, rank, scale=rank ** -0.5) for n in op.widths],
        x=rand(tokens, op.hidden),
        y=rand(tokens, sum(op.widths)),
    )


def update_rel_err(out: torch.Tensor, ref: torch.Tensor, y0: torch.Tensor) -> float:
    """‖(out − y0) − (ref − y0)‖ / ‖ref − y0‖, the error of the LoRA update itself."""
    want = ref.float() - y0.float()
    got = out.float() - y0.float()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))
