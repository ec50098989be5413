#!/usr/bin/env bash
# Sourced by the scripts here (from any directory): the checkout and its vLLM plugin for every
# process vLLM starts. With `pip install -e ".[vllm]"` there is nothing to do. Otherwise:
#   LORAZOR_VLLM_SITE   a directory holding vLLM and its dependencies, prepended to PYTHONPATH
# and, when no installed distribution provides LoRazor's `vllm.general_plugins` entry point, the
# checkout goes on PYTHONPATH with a dist-info declaring it (scripts/plugin_dist_info.py).
# Exports the runner switch of the installed vLLM's line (VLLM_USE_V2_MODEL_RUNNER=0 on 0.26.0, 1 on
# 0.33.0, none on 0.34.0; serve_bridge.vllm.versions). Sets `root` to the checkout.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -n "${LORAZOR_VLLM_SITE:-}" ]; then
  export PYTHONPATH="$LORAZOR_VLLM_SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! python3 -c "import sys; from importlib.metadata import entry_points as e
sys.exit(not any(p.name == 'lorazor' for p in e(group='vllm.general_plugins')))"; then
  ep=$(python3 "$root/scripts/plugin_dist_info.py" "$(mktemp -d)")
  export PYTHONPATH="$ep:$root${PYTHONPATH:+:$PYTHONPATH}"
fi
eval "$(cd "$root" && python3 -c 'from serve_bridge.vllm.versions import runner_environment as r
print("".join(f"export {k}={v}; " for k, v in r().items()))')"
