"""engine=hf vs engine=vllm on the same labeling requests. Needs a GPU and a supported vLLM.

    python -m benchmarks.engines.compare_engines --run RUNDIR --out DIR [--limit N] [--hf-batch-size 64]

RUNDIR is a calibration run directory (``python -m calibrate ...``): its ``.hydra/config.yaml``
gives the task, backbone, adapters and the label points T. Each engine runs in its own process
(``--phase hf|vllm``) the generation that ``labeling.labels.run_labeling`` runs — the train
split × adapters, greedy full-LoRA ON responses with h_t captured at T and an OFF branch forked
at every t ∈ T the response continues past — then labels it with ``label_results``:

- hf: ``labeling/engines/hf.py`` on CUDA (``--hf-batch-size`` rows per batch), in bfloat16
  like vLLM (``--dtype``), OFF branches forked from the ON KV cache;
- vllm: ``labeling/engines/vllm/`` with its defaults (``VLLMOptions``) (plus ``--dtype``),
  OFF branches replayed from prompt + ON prefix with a forced release position.

It prints and writes (``DIR/compare.md``, ``DIR/compare.json``): generated tokens per second of
each engine (ON tokens + OFF tokens past the fork, over the wall time of ``generate`` alone —
model loading and vLLM's start-up excluded, after a small warm-up), their ratio; the fraction
of (request, t) label points with identical y (over the union of both engines' points: a point
only one engine forked counts as different), of requests with identical ON tokens, and of
common (request, t) with identical OFF tokens (overall, and where the ON prefix up to t agrees).

Why they differ at all — numerics, not semantics (both run the same release code,
``serve_bridge.steptrim``; tests/engines/test_engine_vllm.py checks the vLLM engine's
orchestration token for token against hf on CPU):

- bf16 matmuls reduce in different orders: vLLM's fused kernels (attention backends, fused
  RMSNorm / SiLU, its LoRA shrink/expand — punica, possibly split-K with atomics) vs
  transformers' eager ops with peft's per-adapter matmuls (lora_B(lora_A(x)) · scaling).
- batch composition: vLLM's continuous batching and CUDA-graph padding change which kernels and
  tile shapes each step uses; the hf engine's left-padded batches change too as rows finish.
- prefill vs decode: vLLM replays OFF branches as one prefill of prompt + ON[:t+1] (chunked when
  long), where hf decodes those tokens one by one into a forked cache; a position's KV is the
  same math computed with a different kernel.
- greedy decoding amplifies all of this: a token whose top-2 logits are within bf16 rounding can
  flip, and every later token of that response (and every label that depends on it) follows.
  Identical-ON fractions therefore fall with response length; labels y differ mostly through
  such flips in either ON or OFF.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from serve_bridge.command_line import Parser, existing_dir, need_files, number

ROOT = Path(__file__).resolve().parents[2]


def _config(run: Path, engine: str, dtype: str, hf_batch_size: int, vllm_options: list[str]):
    from omegaconf import OmegaConf

    from calibrate.config import register
    from labeling.engines.vllm.options import VLLMOptions

    register()
    cfg = OmegaConf.load(run / ".hydra" / "config.yaml")
    OmegaConf.set_struct(cfg, False)
    cfg.backbone.dtype = dtype
    if engine == "hf":
        cfg.engine = {"name": "hf", "device": "cuda", "batch_size": hf_batch_size, "progress": True}
    else:
        options = OmegaConf.from_dotlist(vllm_options)  # KEY=VALUE, values parsed as YAML
        cfg.engine = {**asdict(VLLMOptions()), "dtype": dtype, **OmegaConf.to_container(options)}
    return cfg


def phase(engine_name: str, args: argparse.Namespace) -> None:
    """Generate and label with one engine; write its results under --out."""
    import torch

    from calibrate.context import Context
    from calibrate.rundir import RunDir
    from labeling.labels import build_requests, label_results

    cfg = _config(args.run, engine_name, args.dtype, args.hf_batch_size, args.vllm_option)
    ctx = Context(cfg, RunDir(args.out / f"scratch_{engine_name}"))
    t0 = time.perf_counter()
    engine = ctx.engine
    load_s = time.perf_counter() - t0
    task, names = ctx.task, ctx.adapter_names
    examples = task.load_split("train")[: args.limit or None]
    t_set = frozenset(int(t) for t in ctx.section("labeling")["points"])
    pairs = build_requests(engine, task, examples, range(len(names)))
    reqs = [r for _, r in pairs]
    engine.generate(reqs[:2], 8, capture=t_set.__contains__, fork=lambda res, t, s: t in t_set, desc="warm-up")
    start = time.perf_counter()
    results = engine.generate(reqs, task.max_new_tokens, capture=t_set.__contains__,
                              fork=lambda res, t, s: t in t_set, desc=f"{engine_name}: labeling pass")
    wall = time.perf_counter() - start
    on_tokens = sum(len(r.tokens) for r in results)
    off_tokens = sum(len(b) - (t + 1) for r in results for t, b in r.branches.items())
    points, _ = label_results(engine, task, pairs, results, names)
    points.to_parquet(args.out / f"{engine_name}_points.parquet", index=False)
    (args.out / f"{engine_name}.json").write_text(json.dumps({
        "engine": engine_name, "dtype": args.dtype, "options": args.vllm_option if engine_name == "vllm" else [],
        "load_s": load_s, "wall_s": wall, "requests": len(reqs), "limit": args.limit,
        "on_tokens": on_tokens, "off_tokens": off_tokens, "tokens_per_s": (on_tokens + off_tokens) / wall,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "results": [{"uid": r.uid, "slot": r.slot, "tokens": r.tokens,
                     "branches": {str(t): b for t, b in r.branches.items()}} for r in results],
    }))
    print(f"{engine_name}: {len(reqs)} requests, {on_tokens} ON + {off_tokens} OFF tokens in {wall:.1f} s "
          f"({(on_tokens + off_tokens) / wall:.0f} tokens/s; load {load_s:.0f} s)", flush=True)


def check_earlier(out: Path, engines: list[str], limit: int) -> bool:
    """Before any engine runs: whether the other engine's earlier result is in ``out`` (False:
    this run writes its own result only, for a later run of the other engine to compare with).
    An earlier result of other requests than ``--limit`` asks for exits with one clear message."""
    for name in sorted({"hf", "vllm"} - set(engines)):
        path = out / f"{name}.json"
        if not path.exists():
            return False
        earlier = json.loads(path.read_text())
        had = earlier.get("limit", earlier["requests"])  # results before 2026-11-30 lack "limit"
        if had != limit and (limit or "limit" in earlier):
            sys.exit(f"{path} holds {earlier['requests']} requests (--limit {had}), but this run asks for "
                     f"--limit {limit}: pass --limit {had}, or run both engines")
    return True


def compare(out: Path) -> tuple[list[tuple[str, str, str]], list[tuple[str, str]], dict]:
    import pandas as pd

    hf, vl = (json.loads((out / f"{e}.json").read_text()) for e in ("hf", "vllm"))
    ph, pv = (pd.read_parquet(out / f"{e}_points.parquet") for e in ("hf", "vllm"))
    key = ["uid", "adapter", "t"]
    merged = ph[key + ["y"]].merge(pv[key + ["y"]], on=key, how="outer", suffixes=("_hf", "_vllm"))
    same_y = float((merged["y_hf"] == merged["y_vllm"]).mean()) if len(merged) else 1.0
    on_same, off_all, off_same, off_pref, off_pref_same = 0, 0, 0, 0, 0
    for a, b in zip(hf["results"], vl["results"], strict=True):
        assert (a["uid"], a["slot"]) == (b["uid"], b["slot"])
        on_same += a["tokens"] == b["tokens"]
        for t in set(a["branches"]) & set(b["branches"]):
            same = a["branches"][t] == b["branches"][t]
            off_all += 1
            off_same += same
            if a["tokens"][: int(t) + 1] == b["tokens"][: int(t) + 1]:
                off_pref += 1
                off_pref_same += same
    n = len(hf["results"])
    stats = {"hf_tokens_per_s": hf["tokens_per_s"], "vllm_tokens_per_s": vl["tokens_per_s"],
             "speedup": vl["tokens_per_s"] / hf["tokens_per_s"], "points_hf": len(ph), "points_vllm": len(pv),
             "points_union": len(merged), "same_y": same_y, "same_on": on_same / max(1, n),
             "same_off": off_same / max(1, off_all), "same_off_same_prefix": off_pref_same / max(1, off_pref),
             "common_off": off_all, "common_off_same_prefix": off_pref}
    rows = [
        ("device / dtype", f"{hf['device']} / {hf['dtype']}", f"{vl['device']} / {vl['dtype']}"),
        ("vllm options over conf/engine/vllm.yaml", "—", ", ".join(vl.get("options") or []) or "none"),
        ("requests (train × adapters)", str(hf["requests"]), str(vl["requests"])),
        ("ON + OFF tokens generated", f"{hf['on_tokens']} + {hf['off_tokens']}",
         f"{vl['on_tokens']} + {vl['off_tokens']}"),
        ("generate wall time (s)", f"{hf['wall_s']:.1f}", f"{vl['wall_s']:.1f}"),
        ("generated tokens / s", f"{hf['tokens_per_s']:.0f}", f"{vl['tokens_per_s']:.0f} ({stats['speedup']:.1f}×)"),
        ("model load / start-up (s, excluded)", f"{hf['load_s']:.0f}", f"{vl['load_s']:.0f}"),
        ("label points", str(len(ph)), str(len(pv))),
    ]
    same = [
        ("identical label y (union of both engines' points)", f"{100 * same_y:.1f}% of {len(merged)}"),
        ("identical ON tokens (requests)", f"{100 * stats['same_on']:.1f}% of {n}"),
        ("identical OFF tokens (points both forked)", f"{100 * stats['same_off']:.1f}% of {off_all}"),
        ("… where the ON prefix up to t agrees", f"{100 * stats['same_off_same_prefix']:.1f}% of {off_pref}"),
    ]
    return rows, same, stats


def table(rows: list[tuple[str, str, str]], same: list[tuple[str, str]]) -> str:
    lines = ["| | hf | vllm |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    lines += ["", "| hf vs vllm | |", "|---|---|"]
    lines += [f"| {a} | {b} |" for a, b in same]
    return "\n".join(lines)


def main() -> None:
    ap = Parser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", type=existing_dir, required=True, help="a calibration run directory")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dtype", default="bfloat16", help="both engines' dtype")
    ap.add_argument("--hf-batch-size", type=number("positive_int"), default=64)
    ap.add_argument("--limit", type=number("non_negative_int"), default=0, help="first N train examples (0 = all)")
    ap.add_argument("--vllm-option", action="append", default=[], metavar="KEY=VALUE",
                    help="override a VLLMOptions key (engine=vllm) for the vllm engine (repeatable), "
                         "e.g. max_num_seqs=1024")
    ap.add_argument("--engines", nargs="+", choices=["hf", "vllm"], default=["hf", "vllm"],
                    help="engines to run now; the other's results are read from --out (an earlier run)")
    ap.add_argument("--phase", choices=["all", "hf", "vllm"], default="all", help=argparse.SUPPRESS)
    args = ap.parse_args()
    need_files("--run", args.run, [".hydra/config.yaml"], "a calibration run directory")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.phase != "all":
        return phase(args.phase, args)
    comparable = check_earlier(args.out, args.engines, args.limit)
    for name in args.engines:  # one process each: GPU memory and vLLM's process state stay separate
        cmd = [sys.executable, "-m", "benchmarks.engines.compare_engines", "--phase", name, "--run", str(args.run), "--out", str(args.out),
               "--dtype", args.dtype, "--hf-batch-size", str(args.hf_batch_size), "--limit", str(args.limit),
               *[f"--vllm-option={o}" for o in args.vllm_option]]
        t = time.time()
        rc = subprocess.run(cmd).returncode
        print(f"phase {name}: rc={rc} in {time.time() - t:.0f} s", flush=True)
        if rc != 0:
            sys.exit(rc)
    if not comparable:
        other = ({"hf", "vllm"} - set(args.engines)).pop()
        print(f"no {other} result in {args.out} yet: run --engines {other} --limit {args.limit} there to compare")
        return
    rows, same, stats = compare(args.out)
    text = f"{time.strftime('%Y-%m-%d')}, `{' '.join(sys.argv)}`\n\n" + table(rows, same) + "\n"
    print(text, flush=True)
    (args.out / "compare.md").write_text(text)
    (args.out / "compare.json").write_text(json.dumps(stats, indent=1))


if __name__ == "__main__":
    main()
