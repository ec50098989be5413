#!/usr/bin/env bash
# One device call: benchmark + GPU correctness sweep of the LoRA kernels (kernels/, issue 4).
# vLLM is carried as in ../shared/device/README.md: earlier calls copied .devcarry/c0..c2 to
# /tmp/devcarry; this call carries .devcarry/c3 and .devcarry/setup.sh. Logs go to $OUT.
#   run carry=[".devcarry/c3", ".devcarry/setup.sh"]  command: bash scripts/device_kernels.sh
# The benchmark runs with --quick (the knob sweeps are in RESULTS.md; the fused
# launch's sweep and the main table of all four designs still run); BENCH_ARGS overrides that,
# e.g. BENCH_ARGS="" for the full sweep. About 2-2.5 minutes in all on a fresh machine. Each
# Python process runs under `timeout` (BENCH_TIMEOUT_S, CHECK_TIMEOUT_S), so that a hung kernel
# still leaves the call time to return the logs.
set -uo pipefail
source .devcarry/setup.sh
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/kernels_out}
mkdir -p "$OUT"
B=benchmarks/kernels
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

# The benchmark first, alone on the GPU.
timeout "${BENCH_TIMEOUT_S:-330}" python3 $B/bench_lora_ops.py ${BENCH_ARGS---quick} --out "$OUT/bench.md" > "$OUT/bench.log" 2>&1
echo "bench rc=$? (${SECONDS} s)"
grep -v "WARNING\|INFO" "$OUT/bench.log" | tail -n 45

# Correctness of all three of our designs: one process per model; their Triton compiles overlap.
pids=()
for model in llama-3.2-3b mistral-7b-v0.3 smollm2-135m; do
  timeout "${CHECK_TIMEOUT_S:-150}" python3 $B/check_lora_ops.py --models "$model" > "$OUT/check_$model.md" 2>&1 &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; echo "check pid $pid rc=$?"; done
grep -h "FAIL\|Error\|passed" "$OUT"/check_*.md | tail -n 30
echo "total ${SECONDS} s"
