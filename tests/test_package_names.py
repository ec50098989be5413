"""The installed top-level packages are ours alone: no other installed distribution ships a module
of the same name. A clash is silent until a dependency imports its own module and gets ours (on
2026-12-03 transformers 5.25 began requiring HF's ``kernels``, which our former top-level
``kernels`` package shadowed: every ``from transformers import ...`` failed)."""
from __future__ import annotations

import importlib.metadata
from collections.abc import Iterable


def _our_top_level() -> set[str]:
    """Top-level modules that the installed ``lorazor`` distribution ships."""
    return {n for n, dists in importlib.metadata.packages_distributions().items() if "lorazor" in dists}


def _clashes(names: Iterable[str]) -> dict[str, list[str]]:
    """name → the installed distributions other than ours that ship a top-level module ``name``."""
    owners = importlib.metadata.packages_distributions()
    return {n: sorted(set(owners[n]) - {"lorazor"}) for n in names if set(owners.get(n, ())) - {"lorazor"}}


def test_no_installed_distribution_ships_a_module_named_as_ours():
    ours = _our_top_level()
    assert {"calibrate", "serve_bridge", "lora_kernels"} <= ours
    assert not _clashes(ours), f"top-level names also shipped by other installed distributions: {_clashes(ours)}"


def test_a_name_another_distribution_ships_is_a_clash():
    assert _clashes(["transformers", "lora_kernels"]) == {"transformers": ["transformers"]}
