#!/usr/bin/env bash
# Issue 5 on the H200, in phases that each fit one device call: the embedded backbone
# (SmolLM2-135M-Instruct) calibrated through vLLM end to end, on the demo and on GSM8K.
#
#   source .devcarry/setup.sh && bash scripts/device_calibrate.sh PHASE... [--until SECONDS]
#
# Phases, run in the order given (each stops at --until seconds into the call, default 570):
#   train       GSM8K adapter gsm8k-a for SmolLM2 (scripts/train_adapter.py, 2 epochs over the
#               build/gsm8k.jsonl rows, greedy accuracy of backbone and adapter on 200 test rows),
#               in the background; `gsm8k` waits for it. Skipped when /tmp/cal/adapters/gsm8k-a
#               exists (a previous call's, or carried back as build/cal_adapters.tar).
#   demo-hf     agreement=true on runs/arith-smollm2-arith-demo (a finished `make demo` run, hf engine
#               on CPU, float32): only the agreement stage runs, the bundle realized through vLLM.
#   demo-vllm   the demo pipeline with engine=vllm agreement=true (/tmp/cal/run_demo_vllm).
#   gsm8k       GSM8K (build/gsm8k_data, a copy of ../shared/data/gsm8k) with gsm8k-a, engine=vllm,
#               agreement=true, capped at GSM8K_SIZES (/tmp/cal/run_gsm8k). Resumable: a call cut
#               short keeps its finished stages and labeling shards for the next call.
#   compare     engine=hf vs engine=vllm on the GSM8K run's first COMPARE_LIMIT train requests
#               (default 512: the run's whole train split, and what one labeling shard holds on vLLM)
#               (benchmarks/engines/compare_engines.py; COMPARE_ARGS adds options, e.g.
#               "--engines vllm --vllm-option max_num_seqs=1024" next to an earlier hf result).
#   compare-serial  the vLLM side of `compare` again with engine.pipeline=false (OFF branches as a
#               second generate), against compare's hf result, into /tmp/cal/compare_serial
#   compare-graphs  the same with engine.max_cudagraph_capture_size=1024 (/tmp/cal/compare_graphs)
#   compare-cached  the same with engine.prefix_caching=true as well: OFF branches reuse their ON
#               request's KV blocks before the release (/tmp/cal/compare_cached)
# `compare` with COMPARE_ARGS="--engines vllm" reuses an hf result carried in build/cal/compare.
# build/cal, when carried (an earlier call's cal.tar unpacked there: GSM8K adapter, run directory),
# seeds /tmp/cal, so `compare` alone needs no earlier phase in the same call.
# Everything the phases write is packed into $OUT/cal.tar after every phase, so a call cut by
# its time limit still returns the finished phases' outputs.
#
# Carry sequence (../shared/device/README.md, as scripts/device_real.sh): .devcarry/c0, c1, c2, m0,
# m1 copied to /tmp/devcarry in five calls, then
#   run carry=[".devcarry/c3", ".devcarry/setup.sh", ".whl", "runs/arith-smollm2-arith-demo", "build"]
set -uo pipefail
source "$(dirname "$0")/device_plugin_env.sh"
cd "$root"
until_s=570
phases=()
while [ $# -gt 0 ]; do
  case "$1" in
    --until) until_s=$2; shift 2 ;;
    *) phases+=("$1"); shift ;;
  esac
