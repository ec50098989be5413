"""vLLM's compile cache kept apart for GridTrim engines (docs/vllm_integration.md §4b).

Semantics: with GridTrim on, the key under which vLLM saves and loads a whole compiled model
(``vllm.compilation.caching.aot_compile_hash_factors``) gains :func:`factor`, the GridTrim punica
wrapper, its ops' schemas and how the compiled forward launches the kernels; with it off the key is
vLLM's own. vLLM's key holds its environment and config only, and a loaded artifact is checked
against the files its own trace went through, so without the factor a GridTrim engine would load a
stock engine's artifact of the same model and settings and run stock's LoRA kernels, and a stock
engine would load GridTrim's.
"""
from __future__ import annotations

import hashlib
from typing import Any


def factor(wrapper: str, launch: str) -> str:
    """The key factor of a GridTrim engine: the punica wrapper's qualified name, a digest of the
    ``torch.ops.lorazor`` schemas its compiled graph calls, and ``launch`` (``"ops"``: through them;
    ``"inductor"``: Inductor launches the kernels, serve_bridge.gridtrim)."""
    from serve_bridge.gridtrim import OP_SCHEMAS

    schemas = hashlib.sha256("\n".join(OP_SCHEMAS[name] for name in sorted(OP_SCHEMAS)).encode()).hexdigest()
    return f"lorazor.gridtrim wrapper={wrapper} ops={schemas[:16]} launch={launch}"


def install(wrapper: str, launch: str) -> None:
    """Append :func:`factor` to vLLM's AOT compile-cache factors (idempotent for one factor; a
    second install with another factor replaces the first's)."""
    from vllm.compilation import caching

    original = caching.aot_compile_hash_factors
    extra = factor(wrapper, launch)
    if getattr(original, "lorazor_factor", None) == extra:
        return
    original = getattr(original, "lorazor_original", original)

    def aot_compile_hash_factors(vllm_config: Any) -> list[str]:
        return [*original(vllm_config), extra]

    aot_compile_hash_factors.lorazor_factor = extra  # type: ignore[attr-defined]
    aot_compile_hash_factors.lorazor_original = original  # type: ignore[attr-defined]
    caching.aot_compile_hash_factors = aot_compile_hash_factors
