#!/usr/bin/env bash
# Sourced by the device scripts: makes the checkout's vLLM plugin visible to vLLM.
#   source scripts/device_plugin_env.sh   (from the repository root, after .devcarry/setup.sh)
# vLLM finds plugins through installed entry points; the checkout is not pip-installed on the
# GPU machine, so this writes a dist-info with the entry-point tables of pyproject.toml (under
# its own distribution name, so that no stale lorazor metadata on sys.path can shadow it) and
# puts it and the checkout on PYTHONPATH. Sets `root` to the checkout.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ep=/tmp/lorazor_ep
python3 - "$root" "$ep" <<'PY'
import sys, tomllib
from pathlib import Path
root, ep = Path(sys.argv[1]), Path(sys.argv[2])
project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
info = ep / f"lorazor_checkout-{project['version']}.dist-info"
info.mkdir(parents=True, exist_ok=True)
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: lorazor-checkout\nVersion: {project['version']}\n")
lines = [f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items())
         for group, eps in project["entry-points"].items()]
(info / "entry_points.txt").write_text("\n".join(lines))
PY
export PYTHONPATH="$ep:$root${PYTHONPATH:+:$PYTHONPATH}"
