#!/usr/bin/env bash
# Throughput of stock vLLM 0.26 vs vLLM with the LoRazor plugin (StepTrim), same machine, one run.
# Run from the repository root after `source .devcarry/setup.sh` (../shared/device/README.md):
#   source .devcarry/setup.sh && bash scripts/device_serve_bench.sh [serve_bridge.bench options]
# Defaults: adapters 128 then 4, each stock then steptrim; the table goes to $OUT/bench.txt after
# every engine, so a run cut short still returns the finished rows. Pass --budget-s to stop
# starting engines before the call's time limit.
# vLLM finds plugins through installed entry points; the checkout is not pip-installed there,
# so this writes a dist-info with the entry-point tables of pyproject.toml (as
# scripts/device_serve_bridge.sh does).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-/tmp/lorazor_bench_out}
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
export PYTHONPATH="$ep:$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset LORAZOR_BUNDLE LORAZOR_ADAPTERS
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
cd "$root"
python3 -m serve_bridge.bench --out "$out" "$@"
