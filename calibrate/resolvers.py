"""OmegaConf resolvers used by conf/: ``${lorazor_data:rel/path}`` → a file shipped in
``labeling/data`` (works from a source checkout and from an installed wheel)."""
from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

DATA_DIR = Path(__file__).resolve().parents[1] / "labeling" / "data"


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("lorazor_data"):
        OmegaConf.register_new_resolver("lorazor_data", lambda rel: str(DATA_DIR / rel))
