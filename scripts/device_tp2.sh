#!/usr/bin/env bash
# Issue 6, tensor parallelism: one device call on nvidia-h200-x2 (2 H200s, one host).
# (a) check: benchmarks/serve_bridge/check_correctness.py at tensor_parallel_size=2 (through
#     scripts/device_serve_bridge.sh): 320 requests over 32 adapters, stock vLLM vs the plugin;
#     policy off must be token-identical to stock, profiled/learned release token-exact up to the
#     release step, and both ranks must agree on every release (check (e)).
# (b) bench: benchmarks.serving.bench --model mistral7b --adapters 128 --tensor-parallel-size 2 --modes
#     stock gridtrim steptrim both (through scripts/device_serve_bench.sh), with the time left.
# Optional steps (TP2_STEPS, in order; default "check bench"):
#   sharded   (a) with --fully-sharded-loras (vLLM's add_shrink → all-gather/all-reduce → add_expand)
#   gridtrim  check_gridtrim.py at TP=2 with --fully-sharded-loras: GridTrim's add_shrink/add_expand
#             against stock, first-token logprob within tolerance
# e.g. TP2_STEPS="check gridtrim bench". Each step gets at most TP2_CHECK_S (default 230) seconds,
# the bench what is left of TP2_LIMIT_S (default 575). TP2_BENCH_MODES orders the bench's modes
# (default "stock both gridtrim steptrim": the headline ratio first, should time run short).
#
# Carry sequence (../shared/device/README.md), every call with kind=nvidia-h200-x2: .devcarry/c0,
# c1, c2 copied to /tmp/devcarry in three calls, then
#   run kind=nvidia-h200-x2 carry=[".devcarry/c3", ".devcarry/setup.sh"]
#       command: source .devcarry/setup.sh && bash scripts/device_tp2.sh
# (no SmolLM2 chunks: both parts use dummy weights). Output: $OUT/check/table.md,
# $OUT/bench/bench.txt (rewritten after every engine, so a cut-short run keeps its rows), logs.
# NVLink multicast stays off (../.library/device KINDS.md): the NCCL/PyTorch/NVSHMEM switches are
# exported again here, and vLLM's symmetric-memory all-reduce (VLLM_ALLREDUCE_USE_SYMM_MEM, on by
# default in 0.26.0, envs.py:1753-1755, multimem through torch symmetric memory) is turned off, so
# all-reduces go through vLLM's custom (CUDA IPC) all-reduce or NCCL in every engine alike.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/device_plugin_env.sh"
cd "$root"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_ALLREDUCE_USE_SYMM_MEM=0
export PYTHONUNBUFFERED=1
unset LORAZOR_BUNDLE LORAZOR_ADAPTERS LORAZOR_GRIDTRIM LORAZOR_CALIBRATION
out=${OUT:-/tmp/lorazor_tp2_out}
limit=${TP2_LIMIT_S:-575}
step_s=${TP2_CHECK_S:-230}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
python3 -c "import torch; n = torch.cuda.device_count(); print('GPUs:', n); assert n >= 2, 'needs 2 GPUs'" || exit 1

left() { echo $((limit - SECONDS)); }
quiet() { grep -v -E '^(\([^)]*\) )?(INFO|DEBUG|WARNING) [0-9]' | tail -40; }  # vLLM's log lines
for step in ${TP2_STEPS:-check bench}; do
    s=$(( $(left) < step_s ? $(left) : step_s ))
    if [ "$step" != bench ] && [ "$s" -lt 90 ]; then echo "[$SECONDS s] skip $step: ${s} s left"; continue; fi
    echo "[$SECONDS s] $step"
    rc=
    case $step in
        check)
            OUT="$out/check" timeout -k 10 "$s" bash "$here/device_serve_bridge.sh" --tensor-parallel-size 2 \
                --budget-s $((s - 15)) 2>&1 | quiet; rc=${PIPESTATUS[0]} ;;
        sharded)
            OUT="$out/check_sharded" timeout -k 10 "$s" bash "$here/device_serve_bridge.sh" --tensor-parallel-size 2 \
                --fully-sharded-loras --budget-s $((s - 15)) 2>&1 | quiet; rc=${PIPESTATUS[0]} ;;
        gridtrim)
            timeout -k 10 "$s" python3 benchmarks/serve_bridge/check_gridtrim.py --out "$out/gridtrim" \
                --tensor-parallel-size 2 --fully-sharded-loras 2>&1 | quiet; rc=${PIPESTATUS[0]} ;;
        bench)
            b=$(( $(left) - 10 ))
            if [ "$b" -lt 60 ]; then echo "[$SECONDS s] skip bench: ${b} s left"; continue; fi
            OUT="$out/bench" timeout -k 10 "$b" bash "$here/device_serve_bench.sh" --model mistral7b --adapters 128 \
                --tensor-parallel-size 2 --modes ${TP2_BENCH_MODES:-stock both gridtrim steptrim} --budget-s $((b - 20)) 2>&1 | quiet
            rc=${PIPESTATUS[0]} ;;
        *) echo "unknown step $step (check, sharded, gridtrim, bench)" ;;
    esac
    echo "[$SECONDS s] $step rc=${rc:-none} (124: time limit)"
done
echo "[$SECONDS s] done; results under $out"
