"""Cost of the exact one-pass sweep vs one full-LoRA generation and vs naive regeneration.

Uses a finished run directory (heads + candidates) and the first N validation requests:
  (a) one full-LoRA generation (the unit "1 full validation generation"),
  (b) the sweep's tree pass (full-LoRA pass + one OFF continuation per distinct release point),
  (c) naive regeneration: one policy-driven generation per candidate (32 τ + 9 k per adapter).
Prints generated tokens and wall seconds of each, and the ratios, all measured in one process.

  python -m benchmarks.sweep.bench_sweep_cost --run runs/arith-smollm2-arith-demo --n 8
"""
from __future__ import annotations

import argparse
import time

from omegaconf import OmegaConf

from calibrate.context import Context
from calibrate.config import register
from calibrate.rundir import RunDir
from labeling.labels import build_requests
from predictors.candidates import Candidates
from predictors.heads import load_heads
from predictors.sweep import ForkPlanner
from serve_bridge.steptrim import ProfiledPolicy, StepTrim


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True)
    ap.add_argument("--n", type=int, default=8)
    args = ap.parse_args()
    register()
    cfg = OmegaConf.load(f"{args.run}/.hydra/config.yaml")
    cfg.engine.progress = False
    ctx = Context(cfg, RunDir(args.run))
    eng, task, names = ctx.engine, ctx.task, ctx.adapter_names
    examples = task.load_split("validation")[: args.n]
    heads = load_heads(f"{args.run}/heads/heads.safetensors")
    cands = Candidates.load(f"{args.run}/heads/candidates.json")
    scorer = StepTrim([heads[a].policy(0.0) for a in names], eng.hidden_size)
    reqs = [r for _, r in build_requests(eng, task, examples, range(len(names)))]

    eng.generate(reqs[:2], 4)  # warm-up: the first forward of a process pays one-off setup costs
    t = time.perf_counter()
    full = eng.generate(reqs, task.max_new_tokens)
    full_s, full_tok = time.perf_counter() - t, sum(len(r.tokens) for r in full)

    t = time.perf_counter()
    planner = ForkPlanner(cands.taus, cands.ks)
    states = {r.uid: planner.new_state() for r in reqs}
    tree = eng.generate(reqs, task.max_new_tokens, scorer=scorer,
                        fork=lambda res, t_, s: planner.should_fork(states[res.uid], names[res.slot], t_, s))
    tree_s = time.perf_counter() - t
    tree_tok = sum(len(r.tokens) + sum(len(b) - (k + 1) for k, b in r.branches.items()) for r in tree)

    naive_s, naive_tok, n_cand = 0.0, 0, 0
    for a_idx, a in enumerate(names):
        sub = [r for r in reqs if r.slot == a_idx]
        for policy, param in cands.for_adapter(a):
            pol = heads[a].policy(float(param)) if policy == "learned" else ProfiledPolicy(int(param))
            slots = [None] * len(names)
            slots[a_idx] = pol
            t = time.perf_counter()
            out = eng.generate(sub, task.max_new_tokens, steptrim=StepTrim(slots, eng.hidden_size))
            naive_s += time.perf_counter() - t
            naive_tok += sum(len(r.tokens) for r in out)
            n_cand += 1
    print(f"requests: {len(reqs)}   candidates: {n_cand}")
    print(f"{'pass':<34}{'tokens':>10}{'seconds':>10}{'tokens / full':>15}{'seconds / full':>16}")
    for name, tok, s in (("(a) one full-LoRA generation", full_tok, full_s), ("(b) sweep tree pass", tree_tok, tree_s),
                         ("(c) naive regeneration", naive_tok, naive_s)):
        print(f"{name:<34}{tok:>10}{s:>10.1f}{tok / full_tok:>15.2f}{s / full_s:>16.2f}")
    print(f"naive / tree: {naive_tok / tree_tok:.1f}x tokens, {naive_s / tree_s:.1f}x wall time")


if __name__ == "__main__":
    main()
