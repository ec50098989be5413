"""Slot capacity model: how many requests a max_loras-limited engine admits, with and without release.

    python -m serve_bridge.capacity --bundle DIR --adapters 512 [--skew 0.8 | --zipf 1] --max-num-seqs 256 \\
        [--requests 2048 | --rate R --step-ms MS] [--prompt-len 100 300] [--output-len 20 100] \\
        [--max-loras 16 32 64] [--plot slots.png] [--json slots.json] [--replace]

The model is a discrete-time simulation of vLLM 0.26's admission rules (the scheduler's, see
:mod:`serve_bridge.vllm.scheduler`), one step per engine step. vLLM 0.33 also counts the adapters
of running requests the token budget leaves unscheduled; the two agree whenever every running
request is scheduled, as in the 512/32 table (docs/vllm_integration.md §11):

- running requests first, in admission order, each taking the tokens it still needs (a prefill
  chunk or one decode token) from the step's token budget (``max_num_batched_tokens``);
- then waiting requests, first come first served: one is admitted while fewer than
  ``max_num_seqs`` run and budget is left, if its adapter already holds a slot or fewer than
  ``max_loras`` adapters hold one; otherwise it is skipped for this step (vLLM's rule);
- a request of prompt P released at r holds its adapter's slot in a step that starts before
  position P + r (docs/design.md §2: the adapter runs at forwards t ≤ r); without release, always.

Measured per step: running requests (admitted concurrency) and distinct adapters holding a slot
(slot occupancy). Per request: the wait from arrival to admission (mean and P90, in steps; times
the step time, the part of the time to first token that the slots and the engine limits add).
Over the run: the share of token forwards that run an adapter (prefill chunks and decode steps
before the release point), and slot loads, the adapter writes into a GPU slot
under least-recently-used replacement of ``max_loras`` slots (vLLM's LRU adapter manager). The
model touches a step's resident adapters before a missing one evicts; vLLM touches them in its
request set's order, where an eviction can hit an adapter the same step uses and write it again.
Asked for ``graph_tokens``, the count of steps scheduling more tokens than that: vLLM runs a step
past its largest CUDA graph without one, and release, which admits more requests, puts prefill into
more steps (512 adapters, 32 slots, the uniform bench workload: 377 of 611 steps past 512 tokens
with release, 349 of 1341 without). KV-cache capacity is taken as ample (no preemption), and
offline requests all arrive at step 0; open loop (``--rate``) maps Poisson arrival times to steps
with ``--step-ms``.

Traffic spreads over ``--adapters`` uniformly, or with ``--skew S`` a share S of the requests on
20% of the adapters, or with ``--zipf s`` by Zipf popularity, adapter a (0 … N−1) drawn with
probability ∝ (a+1)^−s (:func:`popularity`; s = 1 puts 60% of the requests of 512 adapters on the
first 32). Prompt lengths are the tokens a request computes: with prefix caching, its uncached part.

Release points come from the bundle: ``stats['release_points']`` (validation release points of
the exported policy, written by ``predictors.export``), else a profiled k as a point mass; an
adapter without policy (or a learned one exported without the distribution) never releases.
Traffic adapter i uses bundle adapter i mod B (sorted names), and a request's r is drawn from its
adapter's distribution independently of its output length. The needed max_loras is the smallest
candidate whose throughput (requests per step) is within ``--tolerance`` of unlimited slots.

The command keeps the contract of every LoRazor command (:mod:`serve_bridge.command_line`): a
bad argument, a bundle it cannot read or whose recorded release points are malformed, or an
output it may not write is one line on stderr and exit code 2, before any simulation. The work
is bounded before it starts: engine limits are positive (so every step with requests serves a
token), at most :data:`MAX_REQUESTS` requests of at most :data:`MAX_LENGTH` prompt and output
tokens each and :data:`MAX_FORWARDS` token forwards in all, arriving within :data:`MAX_STEPS`
steps. ``--plot`` and ``--json`` are new files (``--replace`` replaces existing ones) outside the
bundle, written under a temporary name and renamed (:mod:`serve_bridge.safe_write`).
"""
from __future__ import annotations

import heapq
import io
import json
import os
import sys
from argparse import Namespace
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from serve_bridge.command_line import MinMax, Parser, check_args, option_name, report
from serve_bridge.safe_write import check_output, write_atomic
from serve_bridge.values import OptionError, check_at_most, check_value

