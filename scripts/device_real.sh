#!/usr/bin/env bash
# One device call on the embedded backbone (SmolLM2-135M-Instruct + the demo adapter arith-a):
# - issue 7, check 3: learned release points, hf engine vs the vLLM runtime (stock LoRA kernels
#   and GridTrim), benchmarks/serve_bridge/check_learned_real.py;
# - issue 5: the demo pipeline with engine=vllm and agreement=true, then engine=hf vs engine=vllm
#   on its labeling requests (benchmarks/engines/compare_engines.py).
#
# Carry sequence (../shared/device/README.md): .devcarry/c0, c1, c2, m0, m1 copied to
# /tmp/devcarry in five calls (the m chunks are the SmolLM2 GGUF, assembled by setup.sh), then
#   run carry=[".devcarry/c3", ".devcarry/setup.sh", ".whl", "runs/arith-smollm2-arith-demo"]
#       command: source .devcarry/setup.sh && bash scripts/device_real.sh
# runs/arith-smollm2-arith-demo is a finished `make demo` run; .whl holds the pure-Python wheels
# the device image lacks (hydra-core, omegaconf, antlr4-python3-runtime, datasets, multiprocess,
# gguf: `pip wheel --no-deps -w .whl ...`, multiprocess for Python 3.12). Output: $OUT/real.tar.
# The time limits keep the call under 400 s (the 2026-11-29 run: 382 s).
set -uo pipefail
source "$(dirname "$0")/device_plugin_env.sh"
cd "$root"
python3 -m pip install -q --no-index --no-deps --target /tmp/pydeps .whl/*.whl
export PYTHONPATH="$PYTHONPATH:/tmp/pydeps" LORAZOR_CACHE=/tmp/lorazor PYTHONUNBUFFERED=1
res=/tmp/res
mkdir -p "$res"
echo "[$SECONDS s] learned release: hf vs vLLM"
timeout 170 python3 benchmarks/serve_bridge/check_learned_real.py --run runs/arith-smollm2-arith-demo \
    --gguf-dir /tmp/smollm2 --out "$res/real" 2>&1 | tail -30
echo "[$SECONDS s] demo pipeline on engine=vllm"
timeout $((300 - SECONDS)) python3 -m calibrate hydra.run.dir=/tmp/run_vllm backbone=smollm2 \
    +backbone.gguf_dir=/tmp/smollm2 engine=vllm agreement=true > "$res/pipeline.log" 2>&1
echo "rc $?"
echo "[$SECONDS s] engine=hf vs engine=vllm"
timeout $((385 - SECONDS)) python3 benchmarks/engines/compare_engines.py --run /tmp/run_vllm --out "$res/compare" \
    2>&1 | grep -v "INFO\|WARNING" | tail -25
cp -r /tmp/run_vllm/agreement /tmp/run_vllm/test /tmp/run_vllm/sweep "$res/" 2>/dev/null
tar -cf "${OUT:-/tmp}/real.tar" -C "$res" .
echo "[$SECONDS s] done"
