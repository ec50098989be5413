#!/usr/bin/env bash
# StepTrim-in-vLLM correctness check on the lent GPU machine.
# Run from the repository root after `source .devcarry/setup.sh` (../shared/device/README.md):
#   source .devcarry/setup.sh && bash scripts/device_serve_bridge.sh [check_correctness.py options]
# vLLM finds plugins through installed entry points; the checkout is not pip-installed there,
# so this writes a dist-info with the entry-point tables of pyproject.toml (under its own
# distribution name, so that no stale lorazor metadata on sys.path can shadow it).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-/tmp/lorazor_out}
ep=/tmp/lorazor_ep
python3 - "$root" "$ep" <<'EOF'
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
EOF
export PYTHONPATH="$ep:$root${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "from importlib.metadata import entry_points; print('plugins:', [e.value for e in entry_points(group='vllm.general_plugins')])"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
python3 "$root/benchmarks/serve_bridge/check_correctness.py" --out "$out" "$@"