NEVER = -1  # release point of a request that is never released
HOT_ADAPTERS = 0.2  # skewed traffic: a share ``skew`` of requests on 20% of the adapters
MAX_ADAPTERS = 1 << 20
MAX_REQUESTS = 1 << 20
MAX_LENGTH = 1 << 24  # prompt or output tokens of one request (release points are exact below 2**24)
MAX_FORWARDS = 1 << 30  # requests × (longest prompt + longest output): the token forwards one simulation may serve
# engine steps until the last request arrives (open loop): arrival steps stay exact as float64 (idle steps cost
# no work, :func:`simulate` jumps over them)
MAX_STEPS = 1 << 53


@dataclass(frozen=True)
class ReleaseDistribution:
    """Release points r with probabilities; ``never`` = probability of no release."""

    r: tuple[int, ...]
    p: tuple[float, ...]
    never: float

    @staticmethod
    def point(k: int) -> ReleaseDistribution:
        return ReleaseDistribution((int(k),), (1.0,), 0.0)

    @staticmethod
    def no_release() -> ReleaseDistribution:
        return ReleaseDistribution((), (), 1.0)

    def draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """n release points (NEVER for no release)."""
        values = np.array([*self.r, NEVER], dtype=np.int64)
        return values[rng.choice(values.size, size=n, p=[*self.p, self.never])]


@dataclass(frozen=True)
class Requests:
    """A request set: adapter index, prompt and output length, release point (NEVER: none),
    and the step it arrives at (0 offline); arrival order is the array order."""

    adapter: np.ndarray
    prompt: np.ndarray
    output: np.ndarray
    release: np.ndarray
    arrival: np.ndarray


@dataclass(frozen=True)
class Result:
    """One simulation: steps to serve every request, requests per step, mean running requests
    and mean slot occupancy over the steps with work, the largest occupancy, the mean and P90 wait
    from arrival to admission in steps, the share of token forwards with an adapter, the
    slot loads (module doc), and the steps with more tokens than ``graph_tokens`` (vLLM runs those
    without a CUDA graph; 0 unless asked)."""

    max_loras: int
    release: bool
    steps: int
    requests_per_step: float
    mean_running: float
    mean_occupancy: float
    max_occupancy: int
    mean_wait_steps: float
    p90_wait_steps: float
    lora_share: float
    slot_loads: int
    steps_past_graphs: int = 0


def _counts(value: object, limit: int) -> bool:
    """Whether ``value`` is a list of integers in 0…limit−1."""
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < limit
                                           for v in value)


def release_histogram(hist: object, where: str) -> ReleaseDistribution:
    """``stats['release_points']`` (``{"r": [...], "count": [...], "never": n}``, written by
    ``predictors.export``) as a distribution; BundleError naming ``where`` unless ``r`` are release
    points below :data:`MAX_LENGTH`, ``count`` as many non-negative counts and ``never`` a
    non-negative count, with at least one request counted."""
    from serve_bridge.bundle import BundleError

    ok = (isinstance(hist, dict) and _counts(hist.get("r"), MAX_LENGTH) and _counts(hist.get("count"), 1 << 53)
          and _counts([hist.get("never")], 1 << 53) and len(hist["r"]) == len(hist["count"]))
    total = sum(hist["count"]) + hist["never"] if ok else 0
    if not total:
        raise BundleError(f"{where}: stats['release_points'] is not {{'r': [release points], 'count': [as many "
                          f"counts ≥ 0], 'never': count ≥ 0}} with a request in it; re-export the bundle.")
    return ReleaseDistribution(tuple(hist["r"]), tuple(c / total for c in hist["count"]), hist["never"] / total)


def distributions_from_bundle(directory: str | Path) -> tuple[list[str], list[ReleaseDistribution], list[str]]:
    """Adapter names (sorted), their release distributions, and notes on approximations; a
    BundleError for a bundle that does not load or whose release points are malformed."""
    from serve_bridge.bundle import MANIFEST, load_bundle  # torch and safetensors, only for the bundle

    bundle = load_bundle(directory)
    names, dists, notes = sorted(bundle.adapters), [], []
    for name in names:
        e = bundle.adapters[name]
        hist = e.stats.get("release_points")
        if e.policy == "none":
            dists.append(ReleaseDistribution.no_release())
        elif hist is not None:
            dists.append(release_histogram(hist, f"{bundle.path / MANIFEST} adapter '{name}'"))
        elif e.policy == "profiled":
            dists.append(ReleaseDistribution.point(e.k))
        else:
            notes.append(f"adapter '{name}': learned, without release points in its stats (re-export the bundle); "
                         f"modelled as never released")
            dists.append(ReleaseDistribution.no_release())
    return names, dists, notes


