"""bfloat16 multiplications for a float32 model on the CPU.

Semantics: under :func:`use_bf16_matmuls` every ``nn.Linear`` of the model (the backbone's, the
LoRA adapters' A and B, the LM head) rounds its input and its weight to bfloat16, multiplies with
float32 accumulation, and hands on a float32 output (rounded to bfloat16 by the kernel); the
embedding, norms, attention, the KV cache and everything else stay float32. The LM head gets its own
bfloat16 weight, so an embedding tied to it stays float32.

Why: on a CPU with bfloat16 dot-product instructions (x86 ``avx512_bf16`` / ``amx_bf16``, Arm
``bf16``) oneDNN multiplies bfloat16 about 4.5x as fast as float32 (2-core AMD EPYC, one thread,
2026-12-03: 475 against 103 GFLOP/s at 1024 x 576 x 1536), and its bfloat16 result for a row does not
depend on the other rows of the batch or on their number (float32 takes another kernel below four
rows). Attention stays float32 because PyTorch's CPU attention for one new token is about 10x slower
in bfloat16 (benchmarks/results/2026-12-03-hf-engine-cpu.md).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

CPU_MATMUL = ("auto", "float32", "bfloat16")
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})  # x86 cpuinfo flags, Arm Features


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU's feature flags (Linux ``/proc/cpuinfo``: x86 ``flags``, Arm ``Features``); empty elsewhere."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    return flags


def resolve_cpu_matmul(option: str, device: str, dtype: str, flags: set[str] | None = None) -> str:
    """The multiplication dtype of a ``dtype`` model on ``device``: ``bfloat16`` when the model is
    float32 on the CPU and ``option`` is ``bfloat16``, or ``auto`` on a CPU with native bfloat16
    (``flags``: :func:`cpu_flags`); otherwise the model's own ``dtype``."""
    if option not in CPU_MATMUL:
        raise ValueError(f"cpu_matmul must be one of {', '.join(CPU_MATMUL)}, got {option!r}")
    if device != "cpu" or dtype != "float32" or option == "float32":
        return dtype
    if option == "bfloat16":
        return "bfloat16"
    return "bfloat16" if (cpu_flags() if flags is None else flags) & NATIVE_BF16_FLAGS else "float32"


def _to_bf16(module: torch.nn.Module, args: tuple) -> tuple:
    return (args[0].to(torch.bfloat16), *args[1:])


def _to_fp32(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    return out.float()


def use_bf16_matmuls(model: Any) -> int:
    """Make every ``nn.Linear`` of ``model`` multiply in bfloat16 (module doc); returns how many."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and head.weight is getattr(model.get_input_embeddings(), "weight", None):
        head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)  # untie
    n = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.weight.dtype == torch.float32:
            module.to(torch.bfloat16)
            module.register_forward_pre_hook(_to_bf16)
            module.register_forward_hook(_to_fp32)
            n += 1
    return n
