#!/usr/bin/env bash
# One device call on the embedded backbone (SmolLM2-135M-Instruct + the demo adapter arith-a),
# issue 7, check 3: learned release points, hf engine vs the vLLM runtime (stock LoRA kernels
# and GridTrim, offline and behind `vllm serve`), benchmarks/serve_bridge/check_learned_real.py.
# The calibration pipelines on engine=vllm (issue 5) are scripts/device_calibrate.sh's phases.
#
# Carry sequence (../shared/device/README.md): .devcarry/c0, c1, c2, m0, m1 copied to
# /tmp/devcarry in five calls (the m chunks are the SmolLM2 GGUF, assembled by setup.sh), then
#   run carry=[".devcarry/c3", ".devcarry/setup.sh", ".whl", "runs/arith-smollm2-arith-demo"]
#       command: source .devcarry/setup.sh && bash scripts/device_real.sh
# runs/arith-smollm2-arith-demo is a finished `make demo` run; .whl holds the pure-Python wheels
# the device image lacks (hydra-core, omegaconf, antlr4-python3-runtime, datasets, multiprocess,
# gguf: `pip wheel --no-deps -w .whl ...`, multiprocess for Python 3.12; and, for vLLM's OpenAI
# server, model-hosting-container-standards, jmespath, supervisor, httpx, httpcore, h11:
# `pip download --no-deps -d .whl ...`). Output: $OUT/real.tar.
# Arguments go to check_learned_real.py, e.g. `--phases server` with an earlier call's hf, vllm and
# gridtrim results copied to /tmp/lorazor_real first (carried as build/real_work).
set -uo pipefail
source "$(dirname "$0")/device_plugin_env.sh"
cd "$root"
python3 -m pip install -q --no-index --no-deps --target /tmp/pydeps .whl/*.whl
export PYTHONPATH="$PYTHONPATH:/tmp/pydeps" LORAZOR_CACHE=/tmp/lorazor PYTHONUNBUFFERED=1
res=/tmp/res
mkdir -p "$res"
echo "[$SECONDS s] learned release: hf vs vLLM"
timeout 530 python3 benchmarks/serve_bridge/check_learned_real.py --run runs/arith-smollm2-arith-demo \
    --gguf-dir /tmp/smollm2 --out "$res/real" "$@" 2>&1 | tail -30
cp /tmp/lorazor_real/*.json "$res/real/" 2>/dev/null  # the engines' raw results, for later reading
tar -cf "${OUT:-/tmp}/real.tar" -C "$res" .
echo "[$SECONDS s] done"