def popularity(n_adapters: int, zipf: float) -> np.ndarray:
    """Zipf popularity: P(adapter a) ∝ (a+1)^−zipf, a = 0 … N−1 (zipf = 0: uniform)."""
    w = np.arange(1, n_adapters + 1, dtype=np.float64) ** -zipf
    return w / w.sum()


def draw_requests(n: int, dists: Sequence[ReleaseDistribution], n_adapters: int, *, skew: float | None = None,
                  zipf: float | None = None, prompt_len: tuple[int, int] = (100, 300),
                  output_len: tuple[int, int] = (20, 100), rate: float | None = None, step_ms: float | None = None,
                  seed: int = 0) -> Requests:
    """n requests over ``n_adapters`` adapters (adapter i releases like ``dists[i % len(dists)]``):
    uniform, a share ``skew`` on the first 20% of adapters, or by :func:`popularity` ``zipf`` (at
    most one of the two); lengths uniform, inclusive. With ``rate`` (req/s) arrivals are Poisson,
    mapped to steps of ``step_ms``."""
    if skew is not None and zipf is not None:
        raise ValueError("give skew or zipf, not both")
    rng = np.random.default_rng(seed)
    if zipf is not None:
        adapter = rng.choice(n_adapters, n, p=popularity(n_adapters, zipf))
    elif skew is None:
        adapter = rng.integers(0, n_adapters, n)
    else:
        hot = min(max(1, round(HOT_ADAPTERS * n_adapters)), max(1, n_adapters - 1))
        adapter = np.where(rng.random(n) < skew, rng.integers(0, hot, n), rng.integers(hot, n_adapters, n))
    prompt = rng.integers(prompt_len[0], prompt_len[1] + 1, n)
    output = rng.integers(output_len[0], output_len[1] + 1, n)
    release = np.full(n, NEVER, dtype=np.int64)
    for a in np.unique(adapter):
        rows = np.flatnonzero(adapter == a)
        release[rows] = dists[a % len(dists)].draw(rows.size, rng)
    arrival = np.zeros(n, dtype=np.int64)
    if rate is not None:
        gaps = rng.exponential(1.0 / rate, n)
        gaps[0] = 0.0
        arrival = np.floor(np.cumsum(gaps) * 1e3 / step_ms).astype(np.int64)
    return Requests(adapter, prompt, output, release, arrival)


