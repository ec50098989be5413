"""Launching one engine step's StepTrim decisions with few host calls (DESIGN §2, §4).

The decision itself is :meth:`serve_bridge.steptrim.StepTrim.fires`; this module only moves
its inputs and result. Per bucket of rows (powers of two, created on demand, never freed) it
keeps preallocated buffers: the per-row inputs (hidden-row index, slot, t) in one int64
[3, B] host tensor, pinned on CUDA and filled through a numpy view, its device copy, and a
pinned bool [B] for the result. Padded rows get slot NO_SLOT, which never fires.

On CUDA with graphs (the default) one launch is two host calls, queued behind the forward on
the current stream:

    copy the step's hidden states [N, H] into a fixed staging buffer (one D2D copy)
    replay the bucket's graph: event · H2D copy of the inputs · gather of the rows from the
        staging buffer · StepTrim.fires · D2H copy of the result into the pinned buffer · event

:meth:`DecisionLauncher.result` waits on the second event (the engine calls it after it has
synced on the sampled tokens, so the wait is normally over) and returns the fired rows and
the GPU time between the events (the staging copy, a D2D copy of N·H elements, is queued
just before the first event and is not in that interval). A bucket's graph is captured at
its first use (one per hidden dtype; recaptured if the staging buffer has to grow). Without
graphs (disabled, or a capture failed) the same steps run eagerly with the events recorded
around them. Without a learned policy no hidden state is needed: the profiled rule t ≥ k
runs on the host, on a CPU copy of the same StepTrim, with no GPU work at all. Off CUDA
everything runs on the CPU.

Pure torch, no vLLM import.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from serve_bridge.steptrim import NO_SLOT, StepTrim

logger = logging.getLogger("vllm.lorazor")

MIN_BUCKET = 8
ROW, SLOT, T = 0, 1, 2  # rows of the int64 input block


def bucket_size(n: int) -> int:
    """The padded row count for ``n`` rows: the next power of two, at least :data:`MIN_BUCKET`."""
    return max(MIN_BUCKET, 1 << max(0, n - 1).bit_length())


@dataclass
class _Bucket:
    """Buffers for launches of up to ``size`` rows."""

    size: int
    host: torch.Tensor  # int64 [3, size]: hidden row, slot, t (pinned on CUDA)
    host_np: np.ndarray
    dev: torch.Tensor  # the device copy of ``host`` (``host`` itself off CUDA)
    out: torch.Tensor  # bool [size] result (pinned on CUDA)
    out_np: np.ndarray
    filled: int = 0  # host columns ≥ this hold padding
    graphs: dict[torch.dtype, Any] = field(default_factory=dict)  # hidden dtype → captured graph


class DecisionLauncher:
    """Launches StepTrim decisions for one engine step at a time (one in flight).

    steptrim: the engine's StepTrim (its device is where hidden states live). max_rows:
    buffers for up to this many rows (decided rows and rows of the hidden states) are
    allocated now; larger ones on demand. cuda_graphs: replay each bucket's decision as a
    CUDA graph on CUDA.
    """

    def __init__(self, steptrim: StepTrim, max_rows: int = 256, cuda_graphs: bool = True) -> None:
        self.steptrim = steptrim if steptrim.needs_hidden else steptrim.to("cpu")
        self.device = self.steptrim.device
        self.on_cuda = self.device.type == "cuda"
        self.use_graphs = bool(cuda_graphs) and self.on_cuda
        self.max_rows = bucket_size(max_rows)
        self._buckets: dict[int, _Bucket] = {}
        self._inflight: tuple[_Bucket, int] | None = None
        self._staging: dict[torch.dtype, torch.Tensor] = {}  # graph input: the step's hidden states
        if self.on_cuda:
            # external: inside a graph they become event record nodes, so one replay records both
            self._events = (_timing_event(), _timing_event())
            self._pool: Any = None
            self._stream: Any = None
        size = MIN_BUCKET
        while size <= self.max_rows:
            self._bucket(size)
            size *= 2

    @property
    def mode(self) -> str:
        """'cuda-graph', 'cuda-eager' or 'cpu' (where StepTrim runs)."""
        return ("cuda-graph" if self.use_graphs else "cuda-eager") if self.on_cuda else "cpu"

    def _bucket(self, size: int) -> _Bucket:
        b = self._buckets.get(size)
        if b is None:
            host = torch.zeros(3, size, dtype=torch.int64, pin_memory=self.on_cuda)
            host[SLOT] = NO_SLOT
            out = torch.zeros(size, dtype=torch.bool, pin_memory=self.on_cuda)
            dev = host.to(self.device) if self.on_cuda else host
            b = self._buckets[size] = _Bucket(size, host, host.numpy(), dev, out, out.numpy())
        return b

    def launch(self, rows: Sequence[int], slots: Sequence[int], t: Sequence[int], hidden: torch.Tensor | None) -> None:
        """Queue the decision for rows ``rows`` of ``hidden`` [N, H] (slot and forward t each).

        Slots are never NO_SLOT here. ``hidden`` may be None without a learned policy.
        """
        if self._inflight is not None:
            raise RuntimeError("DecisionLauncher.launch: the previous decision was not read (call result())")
        n = len(rows)
        b = self._bucket(bucket_size(n))
        a = b.host_np
        a[ROW, :n] = rows
        a[SLOT, :n] = slots
        a[T, :n] = t
        if b.filled > n:  # restore the padding that the last, larger launch overwrote
            a[ROW, n:b.filled] = 0
            a[SLOT, n:b.filled] = NO_SLOT
            a[T, n:b.filled] = 0
        b.filled = n
        self._inflight = (b, n)
        st = self.steptrim
        if not self.on_cuda:  # hidden (if needed) is on the CPU, like StepTrim
            h = hidden.index_select(0, b.host[ROW, :n]) if st.needs_hidden else None
            b.out[:n] = st.fires(b.host[SLOT, :n], b.host[T, :n], h)
            return
        if self.use_graphs:  # on CUDA StepTrim has a learned policy, so hidden is given
            graph = self._graph(b, hidden)
            if graph is not None:
                self._staging[hidden.dtype][: hidden.shape[0]].copy_(hidden)
                graph.replay()
                return
        ev0, ev1 = self._events
        ev0.record()
        b.dev.copy_(b.host, non_blocking=True)
        b.out.copy_(st.fires(b.dev[SLOT], b.dev[T], hidden.index_select(0, b.dev[ROW])), non_blocking=True)
        ev1.record()

    def result(self) -> tuple[np.ndarray, float | None]:
        """Wait for the launched decision: (fired bool [n], a numpy view valid until the next
        launch; the GPU time between the two events in ms, None off CUDA)."""
        if self._inflight is None:
            raise RuntimeError("DecisionLauncher.result: nothing was launched")
        (b, n), self._inflight = self._inflight, None
        gpu_ms = None
        if self.on_cuda:
            ev0, ev1 = self._events
            ev1.synchronize()
            gpu_ms = ev0.elapsed_time(ev1)
        return b.out_np[:n], gpu_ms

    # -- CUDA graphs -----------------------------------------------------------------------
    def _graph(self, b: _Bucket, hidden: torch.Tensor) -> Any:
        """The bucket's graph for ``hidden``'s dtype (captured now if new); None, and eager from
        then on, if the capture fails."""
        staging = self._staging.get(hidden.dtype)
        if staging is None or staging.shape[0] < hidden.shape[0]:  # (re)allocate: graphs read its address
            rows = max(self.max_rows, bucket_size(hidden.shape[0]))
            self._staging[hidden.dtype] = torch.zeros(rows, self.steptrim.hidden_size, dtype=hidden.dtype,
                                                      device=self.device)
            for other in self._buckets.values():
                other.graphs.pop(hidden.dtype, None)
            self._pool = None  # a pool whose graphs are all gone cannot take new captures: a fresh one
        g = b.graphs.get(hidden.dtype)
        if g is None:
            try:
                g = b.graphs[hidden.dtype] = self._capture(b, self._staging[hidden.dtype])
            except Exception as e:  # a capture problem must not stop serving: same decisions, eagerly
                logger.warning("StepTrim decisions run without CUDA graphs: capturing %d rows failed (%s: %s).",
                               b.size, type(e).__name__, e)
                self.use_graphs = False
                return None
        return g

    def _capture(self, b: _Bucket, staging: torch.Tensor) -> Any:
        st = self.steptrim
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        main = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(main)
        graph = torch.cuda.CUDAGraph()
        ev0, ev1 = self._events
        with torch.cuda.stream(self._stream):
            st.fires(b.dev[SLOT], b.dev[T], staging.index_select(0, b.dev[ROW]))  # warm-up, outside the capture
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                ev0.record()
                b.dev.copy_(b.host, non_blocking=True)
                b.out.copy_(st.fires(b.dev[SLOT], b.dev[T], staging.index_select(0, b.dev[ROW])), non_blocking=True)
                ev1.record()
            finally:
                graph.capture_end()
        main.wait_stream(self._stream)
        return graph


def _timing_event() -> Any:
    try:
        return torch.cuda.Event(enable_timing=True, external=True)
    except TypeError:  # a torch without external events: a capture that records one fails, and runs eagerly
        return torch.cuda.Event(enable_timing=True)