done
python3 -m pip install -q --no-index --no-deps --target /tmp/pydeps .whl/*.whl
export PYTHONPATH="$PYTHONPATH:/tmp/pydeps" LORAZOR_CACHE=/tmp/lorazor PYTHONUNBUFFERED=1
W=/tmp/cal
GSM8K_SIZES=${GSM8K_SIZES:-"task.sizes.train=512 task.sizes.validation=200 task.sizes.test=200"}
COMPARE_LIMIT=${COMPARE_LIMIT:-512}
mkdir -p "$W/logs" "$W/adapters"
if [ -f build/cal_adapters.tar ] && [ ! -d "$W/adapters/gsm8k-a" ]; then
  tar -xf build/cal_adapters.tar -C "$W/adapters"
fi
if [ -d build/cal ]; then cp -rn build/cal/. "$W"/; fi
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader || true
# Convert the GGUF into the cache once, before phases that run side by side would race on it.
python3 -c "from labeling.backbone import SMOLLM2, BackboneSpec, resolve_backbone_dir as r
print('backbone:', r(BackboneSpec(**{**SMOLLM2.__dict__, 'gguf_dir': '/tmp/smollm2'})))" 2>&1 | tail -1

left() { echo $((until_s - SECONDS)); }
pack() {  # outputs worth keeping; runs' bulky labeling shards and features stay behind, and so do
  # compare's per-engine vLLM outputs (3.5 MB each at 512 requests; the device returns files up to
  # 16 MB): its tables and the hf result, which a later lease can carry back, are kept
  tar -cf "${OUT:-/tmp}/cal.tar" -C "$W" --exclude='*/labels/shards' --exclude='*.npy' \
      --exclude='compare*/vllm*' --exclude='compare*/scratch_*' \
      logs adapters $(cd "$W" && ls -d run_* compare* 2>/dev/null) 2>/dev/null
  cp -r runs/arith-smollm2-arith-demo/agreement "$W/demo_hf_agreement" 2>/dev/null
  tar -rf "${OUT:-/tmp}/cal.tar" -C "$W" demo_hf_agreement 2>/dev/null
  cp runs/arith-smollm2-arith-demo/plots/agreement.png "$W/logs/demo_hf_agreement.png" 2>/dev/null
  true
}
calibrate() {  # calibrate LOG ARGS...: one pipeline run, cut at the call's limit
  local log=$1; shift
  echo "[$SECONDS s] python -m calibrate $*"
  timeout "$(left)" python3 -m calibrate backbone=smollm2 +backbone.gguf_dir=/tmp/smollm2 "$@" \
      > "$W/logs/$log.log" 2>&1
  echo "[$SECONDS s] rc $? ($log)"
  grep -v "INFO\|WARNING\|it/s\]\|s/it\]" "$W/logs/$log.log" | tail -14
}
compare_vllm() {  # compare_vllm NAME KEY=VALUE...: the vLLM side again with engine options, against compare's hf result
  local name=$1; shift
  [ -f "$W/compare/hf.json" ] || { echo "compare-$name needs compare's hf result"; return; }
  mkdir -p "$W/compare_$name" && cp "$W"/compare/hf.json "$W"/compare/hf_points.parquet "$W/compare_$name/"
  echo "[$SECONDS s] engine=vllm with $*, GSM8K, $COMPARE_LIMIT requests"
  timeout "$(left)" python3 benchmarks/engines/compare_engines.py --run "$W/run_gsm8k" --out "$W/compare_$name" \
      --limit "$COMPARE_LIMIT" --engines vllm $(printf -- "--vllm-option %s " "$@") 2>&1 \
      | grep -v "INFO\|WARNING\|it/s\]" | tail -25
}
train_pid=""
for phase in "${phases[@]}"; do
  [ "$(left)" -gt 20 ] || { echo "[$SECONDS s] no time left for $phase"; break; }
  case "$phase" in
    train)
      if [ -d "$W/adapters/gsm8k-a" ]; then echo "gsm8k-a: present"; continue; fi
      echo "[$SECONDS s] training gsm8k-a in the background"
      (timeout "$(left)" python3 scripts/train_adapter.py train --gguf-dir /tmp/smollm2 --data build/gsm8k.jsonl \
          --out "$W/adapters/gsm8k-a.tmp" --seed 0 --epochs 2 --lr 5e-4 --batch 32 --max-new-tokens 256 \
          --n-eval 200 --eval-base > "$W/logs/train_gsm8k.log" 2>&1 \
        && mv "$W/adapters/gsm8k-a.tmp" "$W/adapters/gsm8k-a") &
      train_pid=$!
      # Training shares the GPU with the vLLM phases that follow: cap their memory.
      export CAL_GPU_UTIL=0.5 ;;
    demo-hf)
      # The agreement engine is VLLMOptions' defaults (0.85 of the GPU), so it waits
      # for training.
      [ -n "$train_pid" ] && wait "$train_pid"
      calibrate demo_hf hydra.run.dir=runs/arith-smollm2-arith-demo engine=hf agreement=true ;;
    demo-vllm)
      calibrate demo_vllm hydra.run.dir="$W/run_demo_vllm" engine=vllm \
          engine.gpu_memory_utilization="${CAL_GPU_UTIL:-0.85}" agreement=true ;;
    gsm8k)
      [ -n "$train_pid" ] && { echo "[$SECONDS s] waiting for training"; wait "$train_pid"; }
      grep -v "Loading\|Writing\|Converting\|it/s\]" "$W/logs/train_gsm8k.log" 2>/dev/null | tail -6
      [ -d "$W/adapters/gsm8k-a" ] || { echo "no gsm8k-a adapter"; continue; }
      # shellcheck disable=SC2086  # GSM8K_SIZES is a list of overrides
      calibrate gsm8k hydra.run.dir="$W/run_gsm8k" task=gsm8k task.options.source=build/gsm8k_data \
          $GSM8K_SIZES adapter=custom adapter.name=gsm8k-a \
          "adapter.adapters=[{name: gsm8k-a, path: $W/adapters/gsm8k-a}]" engine=vllm agreement=true ;;
    compare)
      echo "[$SECONDS s] engine=hf vs engine=vllm, GSM8K, $COMPARE_LIMIT requests"
      timeout "$(left)" python3 benchmarks/engines/compare_engines.py --run "$W/run_gsm8k" --out "$W/compare" \
          --limit "$COMPARE_LIMIT" --hf-batch-size 64 ${COMPARE_ARGS:-} 2>&1 | grep -v "INFO\|WARNING\|it/s\]" | tail -25 ;;
    compare-serial) compare_vllm serial pipeline=false ;;
    compare-graphs) compare_vllm graphs max_cudagraph_capture_size=1024 ;;
    compare-cached) compare_vllm cached prefix_caching=true max_cudagraph_capture_size=1024 ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
  pack
done
[ -n "$train_pid" ] && wait "$train_pid"
pack
echo "[$SECONDS s] done"
