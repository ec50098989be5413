#!/usr/bin/env bash
# The GPU suite with its files side by side: each file of tests/gpu runs as its own `pytest -m gpu`
# process on the one GPU, all at once (every engine the tests start reserves a fixed 4 GiB KV cache
# and needs a tenth of the GPU free at start-up: benchmarks/serving/check_slots.ENGINE_MEMORY). It
# takes about as long as the longest file (test_learned_real) instead of their sum, then prints one
# line per file and exits non-zero if any file failed. Any other test file named after OUT_DIR runs
# without the -m gpu filter (e.g. tests/serve_bridge/vllm/test_vllm_symbols.py, which checks the
# installed vLLM's names).
# Usage, from anywhere (vLLM installed, or on PYTHONPATH through LORAZOR_VLLM_SITE; scripts/env.sh):
#   bash scripts/gpu_tests.sh OUT_DIR [TEST_FILE ...]     default: every tests/gpu/test_*.py
#   JOBS=N bash scripts/gpu_tests.sh ...                  at most N files at a time (default: all at once;
#                                                         each file's engine holds its 4 GiB KV cache plus
#                                                         its weights and workspace: on a small GPU, fewer)
# Writes OUT_DIR/<file>.txt, each file's pytest output (with what passed tests printed: their figures), and
# OUT_DIR/<file>.rc, its exit code.
# test_readme_serve reads make demo's run (LORAZOR_DEMO_RUN, default runs/mix-smollm2-demo), test_learned_real
# an arith run (LORAZOR_ARITH_RUN, default runs/arith-smollm2-arith-demo); each skips without its run.
set -uo pipefail
out=${1:?usage: bash scripts/gpu_tests.sh OUT_DIR [TEST_FILE ...]}
shift
jobs_max=${JOBS:-0}
[[ $jobs_max =~ ^[0-9]+$ ]] || { echo "JOBS=$jobs_max: give a whole number of files to run at a time (0: all)" >&2; exit 2; }
source "$(dirname "$0")/env.sh"  # the plugin's entry point for a checkout; sets root
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$root"
files=("$@")
[ ${#files[@]} -gt 0 ] || files=(tests/gpu/test_*.py)
python3 -c 'import torch, vllm; print("vLLM", vllm.__version__, "torch", torch.__version__)' || true
git log -1 --format='commit %H %cd' 2>/dev/null || true
for f in "${files[@]}"; do
    case $f in tests/gpu/*) mark=gpu ;; *) mark="gpu or not gpu" ;; esac
    name=$(basename "$f" .py)
    rm -f "$out/$name.rc"
    while [ "$jobs_max" -gt 0 ] && [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do wait -n; done
    (python3 -m pytest -p no:cacheprovider -rsP -m "$mark" "$f" > "$out/$name.txt" 2>&1; echo $? > "$out/$name.rc") &
done
wait
rc=0
for f in "${files[@]}"; do
    name=$(basename "$f" .py)
    frc=$(cat "$out/$name.rc" 2>/dev/null || echo "?")
    [ "$frc" = 0 ] || [ "$frc" = 5 ] || rc=1  # 5: every test deselected or skipped
    echo "$f: $(grep -E '^[0-9]+ (passed|failed|skipped|deselected|error)|^=+ .*(passed|failed|skipped|deselected|error)' "$out/$name.txt" | tail -1 | tr -d '=') (exit $frc)"
done
exit $rc