def simulate(reqs: Requests, max_loras: int, *, release: bool = True, max_num_seqs: int = 256,
             token_budget: int = 2048, graph_tokens: int | None = None) -> Result:
    """Serve ``reqs`` step by step under vLLM's admission rules (module doc).

    vLLM scans the waiting queue in order, skipping requests whose adapter has no slot. Slots only
    fill up during a scan, so the scan admits every request in order until all ``max_loras``
    slots are held, then only requests of held adapters, in order; that is what this does, with
    one queue per adapter and a heap of the held adapters' oldest requests. Every limit must be
    positive (ValueError otherwise): then each step with a request present serves a token.
    """
    if min(max_loras, max_num_seqs, token_budget) < 1:
        raise ValueError(f"max_loras {max_loras}, max_num_seqs {max_num_seqs} and token_budget {token_budget} must "
                         f"be ≥ 1: with one of them 0 no request is ever served")
    n = reqs.adapter.size
    adapter, prompt, output = reqs.adapter.tolist(), reqs.prompt.tolist(), reqs.output.tolist()
    end = [p + (r if r != NEVER and release else 1 << 60) for p, r in zip(prompt, reqs.release.tolist())]
    arrival = reqs.arrival.tolist()
    computed, generated, admitted_at = [0] * n, [0] * n, [0] * n
    is_waiting = [False] * n
    running: list[int] = []
    order: deque[int] = deque()  # waiting requests in arrival order (admitted ones dropped lazily)
    queues: dict[int, deque[int]] = {}  # adapter → its waiting requests in arrival order
    nxt, done, step, waiting = 0, 0, 0, 0
    sum_running = sum_occupied = max_occupied = work_steps = tokens = lora_tokens = loads = past_graphs = 0
    resident: OrderedDict[int, None] = OrderedDict()  # adapters in GPU slots, least recently used first
    while done < n:
        if not running and waiting == 0:
            step = max(step, arrival[nxt])  # an idle engine: on to the next arrival (those steps serve nothing)
        while nxt < n and arrival[nxt] <= step:
            order.append(nxt)
            queues.setdefault(adapter[nxt], deque()).append(nxt)
            is_waiting[nxt] = True
            nxt += 1
            waiting += 1
        budget, scheduled, holders = token_budget, [], set()
        for i in running:
            if budget == 0:
                break
            k = min(prompt[i] + generated[i] - computed[i], budget)
            scheduled.append((i, k))
            budget -= k
            if computed[i] < end[i]:
                holders.add(adapter[i])
        heads: list[tuple[int, int]] | None = None  # (oldest waiting request, adapter) of held adapters
        while budget > 0 and len(running) < max_num_seqs:
            if len(holders) < max_loras:
                while order and not is_waiting[order[0]]:
                    order.popleft()
                if not order:
                    break
                i = order[0]
            else:
                if heads is None:
                    heads = [(queues[a][0], a) for a in holders if queues.get(a)]
                    heapq.heapify(heads)
                if not heads:
                    break
                i = heapq.heappop(heads)[0]
            a = adapter[i]
            queues[a].popleft()
            is_waiting[i] = False
            waiting -= 1
            if heads is not None and queues[a]:
                heapq.heappush(heads, (queues[a][0], a))
            k = min(prompt[i], budget)
            running.append(i)
            scheduled.append((i, k))
            budget -= k
            holders.add(a)
            admitted_at[i] = step
        used = {adapter[i]: None for i, k in scheduled if computed[i] < end[i]}  # step order, once each
        missing = [a for a in used if a not in resident]
        for a in used:
            if a in resident:
                resident.move_to_end(a)
        for a in missing:
            if len(resident) >= max_loras:
                resident.popitem(last=False)
            resident[a] = None
        loads += len(missing)
        for i, k in scheduled:
            tokens += k
            lora_tokens += min(k, max(0, end[i] - computed[i]))
        if scheduled:
            work_steps += 1
            past_graphs += graph_tokens is not None and token_budget - budget > graph_tokens
            sum_running += len(scheduled)
            sum_occupied += len(holders)
            max_occupied = max(max_occupied, len(holders))
        finished = set()
        for i, k in scheduled:
            computed[i] += k
            if computed[i] == prompt[i] + generated[i]:
                generated[i] += 1
                if generated[i] == output[i]:
                    finished.add(i)
        if finished:
            running = [i for i in running if i not in finished]
        done += len(finished)
        step += 1
    wait = np.asarray(admitted_at) - reqs.arrival
    return Result(max_loras, release, step, n / step, sum_running / max(1, work_steps),
                  sum_occupied / max(1, work_steps), max_occupied, float(wait.mean()) if n else 0.0,
                  float(np.percentile(wait, 90)) if n else 0.0, lora_tokens / max(1, tokens), loads, past_graphs)


def sweep(reqs: Requests, candidates: Sequence[int], **engine: int) -> list[Result]:
    """:func:`simulate` without and with release at every candidate max_loras."""
    return [simulate(reqs, m, release=rel, **engine) for m in candidates for rel in (False, True)]


def needed_max_loras(results: Sequence[Result], unlimited: dict[bool, Result],
                     tolerance: float) -> dict[bool, int | None]:
    """Per release setting, the smallest max_loras whose requests per step reach (1 − tolerance)
    of ``unlimited``'s (one slot per adapter); None if no candidate does."""
    out: dict[bool, int | None] = {}
    for rel in (False, True):
        ok = [r.max_loras for r in results
              if r.release == rel and r.requests_per_step >= (1 - tolerance) * unlimited[rel].requests_per_step]
        out[rel] = min(ok) if ok else None
    return out


