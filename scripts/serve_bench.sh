#!/usr/bin/env bash
# Serving throughput, stock vLLM (a supported one, docs/serving.md) vs vLLM with the LoRazor plugin, on this machine's GPU(s):
# the modes stock, gridtrim (LORAZOR_GRIDTRIM=1), steptrim (LORAZOR_BUNDLE) and both, each engine
# in its own process (benchmarks/serving/bench.py sets each mode's variables itself).
#   bash scripts/serve_bench.sh --out DIR [benchmarks.serving.bench options]
# e.g. --model mistral7b, --adapters 128 4, --modes stock both, --tensor-parallel-size 2.
set -euo pipefail
source "$(dirname "$0")/env.sh"
export PYTHONUNBUFFERED=1
unset LORAZOR_BUNDLE LORAZOR_ADAPTERS LORAZOR_GRIDTRIM LORAZOR_CALIBRATION
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
cd "$root"
python3 -m benchmarks.serving.bench "$@"
