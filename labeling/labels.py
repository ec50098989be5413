"""The labeling stage: ON/OFF pairs at the release points T, labels and features.

For every (train request, adapter) the engine generates the full-LoRA response (ON) and,
for each t ∈ T the response continues past, an OFF branch forked from the ON state after
forward t (release with k = t). Then y_t = Q(ON) ∧ ¬Q(OFF_t): releasing at t is *risky*.
The feature is h_t, the final-norm hidden state of forward t. A t the response does not
continue past (t ≥ L−1) has OFF = ON, is never risky, and is not a decision point, so it
is not labeled.

Work is split into shards of requests; each shard's files are written via renames, then its
marker with their sha256 and what it generated in how long (:class:`ShardStats`), so an
interrupted run resumes at the first unfinished shard and yields identical labels (greedy
decoding, fixed shard composition), a shard whose files no longer match its marker is labeled
again, and progress and cost estimates count the shards done before.
"""
from __future__ import annotations

import io
import json
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from labeling.tasks import Example, Task
from labeling.tasks.mix import PART_KEY
from serve_bridge.bundle import file_sha256
from serve_bridge.safe_write import write_atomic

if TYPE_CHECKING:  # the engine pulls in transformers/peft; summaries and readers need neither
    from labeling.engines.hf import GenRequest, GenResult, HFEngine

POINT_COLUMNS = ["uid", "adapter", "t", "y", "q_on", "q_off", "on_length", "off_length"]


def serves(part: str | None, ex: Example) -> bool:
    """Whether an adapter serving task part ``part`` (None: every example) gets ``ex``."""
    return part is None or ex.meta.get(PART_KEY) == part


def build_requests(engine: HFEngine, task: Task, examples: Sequence[Example], slots: Sequence[int],
                   parts: Mapping[int, str | None] | None = None) -> list[tuple[Example, GenRequest]]:
    """Every example once per adapter slot that serves it (adapters interleaved so batches mix
    adapters), each response ending where the task decides its answer (:mod:`labeling.answer_cut`). ``parts``: slot → the task part its adapter serves (a slot without an entry,
    e.g. the backbone's NO_SLOT, serves every example)."""
    from labeling.engines.hf import GenRequest

    parts = parts or {}
    out = []
    for ex in examples:
        mine = [s for s in slots if serves(parts.get(s), ex)]
        if not mine:
            continue
        ids = engine.encode(task.messages(ex))
        stop = partial(task.decided, ex)
        out.extend((ex, GenRequest(uid=f"{ex.uid}@{s}", prompt_ids=ids, slot=s, stop=stop)) for s in mine)
    return out


def label_results(engine: HFEngine, task: Task, pairs: Sequence[tuple[Example, GenRequest]],
                  results: Sequence[GenResult], adapter_names: Sequence[str]) -> tuple[pd.DataFrame, np.ndarray]:
    """Score ON and OFF responses; one point per forked t, with its captured h_t."""
    rows, feats = [], []
    for (ex, req), res in zip(pairs, results):
        q_on = task.score(ex, engine.decode(res.tokens))
        for t in sorted(res.branches):
            branch = res.branches[t]
            q_off = task.score(ex, engine.decode(branch))
            rows.append((ex.uid, adapter_names[req.slot], t, int(q_on and not q_off), q_on, q_off,
                         len(res.tokens), len(branch)))
            feats.append(res.hidden[t].numpy())
    df = pd.DataFrame(rows, columns=POINT_COLUMNS)
    h = np.stack(feats).astype(np.float32) if feats else np.zeros((0, engine.hidden_size), np.float32)
    return df, h


@dataclass(frozen=True)
class ShardStats:
    """What one labeling shard generated, and in how long (recorded in its ``.done`` marker).

    on_tokens: ON response tokens; off_branches / off_tokens: OFF continuations and the tokens
    they generated (after the shared prefix); seconds: the engine's ``generate`` wall time.
    """

    requests: int
    points: int
    on_tokens: int
    off_branches: int
    off_tokens: int
    seconds: float

    @property
    def tokens(self) -> int:
        return self.on_tokens + self.off_tokens

    @classmethod
    def measure(cls, results: Sequence[GenResult], points: int, seconds: float) -> ShardStats:
        from labeling.engines.hf import generated_tokens

        on = sum(len(r.tokens) for r in results)
        return cls(requests=len(results), points=points, on_tokens=on, off_branches=sum(len(r.branches) for r in results),
                   off_tokens=sum(generated_tokens(r) for r in results) - on, seconds=seconds)


