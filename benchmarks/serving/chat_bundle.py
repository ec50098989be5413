"""The learned bundle of :mod:`benchmarks.serving.chat`: heads fit on the dummy model's own hidden
states, τ set so that about half of the decode forwards are skipped.

    python -m benchmarks.serving.chat_bundle --work W --bundle DIR [--adapters 512] [--seed 0]

(GPU; :mod:`benchmarks.serving.chat` runs it before the first server that needs the bundle.) One
in-process vLLM engine in LoRazor's calibration mode (eager, the served dummy model and its
distinct adapters, :func:`capture_engine`) generates requests of the served chat shape
(:func:`benchmarks.serving.chat_workload.prep_rows`), sampled at temperature 1.0 as the benchmark
serves them:

1. fit pass: ``--fit-requests`` per adapter, recording the final-norm hidden state h_t at every
   ``--capture-every``-th forward (``lorazor_captures``);
2. heads (:func:`fit_adapter_heads`): per adapter, Eq. 13's head (:func:`predictors.heads.fit_head`)
   on points labeled risky before the request's half-skip release point (:func:`half_release`) and
   safe from it on;
3. held-out pass: ``--heldout-requests`` other requests per adapter, scored by those heads at every
   forward by the calibration scorer (the float32 scores serving compares with τ);
4. τ (:func:`choose_tau`): per adapter, the threshold whose planned skip over its held-out
   requests is nearest ``--target-skip``.

Random weights hold nothing a head could predict a real commit point from: the labels stand in
for calibration's, the heads give each forward a score, and τ sets how often that score releases.
What the benchmark needs is a learned decision on the device every step that releases about half
of the decode forwards; the realized skip while serving is measured beside it.

One head per distinct weight file: served adapter a's weights are a hard link to file a mod 32
(:func:`benchmarks.serving.bench.write_model_and_adapters`), so its hidden states are that
file's, and its entry gets that file's head and τ. Fitting 512 heads would fit the same 32
adapters 16 times each.

Every learned entry is built by :func:`learned_entry` (the scorer's policies too, through
:meth:`AdapterEntry.to_policy`), and every planned release is :func:`planned_release`
(:func:`serve_bridge.steptrim.release_point_learned` with the entry's τ and decision lag, 1
as calibration exports by default).

Writes the bundle (:func:`serve_bridge.bundle.write_bundle`) and beside it ``<bundle>.json``: the
planned skip over all held-out requests, each adapter's numbers, and the seconds each step took.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.serving import bench
from benchmarks.serving.bench_workload import TARGET_SKIP, choose_k
from benchmarks.serving.chat_workload import Row, add_shape_arguments, prep_rows, shape_from
from benchmarks.serving.synthetic import LLAMA32_3B
from predictors.heads import Head, fit_head
from serve_bridge.bundle import AdapterEntry, config_fingerprint, load_bundle, write_bundle
from serve_bridge.command_line import Parser, existing_dir, need_files, number, report
from serve_bridge.safe_write import check_output
from serve_bridge.steptrim import release_point_learned, skip_fraction
from serve_bridge.values import OptionError

CAPTURE_EVERY = 8  # h_t captured at t = 0, 8, 16, …: about 8 labeled points per request
FIT_REQUESTS = 24  # per distinct adapter
HELDOUT_REQUESTS = 16
LAG = 1  # the decision lag calibration exports by default (sweep.decision_lag): what users serve
BACKBONE = "llama-3.2-3b-shape-dummy"  # bench.write_profiled_bundle's name for this shape


@dataclass(frozen=True)
class Captured:
    """One generated request: its adapter, its token count, h_t at the captured forwards, and
    s_t at every forward (empty without a scorer; the last one may be NaN, unscored: a release
    there skips nothing)."""

    adapter: int
    length: int
    hidden: dict[int, np.ndarray]
    scores: list[float]


# -- entries and planned releases ------------------------------------------------------------------

def learned_entry(name: str, fingerprint: str, head: Head, tau: float, stats: dict[str, Any]) -> AdapterEntry:
    """The one place this benchmark builds a learned bundle entry (and, through ``to_policy``, a
    learned policy)."""
    return AdapterEntry(name, fingerprint, "learned", tau=float(tau), weight=head.weight, bias=head.bias, lag=LAG,
                        stats=stats)


def planned_release(entry: AdapterEntry, scores: Sequence[float]) -> int | None:
    """The release point the entry plans for a request scored ``scores`` (s_0, s_1, …)."""
    return release_point_learned(scores, entry.tau, entry.lag)


def planned_skip(entry: AdapterEntry, requests: Sequence[Captured]) -> float:
    """Skip fraction of ``requests``' decode forwards under the entry's planned releases."""
    return skip_fraction([r.length for r in requests], [planned_release(entry, r.scores) for r in requests])


def half_release(length: int) -> int:
    """The release point whose skip of a ``length``-token response's decode forwards is nearest a half."""
    return choose_k([length], 0.5)


