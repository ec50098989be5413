"""Host time per engine step of the bridge's bookkeeping: ``begin_step`` (release masking,
forward counting, decision and capture plans) plus, in calibration mode, ``capture``. No vLLM,
no GPU: this is the Python the runner executes on every step before the forward.

    python -m benchmarks.serve_bridge.bench_step_host [--rows 256 1024] [--steps 200] [--out DIR [--replace]]

Cases (each at every ``--rows``, all rows decode rows that complete a forward every step):
- ``serving``: :class:`~serve_bridge.runtime.ReleaseRuntime` over 128 adapters with profiled
  policies whose k is never reached (``bench_decision.make_runtime``: every row's k is checked on
  the host every step), half the rows force-released so the mask has work;
- ``calibration ON pass``: :class:`~serve_bridge.calibration.CalibrationRuntime` with the label
  points' capture set and no scorer (the labeling pass);
- ``calibration sweep``: the same with a learned scorer (s_t every step, the sweep pass).

The decision itself (``decide``/``resolve``) is not timed here: on the GPU it is an
asynchronous launch (``bench_decision.py`` measures it). Reports the median and p95 over the
timed steps, in ms.
"""
from __future__ import annotations

import datetime as dt
import json
import platform
import sys
import time

import numpy as np
import torch

from benchmarks.printed import add_out_dir_options, check_out
from benchmarks.serve_bridge.bench_decision import make_runtime
from serve_bridge.calibration import CalibrationRuntime, calibration_config
from serve_bridge.command_line import Parser, number
from serve_bridge.runtime import ReleaseRuntime
from serve_bridge.safe_write import write_atomic
from serve_bridge.steptrim import LearnedPolicy, StepTrim

HIDDEN = 576  # SmolLM2-135M, the embedded backbone calibration runs on
PROMPT = 100
POINTS = (0, 1, 2, 3, 7, 15, 31, 63)
OUT_FILES = ("step_host.md", "step_host.json")


def serving(rows: int) -> tuple[ReleaseRuntime, list[str], list[int]]:
    rt = make_runtime(128, HIDDEN, "cpu", "eager", rows, policy="profiled")
    names = sorted(rt.slot_of)
    ids = [f"s{i}" for i in range(rows)]
    for i, r in enumerate(ids):
        forced = {"lorazor": {"release_position": PROMPT + 5}} if i % 2 else None
        rt.add(r, names[i % len(names)], f"/bench/{names[i % len(names)]}", PROMPT, forced)
    return rt, ids, [1 + i % len(names) for i in range(rows)]


def calibration(rows: int, scorer: bool) -> tuple[CalibrationRuntime, list[str], list[int]]:
    rt = CalibrationRuntime(HIDDEN, "cpu", cuda_graphs=False, max_rows=rows)
    head = StepTrim([LearnedPolicy(torch.randn(HIDDEN), 0.0, 1e9)], HIDDEN, "cpu")
    rt.configure(calibration_config(["a"], scorer=head if scorer else None, capture=POINTS))
    ids = [f"c{i}" for i in range(rows)]
    for i, r in enumerate(ids):
        rt.add(r, "a", None, PROMPT, {"lorazor": {"uid": f"u{i}"}})
    return rt, ids, [1] * rows


def time_steps(rt: ReleaseRuntime, ids: list[str], lora: list[int], steps: int) -> np.ndarray:
    rows = len(ids)
    hidden = torch.randn(rows, HIDDEN)
    capture = getattr(rt, "capture", None)
    out = []
    for step in range(steps + 10):
        computed = np.full(rows, PROMPT + step, np.int64)
        scheduled = np.ones(rows, np.int64)
        start = time.perf_counter()
        rt.begin_step(ids, computed, scheduled, computed + 1, lora, lora)
        if capture is not None:
            capture(hidden)
        out.append(time.perf_counter() - start)
    return np.array(out[10:]) * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = Parser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=number("positive_int"), nargs="+", default=[256, 1024])
    ap.add_argument("--steps", type=number("positive_int"), default=200)
    add_out_dir_options(ap, OUT_FILES)
    args = ap.parse_args(argv)
    check_out(args, OUT_FILES)
    torch.manual_seed(0)
    results = []
    lines = ["| case | rows | median ms/step | p95 ms/step |", "|---|---|---|---|"]
    for rows in args.rows:
        for case, make in (("serving", lambda: serving(rows)),
                           ("calibration ON pass", lambda: calibration(rows, False)),
                           ("calibration sweep", lambda: calibration(rows, True))):
            ms = time_steps(*make(), args.steps)
            results.append({"case": case, "rows": rows, "median_ms": float(np.median(ms)),
                            "p95_ms": float(np.percentile(ms, 95))})
            lines.append(f"| {case} | {rows} | {np.median(ms):.2f} | {np.percentile(ms, 95):.2f} |")
    head = (f"{dt.date.today()}, {platform.processor() or platform.machine()}, torch {torch.__version__}, "
            f"`{' '.join(sys.argv)}`")
    text = head + "\n\n" + "\n".join(lines) + "\n"
    print(text)
    if args.out:
        write_atomic(args.out / OUT_FILES[0], text)
        write_atomic(args.out / OUT_FILES[1], json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