def plot(results: Sequence[Result], path: Path, title: str) -> Path:
    """Admitted concurrency, slot occupancy and slot loads vs max_loras, with and without release,
    written to ``path`` as a PNG (:func:`serve_bridge.safe_write.write_atomic`)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 3.6), layout="constrained")
    FigureCanvasAgg(fig)
    panels = (("mean running requests per step", lambda r: r.mean_running),
              ("mean slots held per step", lambda r: r.mean_occupancy),
              ("slot loads (adapter writes into a slot)", lambda r: r.slot_loads))
    for ax, (what, value) in zip(fig.subplots(1, len(panels)), panels):
        for rel, style in ((False, "o--"), (True, "s-")):
            rows = sorted((r for r in results if r.release == rel), key=lambda r: r.max_loras)
            ax.plot([r.max_loras for r in rows], [value(r) for r in rows], style,
                    label="with release" if rel else "without release")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("max_loras")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    png = io.BytesIO()
    fig.savefig(png, dpi=120, format="png")
    write_atomic(path, png.getvalue())
    return path


def popularity_label(skew: float | None, zipf: float | None) -> str:
    """How the traffic spreads over the adapters, in words."""
    if zipf is not None:
        return f"Zipf s = {zipf:g}"
    return "uniform" if skew is None else f"{skew:.0%} on 20%"


ARG_RULES = {"adapters": "positive_int", "skew": "probability", "zipf": "non_negative_number",
             "requests": "positive_int", "rate": "positive_number", "step_ms": "positive_number",
             "max_num_seqs": "positive_int", "max_num_batched_tokens": "positive_int", "tolerance": "share",
             "seed": "seed", "graph_tokens": "non_negative_int"}


def parser() -> Parser:
    ap = Parser(prog="python -m serve_bridge.capacity", description=__doc__.split("\n")[0])
    ap.add_argument("--bundle", type=Path, required=True, help="policy bundle directory")
    ap.add_argument("--adapters", type=int, required=True, help="adapters the traffic spreads over")
    ap.add_argument("--skew", type=float, default=None, help="share of requests on 20%% of the adapters (e.g. 0.8)")
    ap.add_argument("--zipf", type=float, default=None,
                    help="Zipf popularity exponent s: adapter a drawn with probability ∝ (a+1)^-s (e.g. 1)")
    ap.add_argument("--requests", type=int, default=2048, help="requests simulated")
    ap.add_argument("--rate", type=float, default=None, help="Poisson arrivals, requests/s (default: offline)")
    ap.add_argument("--step-ms", type=float, default=None, help="engine step time, ms (needed with --rate)")
    ap.add_argument("--prompt-len", type=int, nargs=2, action=MinMax, default=(100, 300), metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, action=MinMax, default=(20, 100), metavar=("MIN", "MAX"))
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--graph-tokens", type=int, default=512,
                    help="the engine's largest CUDA graph in tokens (vLLM's default on Hopper: 512; 0: no graphs): "
                         "steps of more tokens run without one")
    ap.add_argument("--max-loras", type=int, nargs="+", default=None,
                    help="candidate max_loras (default: powers of two up to --adapters)")
    ap.add_argument("--tolerance", type=float, default=0.05,
                    help="needed max_loras: within this share of the throughput with one slot per adapter")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", type=Path, default=None, help="PNG of concurrency, occupancy and slot loads vs max_loras")
    ap.add_argument("--json", type=Path, default=None, help="write the results as JSON")
    ap.add_argument("--replace", action="store_true", help="replace existing --plot and --json files")
    return ap


def check_arguments(args: Namespace) -> None:
    """OptionError naming the first argument out of range (module doc), before any work."""
    check_args(args, ARG_RULES)
    for dest in ("prompt_len", "output_len", "max_loras"):
        for value in getattr(args, dest) or ():
            check_value(option_name(dest), value, "positive_int")
    for dest in ("prompt_len", "output_len"):  # MIN ≤ MAX: the parser's MinMax
        check_at_most(option_name(dest), getattr(args, dest)[1], MAX_LENGTH, "tokens of one request")
    check_at_most("--adapters", args.adapters, MAX_ADAPTERS, "adapters one simulation spreads traffic over")
    check_at_most("--requests", args.requests, MAX_REQUESTS, "requests one simulation serves")
    forwards = args.requests * (args.prompt_len[1] + args.output_len[1])
    if forwards > MAX_FORWARDS:
        raise OptionError("--requests", args.requests, f"with prompts and outputs up to {args.prompt_len[1]} and "
                          f"{args.output_len[1]} tokens a simulation may serve {forwards} token forwards, more than "
                          f"{MAX_FORWARDS}; simulate fewer or shorter requests")
    if args.skew is not None and args.zipf is not None:
        raise OptionError("--zipf", args.zipf, "is a popularity as --skew is; give one of the two")
    if args.skew is not None and args.adapters < 2:
        raise OptionError("--skew", args.skew, "needs --adapters ≥ 2 (a hot and a cold share)")
    if args.rate is not None:
        if args.step_ms is None:
            raise OptionError("--rate", args.rate, "needs --step-ms, the engine's step time")
        last = args.requests / args.rate * 1e3 / args.step_ms
        if last > MAX_STEPS:
            raise OptionError("--rate", args.rate, f"the last of {args.requests} requests would arrive after about "
                              f"{last:.3g} steps of {args.step_ms:g} ms, more than {MAX_STEPS}; raise --rate or "
                              f"--step-ms")
    if not args.bundle.is_dir():
        raise OptionError("--bundle", str(args.bundle), "not a directory")


def check_outputs(args: Namespace) -> None:
    """OptionError unless ``--plot`` and ``--json`` may be written (module doc); after the bundle
    loaded, so its directory holds its files and nothing else."""
    if args.plot and args.json and os.path.abspath(args.plot) == os.path.abspath(args.json):
        raise OptionError("--json", str(args.json), "is also --plot; give each output its own path")
    inputs = [args.bundle, *args.bundle.iterdir()]  # its files too: a hard link to one is that file
    for key, path in (("--plot", args.plot), ("--json", args.json)):
        if path is not None:
            check_output(key, path, inputs, directory=False, replace=args.replace)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from serve_bridge.bundle import BundleError

    try:
        check_arguments(args)
        names, dists, notes = distributions_from_bundle(args.bundle)
        check_outputs(args)
    except (OptionError, BundleError) as err:
        return report(str(err))
    if not names:
        return report(f"bundle {args.bundle} has no adapters")
    reqs = draw_requests(args.requests, dists, args.adapters, skew=args.skew, zipf=args.zipf,
                         prompt_len=tuple(args.prompt_len),
                         output_len=tuple(args.output_len), rate=args.rate, step_ms=args.step_ms, seed=args.seed)
    powers = [2 ** i for i in range(args.adapters.bit_length()) if 2 ** i < args.adapters]
    candidates = sorted(set(args.max_loras or powers))
    engine = {"max_num_seqs": args.max_num_seqs, "token_budget": args.max_num_batched_tokens,
              "graph_tokens": args.graph_tokens}
    results = sweep(reqs, [m for m in candidates if m < args.adapters], **engine)
    unlimited = {rel: simulate(reqs, args.adapters, release=rel, **engine) for rel in (False, True)}
    results += list(unlimited.values())
    need = needed_max_loras(results, unlimited, args.tolerance)
    traffic = (f"{args.requests} requests over {args.adapters} adapters "
               f"({popularity_label(args.skew, args.zipf)}), prompts {args.prompt_len[0]}-"
               f"{args.prompt_len[1]}, outputs {args.output_len[0]}-{args.output_len[1]}, "
               + (f"Poisson {args.rate:g} req/s at {args.step_ms:g} ms/step" if args.rate else "offline")
               + f"; max_num_seqs {args.max_num_seqs}, token budget {args.max_num_batched_tokens}")
    print(f"bundle {args.bundle}: {len(names)} adapters; {traffic}")
    for note in notes:
        print(f"note: {note}")
    print("| max_loras | release | steps | req/step | mean running | mean slots held | max slots held | "
          f"wait mean / P90 (steps) | token forwards with adapter | slot loads | steps past {args.graph_tokens} "
          "tokens (no CUDA graph) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(results, key=lambda r: (r.max_loras, r.release)):
        print(f"| {r.max_loras} | {'yes' if r.release else 'no'} | {r.steps} | {r.requests_per_step:.3f} | "
              f"{r.mean_running:.1f} | {r.mean_occupancy:.1f} | {r.max_occupancy} | {r.mean_wait_steps:.1f} / "
              f"{r.p90_wait_steps:.1f} | {r.lora_share:.1%} | {r.slot_loads} | {r.steps_past_graphs} "
              f"({r.steps_past_graphs / max(1, r.steps):.0%}) |")
    for rel in (False, True):
        m = need[rel]
        print(f"max_loras needed {'with' if rel else 'without'} release (within {args.tolerance:.0%} of one slot "
              f"per adapter): " + (str(m) if m is not None else f"more than {max(candidates)} (try --max-loras)"))
    if args.plot:
        print(f"plot: {plot(results, args.plot, traffic)}")
    if args.json:
        write_atomic(args.json, json.dumps({"traffic": traffic, "notes": notes, "needed": {
            "without_release": need[False], "with_release": need[True]}, "results": [asdict(r) for r in results]},
            indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
