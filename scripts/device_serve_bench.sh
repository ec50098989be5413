#!/usr/bin/env bash
# Throughput of stock vLLM 0.26 vs vLLM with the LoRazor plugin, same machine, one run: four modes,
# stock, gridtrim (LORAZOR_GRIDTRIM=1: our punica wrapper and LoRA kernels), steptrim (LORAZOR_BUNDLE:
# release with vLLM's kernels) and both. The harness sets each mode's variables itself.
# Run from the repository root after `source .devcarry/setup.sh` (../shared/device/README.md):
#   source .devcarry/setup.sh && bash scripts/device_serve_bench.sh [benchmarks.serving.bench options]
# Defaults: Llama-3.2-3B shape (--model mistral7b for Mistral-7B-v0.3), adapters 128 then 4, each
# in the order stock, gridtrim, steptrim, both (--modes picks a subset); the table goes to
# $OUT/bench.txt after every engine, so a run cut short still returns the finished rows. Pass
# --budget-s to stop starting engines before the call's time limit.
set -euo pipefail
source "$(dirname "$0")/device_plugin_env.sh"
out=${OUT:-/tmp/lorazor_bench_out}
export PYTHONUNBUFFERED=1
unset LORAZOR_BUNDLE LORAZOR_ADAPTERS LORAZOR_GRIDTRIM
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
cd "$root"
python3 -m benchmarks.serving.bench --out "$out" "$@"
