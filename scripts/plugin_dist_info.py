"""Make a checkout's vLLM plugin visible to vLLM without installing the package.

vLLM finds general plugins through the ``vllm.general_plugins`` entry points of installed
distributions (``importlib.metadata``), in every process it starts. ``pip install -e .`` provides
them. Where the checkout is only on ``PYTHONPATH``, this writes a minimal dist-info holding
pyproject.toml's entry points into a directory; put that directory and the checkout on
``PYTHONPATH`` (``scripts/env.sh`` and ``tests/gpu/conftest.py`` do).

    python scripts/plugin_dist_info.py DIR    # prints DIR
"""
from __future__ import annotations

import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def write_dist_info(directory: Path, root: Path = ROOT) -> Path:
    """Write ``<directory>/lorazor_checkout-<version>.dist-info`` (named apart from an installed
    ``lorazor``, so stale metadata of that name cannot shadow it); returns ``directory``."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    info = directory / f"lorazor_checkout-{project['version']}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: lorazor-checkout\nVersion: {project['version']}\n")
    groups = [f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in entries.items())
              for group, entries in project["entry-points"].items()]
    (info / "entry_points.txt").write_text("\n".join(groups))
    return directory


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__.strip().splitlines()[-1].strip())
    print(write_dist_info(Path(sys.argv[1])))
