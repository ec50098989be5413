"""Shared fixtures for the labeling tests: offline `datasets`, a private cache, JSONL writers."""
from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# No hub access in tests: a hub id must fail fast instead of hanging on the network.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")



@pytest.fixture(scope="session", autouse=True)
def _private_datasets_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Keep `datasets`' Arrow cache out of the user's home directory."""
    import datasets

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.mktemp("hf_datasets_cache"))
        yield


@pytest.fixture(scope="session")
def gsm8k_subset() -> Path:
    """The GSM8K subset shipped as package data (64 train rows, 32 test rows)."""
    import labeling

    return Path(labeling.__file__).parent / "data" / "gsm8k_subset"


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="session")
def write_jsonl() -> Callable[[Path, list[dict[str, Any]]], Path]:
    """``write_jsonl(path, rows)``: write rows as JSON lines (creating folders), return ``path``."""
    return _write_jsonl
