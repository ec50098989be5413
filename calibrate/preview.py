"""The cost preview: what a run will generate and how long it will take, before labeling goes on.

It is measured, not assumed: the first labeling shards (kept, so no work is lost) give the
engine's ON tokens, OFF branches and OFF tokens per request, and its seconds per request on this
machine. The first shard a process runs also pays the engine's warm-up, so its time is not
extrapolated: the preview waits for a second shard (unless only one is left) and scales that
shard's seconds per request to the requests left. The sweep and test passes' ON responses are
priced at the same steady tokens per second (the sweep's OFF branches depend on the heads, fitted
after labeling, so its figures are lower bounds). ``preview=true`` stops the run after it.
"""
from __future__ import annotations

from dataclasses import dataclass

from labeling.labels import LabelingPlan


class PreviewDone(Exception):
    """Raised after the preview when ``preview=true``: the run stops, the done shards stay."""


@dataclass(frozen=True)
class Workload:
    """Requests per split (examples, before × adapters), adapters, and the most label points of a request."""

    splits: dict[str, int]
    adapters: int
    points: int


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def estimate(plan: LabelingPlan, work: Workload) -> dict[str, dict[str, float]]:
    """Per stage: ON and OFF continuations, generated tokens and seconds (labels also ``left_s``):
    tokens per request from every measured shard, seconds per request and tokens per second from
    the steady ones (:meth:`LabelingPlan.steady`)."""
    m, steady = plan.measured(), plan.steady()
    if m is None or steady is None or m.requests == 0:
        raise ValueError("no labeling shard measured yet")
    per_req = {"on_tokens": m.on_tokens / m.requests, "off": m.off_branches / m.requests,
               "tokens": m.tokens / m.requests, "seconds": steady.seconds / steady.requests}
    tokens_per_s = steady.tokens / max(steady.seconds, 1e-9)
    n = plan.requests
    left_s = per_req["seconds"] * (n - m.requests)
    out = {"labels": {"on": n, "off": per_req["off"] * n, "off_max": work.points * n,
                      "tokens": per_req["tokens"] * n, "seconds": m.seconds + left_s, "left_s": left_s}}
    for stage, on in (("sweep", work.splits["validation"] * (work.adapters + 1)),
                      ("test", 2 * work.splits["test"] * work.adapters)):
        tokens = per_req["on_tokens"] * on
        out[stage] = {"on": on, "tokens": tokens, "seconds": tokens / tokens_per_s}
    out["measured"] = {"requests": m.requests, "seconds": m.seconds, "tokens": m.tokens, "tokens_per_s": tokens_per_s,
                       "shards": len(plan.done), "warmup": plan.warmup in plan.done and len(plan.done) > 1}
    return out


def format_preview(plan: LabelingPlan, work: Workload, engine: str) -> str:
    """The preview as printed: a header naming the engine and the measurement, a line per stage."""
    e = estimate(plan, work)
    m, lab, sw, te = e["measured"], e["labels"], e["sweep"], e["test"]
    splits = ", ".join(f"{k} {v}" for k, v in work.splits.items())
    left = lab["left_s"] + sw["seconds"] + te["seconds"]
    return "\n".join([
        f"preview on {engine}, measured on {int(m['shards'])} of {plan.shards} labeling shard(s): "
        f"{int(m['requests'])} requests, {int(m['tokens'])} generated tokens in {m['seconds']:.1f} s "
        f"({m['tokens_per_s']:.0f} tokens/s{' after the warm-up shard' if m['warmup'] else ''})",
        f"  requests per split: {splits} (× {work.adapters} adapter(s))",
        f"  labels: {lab['on']} ON + ~{lab['off']:.0f} OFF continuations (at most {lab['off_max']}), "
        f"~{lab['tokens']:.0f} generated tokens, ~{_minutes(lab['seconds'])} ({_minutes(lab['left_s'])} left)",
        f"  sweep:  {sw['on']} ON (adapters and backbone alone) + OFF at the heads' release points: "
        f"> {sw['tokens']:.0f} tokens, > {_minutes(sw['seconds'])}",
        f"  test:   {te['on']} ON (full LoRA and the bundle's policy): ~{te['tokens']:.0f} tokens, "
        f"~{_minutes(te['seconds'])}",
        f"  generation left: > {_minutes(left)}",
    ])
