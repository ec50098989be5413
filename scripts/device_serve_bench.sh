#!/usr/bin/env bash
# Throughput of stock vLLM 0.26 vs vLLM with the LoRazor plugin (StepTrim), same machine, one run.
# Run from the repository root after `source .devcarry/setup.sh` (../shared/device/README.md):
#   source .devcarry/setup.sh && bash scripts/device_serve_bench.sh [serve_bridge.bench options]
# Defaults: adapters 128 then 4, each stock then steptrim; the table goes to $OUT/bench.txt after
# every engine, so a run cut short still returns the finished rows. Pass --budget-s to stop
# starting engines before the call's time limit.
set -euo pipefail
source "$(dirname "$0")/device_plugin_env.sh"
out=${OUT:-/tmp/lorazor_bench_out}
export PYTHONUNBUFFERED=1
unset LORAZOR_BUNDLE LORAZOR_ADAPTERS
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
cd "$root"
python3 -m serve_bridge.bench --out "$out" "$@"
