"""Data parallelism: ``n`` independent vLLM engines, one worker process each on its own GPUs.

vLLM 0.26's ``LLM`` refuses ``data_parallel_size > 1`` in one process
(``entrypoints/llm.py:280-292``); for the dense backbones calibrated here independent replicas
are equivalent (no expert parallelism to coordinate). Each replica is a one-process
:class:`concurrent.futures.ProcessPoolExecutor` (spawned, so CUDA starts fresh) whose
initializer pins ``CUDA_VISIBLE_DEVICES`` and builds the replica's backend; each ``run`` is split
among the replicas by cost and submitted to all of them at once.
"""
from __future__ import annotations

import atexit
import importlib
import multiprocessing
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import replace
from typing import Any

from labeling.engines.vllm.requests import Batch, VLLMRequest

_replica: Any = None  # the backend of this worker process (set by _start_replica)


def shard(costs: Sequence[int], n: int) -> list[list[int]]:
    """Split request indices into ``n`` groups of about equal total cost (longest first onto the
    lightest group); each group in increasing index order."""
    groups: list[list[int]] = [[] for _ in range(n)]
    load = [0] * n
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        g = min(range(n), key=load.__getitem__)
        groups[g].append(i)
        load[g] += costs[i]
    return [sorted(g) for g in groups]



def _start_replica(devices: str, factory: str, factory_args: tuple) -> None:
    """Worker initializer: the replica's GPUs, then its backend from ``factory`` ("module:function")."""
    global _replica
    os.environ["CUDA_VISIBLE_DEVICES"] = devices
    module, _, name = factory.partition(":")
    _replica = getattr(importlib.import_module(module), name)(*factory_args)


def _max_model_len() -> int:
    return int(_replica.max_model_len)


def _run(reqs: list[VLLMRequest], config: dict[str, Any], desc: str, progress: bool) -> Batch:
    return _replica.run(reqs, config, desc, progress)


def _close() -> None:
    _replica.close()


def visible_gpus() -> list[str]:
    """The GPUs this process may use: ``CUDA_VISIBLE_DEVICES``, else every device torch counts."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env:
        return env.split(",")
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


class DataParallelBackend:
    """``n`` replicas, each on its own ``devices_per_replica`` GPUs of ``visible``; ``run`` splits
    the requests among them by cost (prompt + max tokens) and merges their outputs in order."""

    def __init__(self, n: int, devices_per_replica: int, factory: str, factory_args: tuple,
                 visible: Sequence[str] | None = None) -> None:
        visible = list(visible) if visible is not None else visible_gpus()
        if len(visible) < n * devices_per_replica:
            raise ValueError(f"data_parallel_size={n} × tensor_parallel_size={devices_per_replica} needs "
                             f"{n * devices_per_replica} GPUs, {len(visible)} visible.")
        ctx = multiprocessing.get_context("spawn")
        self.pools = [ProcessPoolExecutor(1, ctx, _start_replica, (
            ",".join(visible[rank * devices_per_replica:(rank + 1) * devices_per_replica]), factory,
            tuple(factory_args))) for rank in range(n)]
        atexit.register(self.close)
        try:
            self.max_model_len = min(self._results([pool.submit(_max_model_len) for pool in self.pools]))
        except BaseException:
            self.close()  # the replicas that did start
            raise

    def _results(self, futures: Sequence[Future]) -> list[Any]:
        """Every future's result, in order; a replica that died or raised names itself."""
        out = []
        for rank, fut in enumerate(futures):
            try:
                out.append(fut.result())
            except BrokenProcessPool as err:
                raise RuntimeError(f"data-parallel replica {rank} died (its traceback, if any, is above)") from err
        return out

    def run(self, reqs: Sequence[VLLMRequest], config: Mapping[str, Any], desc: str, progress: bool) -> Batch:
        """Replicas generate every request to its end: a ``decided`` watch (and the tokenizer it
        decodes with) does not cross to them, so the caller cuts the results afterwards."""
        reqs = [replace(r, decided=None) for r in reqs]
        parts = shard([len(r.prompt_ids) + r.max_tokens for r in reqs], len(self.pools))
        futures = [pool.submit(_run, [reqs[i] for i in idx], dict(config), f"{desc} [replica {rank}]",
                               progress and rank == 0) for rank, (pool, idx) in enumerate(zip(self.pools, parts))]
        tokens: list[list[int]] = [[] for _ in reqs]
        records: dict[str, dict[str, Any]] = {}
        for idx, batch in zip(parts, self._results(futures)):
            for i, toks in zip(idx, batch.tokens, strict=True):
                tokens[i] = toks
            records.update(batch.records)  # uids are unique over the whole run
        return Batch(tokens, records)

    def close(self) -> None:
        for pool in self.pools:
            try:
                pool.submit(_close).result()
            except (BrokenProcessPool, RuntimeError):
                pass  # already gone, or shut down
            pool.shutdown()
        self.pools = []
