#!/usr/bin/env bash
# StepTrim-in-vLLM correctness check on the lent GPU machine.
# Run from the repository root after `source .devcarry/setup.sh` (../shared/device/README.md):
#   source .devcarry/setup.sh && bash scripts/device_serve_bridge.sh [check_correctness.py options]
set -euo pipefail
source "$(dirname "$0")/device_plugin_env.sh"
out=${OUT:-/tmp/lorazor_out}
python3 -c "from importlib.metadata import entry_points; print('plugins:', [e.value for e in entry_points(group='vllm.general_plugins')])"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
python3 "$root/benchmarks/serve_bridge/check_correctness.py" --out "$out" "$@"
