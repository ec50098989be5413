"""Test setup for the predictors tests: the repository root on sys.path."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # until pyproject.toml sets [tool.pytest.ini_options] pythonpath
    sys.path.insert(0, str(ROOT))
