#!/usr/bin/env bash
# Slot hand-back on one H200, in about 9 minutes:
#   1. correctness (benchmarks/serving/check_slots.py): policy off token-identical to stock on 320
#      requests; profiled and learned policies token-identical with and without slot hand-back;
#   2. the slot-bound throughput table: 512 adapters, max_loras 32, uniform traffic, offline,
#      Llama-3.2-3B shape, rank 8, full CUDA graphs, modes stock, gridtrim, both (REQUESTS requests,
#      default 1024 to fit 9 minutes; the table of 2026-12-01 used 2048), with mean running requests and
#      slots held per step beside the capacity model's prediction.
# Usage, from anywhere (vLLM 0.26.0 installed with `pip install -e ".[vllm]"`, or on PYTHONPATH,
# e.g. through LORAZOR_VLLM_SITE, see scripts/env.sh):
#   bash scripts/gpu_slot_bench.sh OUT_DIR
# Writes OUT_DIR/correctness/check_slots.md and OUT_DIR/slots_512_32/bench.{txt,json}.
# Environment: REQUESTS (bench requests, default 1024), BUDGET_S (whole run, default 540).
set -uo pipefail
out=${1:?usage: bash scripts/gpu_slot_bench.sh OUT_DIR}
requests=${REQUESTS:-1024}
budget=${BUDGET_S:-540}
source "$(dirname "$0")/env.sh"  # the plugin's entry point for a checkout; sets root
export PYTHONUNBUFFERED=1 VLLM_USE_V2_MODEL_RUNNER=0
# slot statistics read the engine core's scheduler, so it runs in this process
export VLLM_ENABLE_V1_MULTIPROCESSING=${VLLM_ENABLE_V1_MULTIPROCESSING:-0}
unset LORAZOR_BUNDLE LORAZOR_ADAPTERS LORAZOR_GRIDTRIM LORAZOR_SLOTS LORAZOR_CALIBRATION
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$root"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
git log -1 --format='commit %H %cd' 2>/dev/null || true
start=$(date +%s)
rc=0
python3 -m benchmarks.serving.check_slots --out "$out/correctness" --budget-s 220 || rc=1
left=$((budget - ($(date +%s) - start)))
python3 -m benchmarks.serving.bench --out "$out/slots_512_32" --work /tmp/lorazor_bench_slots \
    --adapters 512 --max-loras 32 --requests "$requests" --modes stock gridtrim both --full-graphs \
    --capture-sizes 1 2 4 8 16 32 64 128 256 512 1024 2048 --budget-s "$left" --min-run-s 60 || rc=1
python3 - "$out/slots_512_32/bench.json" <<'PY' || rc=1
import json, sys
rows = {r["mode"]: r for r in json.load(open(sys.argv[1]))["rows"] if "error" not in r}
if {"stock", "gridtrim", "both"} <= set(rows):
    b, g, s = (rows[m]["req_per_s"] for m in ("both", "gridtrim", "stock"))
    print(f"slot-bound 512/32 uniform: both/gridtrim = {b / g:.2f}, both/stock = {b / s:.2f}")
else:
    print(f"slot-bound 512/32 uniform: rows missing ({sorted(rows)} finished)")
PY
exit $rc
