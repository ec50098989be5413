"""Host memory a LoRA engine keeps for its adapters, against what the machine has: the serving
benchmarks refuse a table that would not fit before starting any engine."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.serving.synthetic import lora_targets

def adapter_bytes(cfg: dict[str, Any], rank: int) -> int:
    """One adapter's weights as its file holds them (bf16): A (rank × in) and B (out × rank) of
    q,k,v,o,gate,up,down in every layer."""
    return 2 * rank * cfg["num_hidden_layers"] * sum(i + o for _, i, o in lora_targets(cfg).values())


def host_bytes_needed(cfg: dict[str, Any], rank: int, n_adapters: int, max_loras: int | None,
                      max_cpu_loras: int | None) -> int:
    """Host memory one LoRA engine keeps for adapters, at most: every adapter vLLM keeps loaded
    (``max_cpu_loras``, default all of them, at least ``max_loras``), twice: its loaded weights and
    the plugin's pinned slot image (``serve_bridge/slot_copy.py``)."""
    loaded = max(max_cpu_loras or n_adapters, max_loras or n_adapters)
    return 2 * loaded * adapter_bytes(cfg, rank)


def host_memory_available() -> int | None:
    """``MemAvailable`` of /proc/meminfo in bytes; None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def host_memory_problem(needed: int, available: int | None, share: float = 0.9) -> str | None:
    """A line saying why ``needed`` bytes do not fit ``share`` of ``available``, else None."""
    if available is None or needed <= share * available:
        return None
    return (f"the adapters kept in host memory need about {needed / 2**30:.1f} GiB (loaded weights and a pinned slot "
            f"image each) and {available / 2**30:.1f} GiB is available: give fewer --adapters or --max-cpu-loras")
