#!/usr/bin/env bash
# The slot-bound serving tables (each fits a 10-minute window on one H200):
#   correctness check_slots: policy off token-identical to stock on 320 requests; profiled and learned
#               policies with and without slot hand-back identical up to numerical near-ties
#   uniform512  512 adapters, max_loras 32, uniform traffic, offline: both, gridtrim, stock, nolora
#   skewed1024  1024 adapters, max_loras 64, skewed (80% of requests on 20% of adapters): both, gridtrim, stock, nolora
#   full128     128 adapters, max_loras 128 (no slot pressure, the no-regression check): nolora, stock, gridtrim, both
#   llama8b256  Llama-3.1-8B shape, rank 16 (about 84 MB per adapter), 256 adapters, max_loras 16: both, gridtrim,
#               stock, nolora (likely more than one call: MODES="stock" ..., the same OUT_DIR)
#   poisson512  512 adapters, max_loras 32, open-loop Poisson arrivals at RATE req/s (default: 0.8 × gridtrim's
#               offline req/s in OUT/uniform512, else 20): gridtrim, both; P50/P90 TTFT and TPOT
#   goodput512  512 adapters, max_loras 32, through `vllm serve` (HTTP, multiprocess engine core) driven by
#               `vllm bench serve` at a sweep of Poisson rates: per mode the highest rate whose P90 TTFT <= 1000 ms
#               and P90 TPOT <= 50 ms (benchmarks/serving/goodput.py); the modes at once, one GPU each, on a
#               machine with a GPU per mode; on one GPU one mode per call: MODES=both, then MODES=gridtrim, then
#               MODES=stock, the same OUT_DIR; prints
#                 goodput 512/32: both/gridtrim = X.XX, both/stock = Y.YY (those measured)
#   chat512     a chat workload (per-adapter system prompts, multi-turn follow-ups, Zipf popularity), 512 adapters,
#               max_loras 32, against vLLM's defaults (torch.compile, async scheduling, prefix caching), through
#               `vllm serve` and `vllm bench serve` (benchmarks/serving/chat.py): goodput, P99s, prefix-cache hits,
#               adapters meeting the SLO; on a machine with six GPUs or more, the six modes at once, one GPU each
#               (one call); on one GPU one mode per call: MODES=lorazor (prepares the learned bundle first), then
#               MODES=lorazor-sync and MODES=lorazor-lag0 with BUNDLE=OUT_DIR/chat512/learned, then gridtrim, stock,
#               nolora, the same OUT_DIR; prints
#                 chat512 goodput [vLLM defaults]: lorazor/stock = X.XX, lorazor/gridtrim = Y.YY
#                 learned async/sync = Z.ZZ
#                 learned lag 1/lag 0 [async] = W.WW
# Llama-3.2-3B shape with dummy weights, rank 8 on all seven projections (llama8b256: Llama-3.1-8B, rank 16),
# vLLM's defaults (torch.compile and its CUDA-graph mode, async scheduling, prefix caching) unless SETTINGS says
# otherwise, REQUESTS requests (default 2048), every adapter kept in host memory; mean running requests and slots
# held per step beside the capacity model's prediction. Each offline table prints the line
#   slot-bound <table> [settings other than vLLM's defaults]: both/gridtrim = X.XX, both/stock = Y.YY,
#   both/nolora = Z.ZZ, gridtrim/stock = W.WW (those measured; benchmarks/serving/bench_ratios.py)
# and, with VLLM_PYTHONS="A B" (two interpreters, each with its own vLLM install: every mode once per
# vLLM, all engines in the same interleaved rounds), one such line per vLLM, "vLLM 0.34.0 slot-bound ...".
# Usage, from anywhere (a supported vLLM installed with `pip install -e ".[vllm]"`, or on PYTHONPATH,
# e.g. through LORAZOR_VLLM_SITE, see scripts/env.sh):
#   bash scripts/gpu_slot_bench.sh OUT_DIR TABLE [TABLE ...]
# Writes OUT_DIR/<table>/bench.{txt,json}, OUT_DIR/correctness/check_slots.md, or OUT_DIR/goodput512/goodput.{txt,json}
# (with each mode's server log and each rate's vllm bench serve result and log under OUT_DIR/goodput512/<mode>/), or
# OUT_DIR/chat512/chat.{txt,json} (likewise per mode, and the learned bundle in OUT_DIR/chat512/learned).
# goodput512 and chat512 run their servers with --gpus all (benchmarks/serving/placement.py): each GPU visible
# takes the next mode; with one GPU that is one mode after another.
# Environment: REQUESTS, RATE, BUDGET_S (per table, default 560); REPEATS (offline tables: timed runs per engine,
# req/s from the median); INTERLEAVE=1 with REPEATS=R >= 2 (offline tables: every mode's engine alive at once, the
# R runs in rounds, one engine at a time; the notes give both's ratios round by round). Under vLLM's defaults (no
# SETTINGS) each engine compiles and captures its graphs at start-up, minutes each, so the offline tables start
# their engines together by default (REPEATS=2 INTERLEAVE=1; INTERLEAVE= turns it off, REPEATS=1 with it);
# with SETTINGS the default is one run per engine, one engine after another; SETTINGS (offline
# tables and goodput512: a second line's vLLM settings for every mode, e.g. SETTINGS="--graphs full --sync
# --capture-sizes 1 2 4 8 16 32 64 128 256 512 1024 2048", benchmarks/serving/vllm_settings.py; default: vLLM's
# defaults); VLLM_PYTHONS (offline tables, interleaved: interpreters of several vLLM installs, above); BUNDLE
# (chat512: the learned bundle the lorazor modes serve); SWEEP (goodput512 and chat512: the rate sweep's options, e.g.
# SWEEP="--start-rate 100 --factor 1.1" to bracket a knee known from an earlier call, benchmarks/serving/goodput.py);
# PROFILE_RATE (chat512: after each mode's sweep, one run at that rate under vLLM's profiler,
# benchmarks/serving/chat.py); GRAPH_TOKENS (chat512's second line: vLLM's defaults but CUDA graphs up to that many
# tokens in every mode, a table of its own OUT_DIR); GRIDTRIM_LAUNCH (chat512: inductor serves GridTrim's modes with
# LORAZOR_GRIDTRIM_LAUNCH=inductor, a table of its own OUT_DIR); MODES="stock nolora" runs only those modes and adds their rows to
# OUT_DIR/<table>/bench.json (one table over several calls: give each call the same OUT_DIR, e.g. one under /tmp
# that outlives the call, and copy it out).
set -uo pipefail
out=${1:?usage: bash scripts/gpu_slot_bench.sh OUT_DIR TABLE [TABLE ...]}
shift
[ $# -gt 0 ] || { echo "name at least one table: correctness uniform512 skewed1024 full128 llama8b256 poisson512 goodput512 chat512" >&2; exit 2; }
requests=${REQUESTS:-2048}
budget=${BUDGET_S:-560}
source "$(dirname "$0")/env.sh"  # the plugin's entry point for a checkout; sets root
export PYTHONUNBUFFERED=1
# slot statistics read the engine core's scheduler, so it runs in this process
export VLLM_ENABLE_V1_MULTIPROCESSING=${VLLM_ENABLE_V1_MULTIPROCESSING:-0}
unset LORAZOR_BUNDLE LORAZOR_ADAPTERS LORAZOR_GRIDTRIM LORAZOR_SLOTS LORAZOR_CALIBRATION
if [ -z "${SETTINGS:-}" ]; then REPEATS=${REPEATS-2}; INTERLEAVE=${INTERLEAVE-1}; fi
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$root"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
python3 -c 'import torch, vllm; print("vLLM", vllm.__version__, "torch", torch.__version__)' || true
git log -1 --format='commit %H %cd' 2>/dev/null || true
rc=0

bench() {  # table, then bench arguments
    local table=$1 start=$2
    shift 2
    # shellcheck disable=SC2086  # SETTINGS is a list of options
    python3 -m benchmarks.serving.bench --out "$out/$table" --work "/tmp/lorazor_bench_$table" --requests "$requests" \
        --budget-s $((budget - ($(date +%s) - start))) --min-run-s 45 "$@" ${MODES:+--modes $MODES --append} \
        ${REPEATS:+--repeats $REPEATS} ${INTERLEAVE:+--interleave} ${VLLM_PYTHONS:+--vllm-python $VLLM_PYTHONS} \
        ${SETTINGS:-} || rc=1
    python3 -m benchmarks.serving.bench_ratios "$table" "$out/$table/bench.json" || rc=1
}

for table in "$@"; do
    start=$(date +%s)
    case $table in
    correctness)
        python3 -m benchmarks.serving.check_slots --out "$out/$table" --budget-s $((budget - 30)) || rc=1 ;;
    uniform512)
        bench "$table" "$start" --adapters 512 --max-loras 32 --modes both gridtrim stock nolora ;;
    skewed1024)
        bench "$table" "$start" --adapters 1024 --max-loras 64 --skewed --modes both gridtrim stock nolora ;;
    full128)
        bench "$table" "$start" --adapters 128 --modes both gridtrim stock nolora ;;
    llama8b256)
        bench "$table" "$start" --model llama8b --rank 16 --adapters 256 --max-loras 16 --modes both gridtrim stock nolora ;;
    poisson512)
        rate=${RATE:-$(python3 - "$out/uniform512/bench.json" <<'PY'
import json, sys
try:
    rows = {r["mode"]: r for r in json.load(open(sys.argv[1]))["rows"] if "error" not in r}
    print(f"{0.8 * rows['gridtrim']['req_per_s']:.1f}")
except (OSError, KeyError, ValueError):
    print("20")
PY
)}
        echo "Poisson arrivals at $rate req/s"
        REPEATS="" INTERLEAVE="" bench "$table" "$start" --adapters 512 --max-loras 32 --arrival-rate "$rate" --modes both gridtrim ;;  # open loop: one run
    goodput512)  # the server runs its own engine core process; goodput.py sets that for the server
        python3 -m benchmarks.serving.goodput --out "$out/$table" --work "/tmp/lorazor_bench_$table" --adapters 512 \
            --max-loras 32 --requests "$requests" --budget-s $((budget - ($(date +%s) - start))) --gpus all \
            ${MODES:+--modes $MODES --append} ${SETTINGS:-} ${SWEEP:-} || rc=1 ;;  # unquoted: lists of options
    chat512)  # vLLM's defaults in every server; the learned bundle is prepared on the GPU unless BUNDLE names one
        python3 -m benchmarks.serving.chat --out "$out/$table" --work "/tmp/lorazor_bench_$table" --adapters 512 \
            --max-loras 32 --budget-s $((budget - ($(date +%s) - start))) --gpus all \
            ${MODES:+--modes $MODES --append} ${BUNDLE:+--bundle "$BUNDLE"} ${PROFILE_RATE:+--profile-rate "$PROFILE_RATE"} \
            ${GRAPH_TOKENS:+--max-capture-size "$GRAPH_TOKENS"} ${GRIDTRIM_LAUNCH:+--gridtrim-launch "$GRIDTRIM_LAUNCH"} \
            ${SWEEP:-} || rc=1 ;;  # SWEEP unquoted: a list of options
    *)
        echo "unknown table '$table': correctness, uniform512, skewed1024, full128, llama8b256, poisson512, goodput512 or chat512" >&2
        exit 2 ;;
    esac
done
exit $rc