@dataclass
class LabelingPlan:
    """The shards of a labeling run: ``requests`` in shards of ``shard_requests``, and the stats
    of those already done (in this run or a resumed one). ``warmup``: the first shard this process
    generated, which also paid the engine's warm-up (first steps of each batch shape, cold caches)."""

    requests: int
    shard_requests: int
    done: dict[int, ShardStats]
    warmup: int | None = None

    @property
    def shards(self) -> int:
        return (self.requests + self.shard_requests - 1) // self.shard_requests

    def measured(self) -> ShardStats | None:
        """All done shards' stats summed (None before the first)."""
        return _sum(list(self.done.values()))

    def steady(self) -> ShardStats | None:
        """The done shards' stats without the warm-up shard, summed; all of them while the warm-up
        shard is the only one (None before the first)."""
        rows = [s for i, s in self.done.items() if i != self.warmup]
        return _sum(rows) if rows else self.measured()

    def ready_to_preview(self, next_shard: int) -> bool:
        """Whether the preview can be made before ``next_shard`` runs: a shard past the warm-up is
        done, or the next shard is the last one."""
        return bool(self.done) and (any(i != self.warmup for i in self.done) or next_shard == self.shards - 1)


def _sum(rows: list[ShardStats]) -> ShardStats | None:
    if not rows:
        return None
    return ShardStats(*(sum(getattr(r, f) for r in rows) for f in ShardStats.__dataclass_fields__))


# after_warmup(plan): called once, as soon as the plan is ready to preview and before the next
# shard starts (or after the last one); it may raise to stop labeling there (the done shards are kept).
AfterWarmup = Callable[[LabelingPlan], None]


def run_labeling(engine: HFEngine, task: Task, examples: Sequence[Example], adapter_names: Sequence[str],
                 points: Sequence[int] | Mapping[int, Sequence[int]], out_dir: Path, shard_requests: int, shard_key: str = "",
                 parts: Mapping[int, str | None] | None = None, after_warmup: AfterWarmup | None = None,
                 progress: bool = False) -> tuple[pd.DataFrame, np.ndarray]:
    """Label ``examples`` × adapters in resumable shards under ``out_dir/shards``; return all points.

    ``points``: the release points T, or adapter slot → that adapter's T.
    Finished shards are reused only by a run with the same ``shard_key`` (the caller's config
    fingerprint) and the same ``shard_requests``, which fix each shard's composition; any other
    run starts the shards afresh. ``parts``: slot → task part, as in :func:`build_requests`.
    ``progress``: a bar over all requests (shards done before a resume count as done) with
    requests/s, generated tokens/s and an ETA."""
    t_sets = {s: frozenset(int(t) for t in (points[s] if isinstance(points, Mapping) else points))
              for s in range(len(adapter_names))}
    captured = frozenset().union(*t_sets.values())
    pairs = build_requests(engine, task, examples, range(len(adapter_names)), parts)
    shard_dir = out_dir / "shards"
    layout = f"{shard_key}\nshard_requests={shard_requests}\nrequests={len(pairs)}\n"
    stamp = shard_dir / "LAYOUT"
    if shard_dir.is_dir() and (not stamp.is_file() or stamp.read_text() != layout):
        shutil.rmtree(shard_dir)
    write_atomic(stamp, layout)
    plan = LabelingPlan(len(pairs), shard_requests, {})
    for i in range(plan.shards):
        done = shard_dir / f"{i:05d}.done"
        reason = _shard_stale(done, _shard_files(shard_dir, i))
        if reason is None:
            plan.done[i] = ShardStats(**json.loads(done.read_text())["stats"])
        elif reason != "not labeled yet":
            print(f"labels shard {i + 1}/{plan.shards}: {reason}; labeling it again", flush=True)

    def new_bar() -> tqdm:
        return tqdm(total=len(pairs), initial=sum(s.requests for s in plan.done.values()), desc="labels", unit="req",
                    disable=not progress, dynamic_ncols=True)

    bar = new_bar()
    tokens, seconds, told = 0, 0.0, False
    frames, feats = [], []
    for i in range(plan.shards):
        files = _shard_files(shard_dir, i)
        if i not in plan.done:
            if after_warmup is not None and not told and plan.ready_to_preview(i):
                told = True
                bar.close()  # the preview prints between two bars, not across one
                after_warmup(plan)
                bar = new_bar()
            chunk = pairs[i * shard_requests:(i + 1) * shard_requests]
            start = time.perf_counter()
            results = engine.generate([r for _, r in chunk], task.max_new_tokens, capture=captured.__contains__,
                                      fork=lambda res, t, s: t in t_sets[res.slot], desc=f"labels shard {i + 1}/{plan.shards}")
            stats = ShardStats.measure(results, 0, time.perf_counter() - start)
            if plan.warmup is None:
                plan.warmup = i
            df, h = label_results(engine, task, chunk, results, adapter_names)
            stats = replace(stats, points=len(df))
            _write_shard(shard_dir / f"{i:05d}.done", files, df, h, stats)
            plan.done[i] = stats
            tokens, seconds = tokens + stats.tokens, seconds + stats.seconds
            bar.set_postfix_str(f"{tokens / max(seconds, 1e-9):.0f} tokens/s", refresh=False)
            bar.update(stats.requests)
        frames.append(pd.read_parquet(files["points"]))
        feats.append(np.load(files["features"]))
    bar.close()
    if after_warmup is not None and not told and tokens:  # every shard this call ran came before the preview
        after_warmup(plan)
    df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=POINT_COLUMNS)
    return df, np.concatenate(feats) if feats else np.zeros((0, engine.hidden_size), np.float32)


