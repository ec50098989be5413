"""Engines of the GridTrim-in-vLLM test (``test_gridtrim_in_vllm.py``) and its pass rule.

The model, the 32 random rank-8 adapters and the request set are ``release_engines.prepare``'s.
Every 5th request runs without an adapter, so batches mix adapter rows and rows mapped to -1. Two
engines run, each in its own process (``python -m tests.gpu.gridtrim_engines --phase ...``), on
the same requests (greedy, ``ignore_eos``, ``logprobs=5``):

- ``stock``: no ``LORAZOR_*`` variable: vLLM's runner and ``PunicaWrapperGPU``. It also runs every
  request without an adapter, to size the adapters' effect.
- ``gridtrim``: ``LORAZOR_GRIDTRIM=1``: ``GridTrimPunicaWrapper`` (LoRA linears on the work-list
  kernels, through the custom ops under torch.compile).

Phases ending in ``-defaults`` run both with vLLM's defaults (torch.compile in its default
CUDA-graph mode, async scheduling, prefix caching; ``release_engines.engine_options``), the test's
main line; the others with ``release_engines.ENGINE``'s decode CUDA graphs, synchronous and
without torch.compile, stock with ``specialize_active_lora``, the second line that tensor
parallelism runs.

Both pin vLLM's shrink to split_k=1, so the stock side is deterministic. Dummy weights give
near-flat logits and near-ties, and the two sides sum in different orders, so identical tokens
are reported, not asserted. :func:`report` passes iff each engine (every rank) uses the expected
punica wrapper and the first generated token's logprob (of the token stock chose) differs by less
than ``tol`` between the engines. Where that token is not in gridtrim's top 5, gridtrim's logprob
of it is below its 5th-best one, so the difference is at least stock's logprob minus that
5th-best one: that lower bound must be below ``tol`` too, which a real error of ``tol`` or more
cannot pass.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from benchmarks.serving.bench import check_engine_classes, engine_classes
from tests.gpu import release_engines
from tests.gpu.harness import Phase

BASE_EVERY = 5  # request i runs without an adapter when i % BASE_EVERY == BASE_EVERY - 1
TOP_LOGPROBS = 5
MODES = ("stock", "gridtrim")
DEFAULTS = "-defaults"  # phase suffix: vLLM's defaults
TOLERANCE = 0.05  # the pass rule's largest first-token |Δ logprob|


def uses_adapter(i: int) -> bool:
    return i % BASE_EVERY != BASE_EVERY - 1


def phases(defaults: bool) -> list[str]:
    """The two engines' phase names, with vLLM's defaults or on the second line."""
    return [mode + (DEFAULTS if defaults else "") for mode in MODES]


def options(mode: str, defaults: bool, tp: int, fully_sharded: bool) -> dict:
    """The engine's ``LLM`` options: vLLM's defaults, or the second line's (stock with vLLM's
    adapter-count graphs, which GridTrim does not read)."""
    opts = release_engines.engine_options(tp, fully_sharded, defaults)
    return opts if defaults else opts | {"specialize_active_lora": mode == "stock"}


def phase(name: str, work: Path, base_env: dict[str, str], n_requests: int, tp: int = 1,
          fully_sharded: bool = False, run: str = "") -> Phase:
    """The engine process of phase ``name`` on ``release_engines.prepare``'s ``work``: its results under
    ``work/out<run>``, its log ``work/<name><run>.log`` (``run`` tells apart two starts of one phase);
    ``base_env`` with the pinned shrink config, and ``LORAZOR_GRIDTRIM=1`` for the gridtrim phases."""
    args = ["--phase", name, "--work", str(work), "--out", str(work / f"out{run}"), "--requests", str(n_requests),
            "--tensor-parallel-size", str(tp)] + (["--fully-sharded-loras"] if fully_sharded else [])
    env = release_engines.phase_env(work, base_env, "stock")
    return Phase(__name__, args, env | ({"LORAZOR_GRIDTRIM": "1"} if name.startswith("gridtrim") else {}),
                 work / f"{name}{run}.log")


def aot_keys(cache_root: Path) -> set[str]:
    """The keys under which an engine with ``VLLM_CACHE_ROOT=cache_root`` saved its compiled model
    (vLLM's AOT compile cache, ``compilation/decorators.py:556-580`` of 0.33.0 and 0.34.0)."""
    aot = cache_root / "torch_compile_cache" / "torch_aot_compile"
    return {p.name for p in aot.iterdir() if p.is_dir()} if aot.is_dir() else set()


def serve(phase: str, work: Path, out: Path, n_requests: int, tp: int = 1, fully_sharded: bool = False) -> None:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    mode, defaults = phase.removesuffix(DEFAULTS), phase.endswith(DEFAULTS)
    requests = json.loads((work / "requests.json").read_text())[:n_requests]
    t0 = time.time()
    llm = LLM(model=str(work / "model"), **options(mode, defaults, tp, fully_sharded))
    per_rank = llm.collective_rpc(engine_classes)
    for classes in per_rank:  # every rank, not only rank 0
        check_engine_classes(mode, classes)
    result: dict = {"startup_s": time.time() - t0, "classes": per_rank[0], "ranks": len(per_rank)}
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True, detokenize=False,
                             logprobs=TOP_LOGPROBS) for r in requests]
    prompts = [{"prompt_token_ids": r["prompt"]} for r in requests]

    def run(with_adapters: bool) -> list[dict]:
        loras = [LoRARequest(release_engines.adapter_name(r["adapter"]), r["adapter"] + 1,
                             str(work / "adapters" / release_engines.adapter_name(r["adapter"])))
                 if with_adapters and uses_adapter(i) else None for i, r in enumerate(requests)]
        outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        return [{"tokens": list(o.outputs[0].token_ids),
                 "logprobs": [{str(t): lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs]}
                for o in outs]

    t = time.time()
    result["mixed"] = run(True)
    result["mixed_s"] = time.time() - t
    if mode == "stock":
        result["base"] = run(False)
    (out / f"{phase}.json").write_text(json.dumps(result))


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def compare(ref: list[dict], other: list[dict], subset: list[int]) -> dict:
    """Token agreement and logprob differences of ``other`` against ``ref`` over requests ``subset``:
    identical fraction, mean common-prefix fraction, first token's |Δ logprob| (of ref's token), the
    max |Δ logprob| of the chosen tokens over common prefixes, and, where other's top-k lacks ref's
    first token, how many (``first_missing``) and the largest lower bound on their |Δ logprob|
    (``first_missing_bound``: ref's logprob minus other's k-th best, since other's is below that)."""
    same, prefix, first, along, missing, bound = 0, 0.0, [], 0.0, 0, 0.0
    for i in subset:
        a, b = ref[i], other[i]
        same += a["tokens"] == b["tokens"]
        k = common_prefix(a["tokens"], b["tokens"])
        prefix += k / max(len(a["tokens"]), 1)
        t0 = str(a["tokens"][0])
        if t0 in b["logprobs"][0]:
            first.append(abs(a["logprobs"][0][t0] - b["logprobs"][0][t0]))
        else:
            missing += 1
            bound = max(bound, a["logprobs"][0][t0] - min(b["logprobs"][0].values()))
        for p in range(k):
            t = str(a["tokens"][p])
            along = max(along, abs(a["logprobs"][p][t] - b["logprobs"][p][t]))
    n = max(len(subset), 1)
    return {"requests": len(subset), "identical": same / n, "prefix": prefix / n,
            "first_max": max(first, default=float("nan")), "first_mean": sum(first) / max(len(first), 1),
            "first_missing": missing, "first_missing_bound": bound, "prefix_max": along}


def report(out: Path, n_requests: int, tol: float, defaults: bool = False,
           grid_out: Path | None = None) -> tuple[str, bool]:
    """The check rows and the pass verdict of the two engines of one line (module doc); the gridtrim
    engine's results from ``grid_out`` when given (another start of it), else from ``out``."""
    stock_phase, grid_phase = phases(defaults)
    stock = json.loads((out / f"{stock_phase}.json").read_text())
    grid = json.loads(((grid_out or out) / f"{grid_phase}.json").read_text())
    lora = [i for i in range(n_requests) if uses_adapter(i)]
    base = [i for i in range(n_requests) if not uses_adapter(i)]
    g_lora = compare(stock["mixed"], grid["mixed"], lora)
    g_base = compare(stock["mixed"], grid["mixed"], base)
    effect = compare(stock["mixed"], stock["base"], lora)
    wrappers_ok = (stock["classes"]["punica_wrapper"] == "PunicaWrapperGPU"
                   and grid["classes"]["punica_wrapper"] == "GridTrimPunicaWrapper")
    first_ok = all(c["first_max"] < tol and c["first_missing_bound"] < tol for c in (g_lora, g_base))

    def fmt(c: dict) -> str:
        return (f"{c['identical']:.3f} | {c['prefix']:.3f} | {c['first_max']:.2e} | {c['first_mean']:.2e} | "
                f"{c['prefix_max']:.2e}")

    lines = [
        "| check | result | detail |", "|---|---|---|",
        f"| punica wrappers | {'PASS' if wrappers_ok else 'FAIL'} | stock: {stock['classes']}; "
        f"gridtrim: {grid['classes']} |",
        f"| first-token logprob, gridtrim vs stock | {'PASS' if first_ok else 'FAIL'} | max abs diff "
        f"{g_lora['first_max']:.2e} (adapter requests), {g_base['first_max']:.2e} (no adapter); tolerance {tol}; "
        f"{g_lora['first_missing']} first tokens not in gridtrim's top {TOP_LOGPROBS}, their |Δ| ≥ "
        f"{g_lora['first_missing_bound']:.2e} |",
        "",
        "| comparison | requests | identical tokens | mean common-prefix fraction | first-token max abs diff logprob "
        "| first-token mean abs diff | max abs diff logprob over common prefix |",
        "|---|---|---|---|---|---|---|",
        f"| gridtrim vs stock, adapter requests | {g_lora['requests']} | {fmt(g_lora)} |",
        f"| gridtrim vs stock, no-adapter requests (same batches) | {g_base['requests']} | {fmt(g_base)} |",
        f"| for scale: stock without adapters vs stock with (the adapters' effect) | {effect['requests']} | "
        f"{fmt(effect)} |",
        "",
        f"{'vLLM defaults' if defaults else 'second line'}; tensor_parallel_size={grid.get('ranks', 1)}; "
        f"requests: {n_requests} (every {BASE_EVERY}th without adapter), "
        f"{sum(len(r['tokens']) for r in stock['mixed'])} output tokens; "
        f"start-up: stock {stock['startup_s']:.0f} s, gridtrim {grid['startup_s']:.0f} s; "
        f"generate: stock {stock['mixed_s']:.1f} s, gridtrim {grid['mixed_s']:.1f} s",
    ]
    (out / "results.json").write_text(json.dumps({"gridtrim_vs_stock_lora": g_lora, "gridtrim_vs_stock_base": g_base,
                                                  "adapter_effect": effect, "classes": {
                                                      "stock": stock["classes"], "gridtrim": grid["classes"]}},
                                                 indent=1))
    return "\n".join(lines), wrappers_ok and first_ok


def main() -> None:
    args = release_engines.engine_arguments("one engine of the GridTrim test, in this process",
                                            phases(False) + phases(True), requests=int)
    serve(args.phase, args.work, args.out, args.requests, args.tensor_parallel_size, args.fully_sharded_loras)


if __name__ == "__main__":
    main()