# -- fitting ---------------------------------------------------------------------------------------

def labeled_points(requests: Sequence[Captured]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(features [n, H] float32, labels [n], request ids [n]): each captured h_t, risky (1) for
    t before its request's :func:`half_release`, safe (0) from it on."""
    x, y, rid = [], [], []
    for i, r in enumerate(requests):
        half = half_release(r.length)
        for t, h in sorted(r.hidden.items()):
            x.append(h)
            y.append(int(t < half))
            rid.append(str(i))
    return np.asarray(x, np.float32), np.asarray(y), np.asarray(rid)


def fit_adapter_heads(fit: Sequence[Captured]) -> dict[int, Head]:
    """Adapter → its head (:func:`predictors.heads.fit_head` on its requests' :func:`labeled_points`);
    a head that is not ``ok`` is an error."""
    heads = {}
    for a in sorted({r.adapter for r in fit}):
        x, y, rid = labeled_points([r for r in fit if r.adapter == a])
        head = fit_head(bench.adapter_name(a), x, y, rid)
        if not head.ok:
            raise RuntimeError(head.message)
        heads[a] = head
    return heads


def choose_tau(name: str, fingerprint: str, head: Head, stats: dict[str, Any], heldout: Sequence[Captured],
               target: float = TARGET_SKIP) -> tuple[AdapterEntry, float]:
    """The adapter's learned entry whose planned skip over ``heldout`` is nearest ``target`` (the
    smaller τ on a tie), and that skip. The skip grows with τ and changes only where τ passes a
    score, so the candidates are the float32 values just above each held-out score (s < τ iff
    s ≤ that score), bisected."""
    scores = np.unique(np.concatenate([np.asarray(r.scores, np.float32) for r in heldout]))
    scores = scores[np.isfinite(scores)]
    taus = np.nextafter(scores, np.float32(np.inf))

    def skip_at(i: int) -> tuple[AdapterEntry, float]:
        entry = learned_entry(name, fingerprint, head, float(taus[i]), stats)
        return entry, planned_skip(entry, heldout)

    lo, hi = 0, len(taus) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if skip_at(mid)[1] >= target:
            hi = mid
        else:
            lo = mid + 1
    best = skip_at(lo)
    if lo > 0 and abs((below := skip_at(lo - 1))[1] - target) <= abs(best[1] - target):
        return below
    return best


def bundle_entries(heads: Mapping[int, Head], heldout: Sequence[Captured], fingerprints: Mapping[str, str],
                   n_adapters: int, target: float = TARGET_SKIP) -> tuple[list[AdapterEntry], dict[str, Any]]:
    """Learned entries for the ``n_adapters`` served names (adapter a: the head and τ of
    distinct adapter a mod len(heads), :func:`choose_tau` on that adapter's held-out requests),
    and the summary: the planned skip over all held-out requests and each distinct adapter's
    τ, skip and head numbers."""
    chosen, per_adapter = {}, {}
    for a, head in sorted(heads.items()):
        own = [r for r in heldout if r.adapter == a]
        name = bench.adapter_name(a)
        stats = {"rule": "head fit on the dummy model's hidden states, tau for the target skip on held-out requests",
                 "head_of": name, "fit_requests": head.n_requests, "fit_points": head.n_points,
                 "positives": head.positives, "heldout_requests": len(own), "target_skip": target}
        chosen[a], skip = choose_tau(name, fingerprints[name], head, stats, own, target)
        per_adapter[name] = stats | {"tau": chosen[a].tau, "heldout_skip": skip}
    entries = []
    for a in range(n_adapters):
        e, name = chosen[a % len(heads)], bench.adapter_name(a)
        stats = per_adapter[e.name]
        entries.append(learned_entry(name, fingerprints[name], heads[a % len(heads)], e.tau, stats))
    planned = skip_fraction([r.length for r in heldout],
                            [planned_release(chosen[r.adapter], r.scores) for r in heldout])
    return entries, {"planned_skip": planned, "heldout_requests": len(heldout), "adapters": per_adapter}


def write_learned_bundle(directory: Path, entries: Sequence[AdapterEntry], cfg: Mapping[str, Any] = LLAMA32_3B,
                         ) -> Path:
    """The entries as a bundle for the dummy model of ``cfg``."""
    return write_bundle(directory, backbone=BACKBONE, hidden_size=cfg["hidden_size"],
                        config_fingerprint=config_fingerprint(cfg), adapters=entries)


def with_lag(source: Path, lag: int, directory: Path) -> Path:
    """``source``'s bundle with every learned entry's decision lag set to ``lag`` (heads, τ and
    everything else unchanged), written to ``directory``: the same decisions released ``lag``
    forwards after they fire (docs/design.md §2)."""
    b = load_bundle(source)
    entries = [replace(e, lag=lag) if e.policy == "learned" else e for e in b.adapters.values()]
    return write_bundle(directory, backbone=b.backbone, hidden_size=b.hidden_size,
                        config_fingerprint=b.config_fingerprint, adapters=entries)


# -- the GPU passes --------------------------------------------------------------------------------

def capture_engine(work: Path, names: Sequence[str]) -> Any:
    """``vllm.LLM`` in this process in LoRazor's calibration mode (the calibration engine's options
    and environment, :mod:`labeling.engines.vllm.options`), eager, on ``work``'s dummy model with
    the adapters ``names`` (slots in that order)."""
    from labeling.adapters import AdapterSpec
    from labeling.engines.vllm.options import VLLMOptions, llm_kwargs, prepare_environment
    from serve_bridge.vllm.versions import current

    prepare_environment()
    import vllm

    current().install_runner()
    specs = [AdapterSpec(n, str(work / "adapters" / n)) for n in names]
    return vllm.LLM(**llm_kwargs(str(work / "model"), specs, VLLMOptions(enforce_eager=True, progress=False))
                    | {"load_format": "dummy"})


def run_pass(llm: Any, work: Path, rows: Sequence[Row], names: Sequence[str], config: dict[str, Any],
             seed: int) -> list[Captured]:
    """Every row as a uid-tagged request on its adapter's slot (``work/adapters/<name>``), sampled at temperature 1.0 with
    ``ignore_eos`` (the served sampling) under the calibration ``config``; the records as
    :class:`Captured`, in row order."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    from serve_bridge.runtime import REQUEST_ARGS_KEY
    from serve_bridge.vllm.rpc import lorazor_calibrate, lorazor_captures

    llm.collective_rpc(lorazor_calibrate, args=(config,))
    params = [SamplingParams(temperature=1.0, max_tokens=r.output_tokens, ignore_eos=True, detokenize=False,
                             seed=seed * 100_003 + i, extra_args={REQUEST_ARGS_KEY: {"uid": str(i)}})
              for i, r in enumerate(rows)]
    loras = [LoRARequest(names[r.adapter], r.adapter + 1, str(work / "adapters" / names[r.adapter])) for r in rows]
    llm.generate([{"prompt_token_ids": r.prompt} for r in rows], params, lora_request=loras, use_tqdm=False)
    records = llm.collective_rpc(lorazor_captures)[0]
    out = []
    for i, r in enumerate(rows):
        rec = records[str(i)]
        if rec["forwards"] != r.output_tokens or any(s != s for s in rec["scores"][:-1]):
            raise RuntimeError(f"request {i}: {rec['forwards']} forwards recorded for {r.output_tokens} tokens, or a "
                               "forward before the last one not scored")
        out.append(Captured(r.adapter, r.output_tokens,
                            {int(t): np.asarray(h, np.float32) for t, h in rec["hidden"].items()}, rec["scores"]))
    return out


def prepare_bundle(args: argparse.Namespace) -> dict[str, Any]:
    """The four steps of the module doc on the GPU; writes ``args.bundle`` and returns the summary."""
    from serve_bridge.calibration import calibration_config
    from serve_bridge.steptrim import StepTrim

    shape = shape_from(args)
    distinct = min(bench.DISTINCT_WEIGHTS, shape.n_adapters)
    names = [bench.adapter_name(a) for a in range(distinct)]
    fingerprints = json.loads((args.work / "prepared.json").read_text())["fingerprints"]
    hidden = LLAMA32_3B["hidden_size"]
    seconds: dict[str, float] = {}
    t0 = time.monotonic()
    llm = capture_engine(args.work, names)
    seconds["engine"] = time.monotonic() - t0
    t0 = time.monotonic()
    capture = range(0, shape.output_len[1], args.capture_every)
    fit = run_pass(llm, args.work, prep_rows(shape, args.seed, 0, range(distinct), args.fit_requests), names,
                   calibration_config(names, capture=capture), args.seed)
    seconds["fit_pass"] = time.monotonic() - t0
    t0 = time.monotonic()
    heads = fit_adapter_heads(fit)
    seconds["heads"] = time.monotonic() - t0
    t0 = time.monotonic()
    # the scorer records s_t = w·h_t + b at every forward; its τ (0 here) decides nothing in this pass
    scorer = StepTrim([learned_entry(n, fingerprints[n], heads[a], 0.0, {}).to_policy() for a, n in enumerate(names)],
                      hidden)
    heldout = run_pass(llm, args.work, prep_rows(shape, args.seed, 1, range(distinct), args.heldout_requests), names,
                       calibration_config(names, scorer=scorer), args.seed + 1)
    seconds["heldout_pass"] = time.monotonic() - t0
    entries, summary = bundle_entries(heads, heldout, fingerprints, shape.n_adapters, args.target_skip)
    write_learned_bundle(args.bundle, entries)
    summary |= {"seconds": seconds, "capture_every": args.capture_every, "fit_requests": args.fit_requests,
                "heldout_requests_per_adapter": args.heldout_requests}
    summary_path(args.bundle).write_text(json.dumps(summary, indent=1))
    return summary


def summary_path(bundle: Path) -> Path:
    """Where :func:`prepare_bundle` writes the summary: ``<bundle>.json`` beside the bundle."""
    return bundle.with_name(bundle.name + ".json")


def main(argv: Sequence[str] | None = None) -> int:
    ap = Parser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=existing_dir, required=True, help="model directory and adapters (prepared.json)")
    ap.add_argument("--bundle", type=Path, required=True, help="the bundle directory to write (must not exist)")
    ap.add_argument("--seed", type=number("seed"), default=0,
                    help="the workload's seed (system prompts; prep conversations)")
    ap.add_argument("--fit-requests", type=number("positive_int"), default=FIT_REQUESTS,
                    help="requests per adapter the heads fit on")
    ap.add_argument("--heldout-requests", type=number("positive_int"), default=HELDOUT_REQUESTS,
                    help="requests per adapter τ is set on")
    ap.add_argument("--capture-every", type=number("positive_int"), default=CAPTURE_EVERY,
                    help="forwards between captured h_t")
    ap.add_argument("--target-skip", type=number("probability"), default=TARGET_SKIP,
                    help="planned skip τ aims at")
    add_shape_arguments(ap)
    args = ap.parse_args(argv)
    need_files("--work", args.work, ["prepared.json"], "the serving benchmark's prepared model directory")
    try:
        check_output("--bundle", args.bundle, [], directory=True, replace=False)  # chat.py keeps it inside --work
    except OptionError as e:
        return report(str(e))
    summary = prepare_bundle(args)
    print(json.dumps({k: v for k, v in summary.items() if k != "adapters"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
