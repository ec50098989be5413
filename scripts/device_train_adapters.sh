#!/usr/bin/env bash
# One device call: train the demo adapters (arith-a, arith-b) and the GSM8K adapter on the H200.
# Carry: .devmodel/m1 (m0 copied to /tmp/devmodel by the previous call), .whl (gguf), build (JSONL from `prepare`).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
mkdir -p /tmp/devmodel /tmp/smollm2 && cp .devmodel/m* /tmp/devmodel/
cat /tmp/devmodel/m* > /tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
export LORAZOR_CACHE=/tmp/lorazor PYTHONUNBUFFERED=1
python3 -c "import torch, transformers, peft; print(torch.__version__, transformers.__version__, peft.__version__)"
mkdir -p "$OUT/ad"
T=scripts/train_adapter.py; G="--gguf-dir /tmp/smollm2"
python3 $T train $G --data build/arith.jsonl --out "$OUT/ad/arith-a" --seed 0 --epochs 3 --eval-base 2>&1 | grep -v "Loading\|Writing\|Converting" | tee "$OUT/train.log"
python3 $T train $G --data build/arith.jsonl --out "$OUT/ad/arith-b" --seed 1 --epochs 3 --targets q_proj,k_proj,v_proj,o_proj 2>&1 | grep -v "Loading\|Writing\|Converting" | tee -a "$OUT/train.log"
python3 $T train $G --data build/gsm8k.jsonl --out "$OUT/ad/gsm8k" --seed 0 --epochs 2 --lr 5e-4 --max-new-tokens 256 --n-eval 300 --eval-base 2>&1 | grep -v "Loading\|Writing\|Converting" | tee -a "$OUT/train.log"
(cd "$OUT" && tar -cf adapters.tar ad && rm -rf ad)
nvidia-smi --query-gpu=name,driver_version --format=csv
