"""Cost of the exact one-pass sweep, with and without answer-decided early stop, against one
full-LoRA generation and (``--naive``) against regenerating every candidate.

Uses a finished run directory (heads + candidates; its config recomposed from the overrides it
recorded, so its engine, hf or vLLM) and the first N
validation requests:
  (a) one full-LoRA generation, each response to its end (the unit "1 full validation generation"),
  (b) the sweep's tree pass without early stop (full-LoRA pass + one OFF continuation per distinct
      release point, each generated to its end and cut where its answer is decided afterwards),
  (c) the same tree pass with early stop (``labeling.early_stop=true``, the default),
  (d) with ``--naive``: one policy-driven generation per candidate (τ and k per adapter).
Prints the tokens each pass generated (the engine's count, before any cut) and its wall seconds,
both also per (a), and checks that (b) and (c) give the same trees.

  python -m benchmarks.sweep.bench_sweep_cost --run runs/mix-smollm2-demo --n 208
  python -m benchmarks.sweep.bench_sweep_cost --run runs/gsm8k-llama3b-custom --n 64   # engine=vllm run
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from calibrate.config import register
from calibrate.context import Context
from calibrate.rundir import RunDir
from labeling.labels import build_requests
from predictors.candidates import Candidates
from predictors.heads import load_heads
from predictors.sweep import ForkPlanner
from serve_bridge.command_line import Parser, existing_dir, need_files, number
from serve_bridge.steptrim import ProfiledPolicy, StepTrim


def measured(engine, fn: Callable[[], object]) -> tuple[object, int, float]:
    """fn()'s result, the tokens the engine generated for it and its wall seconds."""
    tokens, start = engine.generated_tokens, time.perf_counter()
    out = fn()
    return out, engine.generated_tokens - tokens, time.perf_counter() - start


def main() -> None:
    ap = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=existing_dir, required=True, help="a run directory whose heads stage finished")
    ap.add_argument("--n", type=number("positive_int"), default=8,
                    help="validation requests (the first N of the split)")
    ap.add_argument("--naive", action="store_true", help="also regenerate every candidate (slow)")
    args = ap.parse_args()
    need_files("--run", args.run, [".hydra/overrides.yaml", "heads/heads.safetensors", "heads/candidates.json"],
               "a run whose heads stage finished")
    register()
    overrides = [str(o) for o in OmegaConf.load(f"{args.run}/.hydra/overrides.yaml") if not str(o).startswith("hydra.")]
    with initialize_config_module(config_module="conf", version_base=None):
        cfg = compose("config", overrides=[*overrides, "engine.progress=false"])
    ctx = Context(cfg, RunDir(args.run))
    eng, task, names, parts = ctx.engine, ctx.task, ctx.adapter_names, ctx.adapter_parts
    examples = task.load_split("validation")[: args.n]
    heads = load_heads(f"{args.run}/heads/heads.safetensors")
    cands = Candidates.load(f"{args.run}/heads/candidates.json")
    scorer = StepTrim([heads[a].policy(0.0) if a in heads else None for a in names], eng.hidden_size)

    reqs = [r for _, r in build_requests(eng, task, examples, range(len(names)), parts)]

    def trees(early_stop: bool):
        eng.early_stop = early_stop
        planner = ForkPlanner(cands.taus, cands.ks)
        states = {r.uid: planner.new_state() for r in reqs}
        out = eng.generate(reqs, task.max_new_tokens, scorer=scorer,
                           fork=lambda res, t, s: planner.should_fork(states[res.uid], names[res.slot], t, s))
        return [(r.tokens, r.scores, r.branches) for r in out]

    def full():
        eng.early_stop = False
        return eng.generate(reqs, task.max_new_tokens)

    measured(eng, lambda: eng.generate(reqs[:2], 4))  # warm-up: the first forwards pay one-off costs
    _, full_tok, full_s = measured(eng, full)
    off, off_tok, off_s = measured(eng, lambda: trees(False))
    on, on_tok, on_s = measured(eng, lambda: trees(True))
    rows = [("(a) one full-LoRA generation", full_tok, full_s), ("(b) tree pass, no early stop", off_tok, off_s),
            ("(c) tree pass, early stop", on_tok, on_s)]
    if args.naive:
        rows.append(("(d) naive regeneration", *naive(eng, reqs, task.max_new_tokens, names, heads, cands)))
    print(f"requests × adapter: {len(reqs)}   candidates: {sum(len(cands.for_adapter(a)) for a in names)}")
    print(f"{'pass':<34}{'tokens':>10}{'seconds':>10}{'tokens / (a)':>14}{'seconds / (a)':>15}")
    for name, tok, s in rows:
        print(f"{name:<34}{tok:>10}{s:>10.1f}{tok / full_tok:>14.2f}{s / full_s:>15.2f}")
    print(f"trees identical with and without early stop: {off == on}")


def naive(eng, reqs, max_new_tokens: int, names, heads, cands) -> tuple[int, float]:
    """Tokens and seconds of one policy-driven generation per candidate, per adapter (early stop)."""
    eng.early_stop = True
    tokens, seconds = 0, 0.0
    for a_idx, a in enumerate(names):
        sub = [r for r in reqs if r.slot == a_idx]
        for policy, param in cands.for_adapter(a):
            pol = heads[a].policy(float(param)) if policy == "learned" else ProfiledPolicy(int(param))
            slots = [None] * len(names)
            slots[a_idx] = pol
            _, tok, s = measured(eng, lambda: eng.generate(sub, max_new_tokens,
                                                           steptrim=StepTrim(slots, eng.hidden_size)))
            tokens, seconds = tokens + tok, seconds + s
    return tokens, seconds


if __name__ == "__main__":
    main()