def _shard_files(shard_dir: Path, i: int) -> dict[str, Path]:
    return {"points": shard_dir / f"{i:05d}.parquet", "features": shard_dir / f"{i:05d}.npy"}


def _write_shard(done: Path, files: dict[str, Path], df: pd.DataFrame, h: np.ndarray, stats: ShardStats) -> None:
    """Write one shard's points and features, then its marker with their sha256 and the shard's
    stats; each file under a fresh temporary name renamed into place (:func:`write_atomic`)."""
    done.unlink(missing_ok=True)
    features = io.BytesIO()
    np.save(features, h)
    write_atomic(files["points"], df.to_parquet(index=False))
    write_atomic(files["features"], features.getvalue())
    write_atomic(done, json.dumps({"rows": len(df), "stats": asdict(stats),
                                   "sha256": {k: file_sha256(p) for k, p in files.items()}}))


def _shard_stale(done: Path, files: dict[str, Path]) -> str | None:
    """None iff the shard's marker exists and its files have the sha256 it recorded, else why not."""
    if not done.exists():
        return "not labeled yet"
    try:
        record = json.loads(done.read_text())
        recorded, _ = record["sha256"], ShardStats(**record["stats"])
    except (OSError, ValueError, KeyError, TypeError):
        return f"its marker {done.name} is unreadable"
    for key, path in files.items():
        if not path.is_file() or file_sha256(path) != recorded.get(key):
            return f"{path.name} differs from the sha256 its marker recorded"
    return None


def summarize(points: pd.DataFrame) -> dict:
    """Requests, points, positive rate overall and per t."""
    per_t = points.groupby("t")["y"].agg(["count", "mean"]) if len(points) else pd.DataFrame()
    return {
        "requests": int(points[["uid", "adapter"]].drop_duplicates().shape[0]) if len(points) else 0,
        "points": int(len(points)),
        "positive_rate": float(points["y"].mean()) if len(points) else 0.0,
        "per_t": {int(t): {"points": int(r["count"]), "positive_rate": float(r["mean"])} for t, r in per_t.iterrows()},
    }


def format_summary(s: dict) -> str:
    lines = [f"labels: {s['requests']} requests, {s['points']} points, positive rate {100 * s['positive_rate']:.1f}%"]
    lines += [f"  t={t:>3}: {v['points']:>5} points, positive {100 * v['positive_rate']:5.1f}%" for t, v in s["per_t"].items()]
    return "\n".join(lines)
