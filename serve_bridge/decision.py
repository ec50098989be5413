"""Launching one engine step's StepTrim decisions with few host calls (docs/design.md §2, §4).

The decision itself is StepTrim's (:meth:`serve_bridge.steptrim.StepTrim.fires`; on CUDA its
kernel, :mod:`lora_kernels.steptrim`); this module only hands it inputs and takes its result. Per
bucket of rows (powers of two, created on demand, never freed) it keeps preallocated buffers:
the per-row inputs (hidden-row index, slot, t) in one int64 [3, B] host tensor filled through a
numpy view, a float32 [B] score buffer and a bool [B] result. Padded rows get slot NO_SLOT,
which never fires.

On CUDA the input block and the result are pinned host memory that the kernel reads and writes
directly, and so is an int64 pair holding the address and row stride of the step's hidden
states (:func:`lora_kernels.steptrim.hidden_source`). One launch is then, with CUDA graphs (the
default), a write of that pair and one graph replay, queued behind the forward on the current
stream:

    event · StepTrim kernel (reads inputs and hidden rows, writes the result to the host) · event

and nothing is copied before or after. :meth:`DecisionLauncher.result` waits on the second
event of the oldest unread launch and returns its fired rows and the GPU time between the
events. Up to ``depth`` launches may be in flight (a server that applies decisions one step late
reads step t's while step t+1's is queued): each has its own *lane* of buffers, pair, events and
graphs, used in turn, since the kernel reads its inputs from host memory when it runs. A bucket's
graph is captured at its first use, once per hidden dtype. Without graphs (disabled, or a capture
failed) the same kernel is launched directly, between the same events. The launcher keeps a
reference to the hidden states until the result is read, so their memory outlives the kernel.
Without a learned policy no hidden state is needed: the profiled rule t ≥ k runs on the host,
on a CPU copy of the same StepTrim, with no GPU work at all. Off CUDA everything runs on the CPU.

Pure torch, no vLLM import.
"""
from __future__ import annotations

import logging
from collections import deque
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
    meta: torch.Tensor  # int64 [3, size]: hidden row, slot, t (pinned on CUDA)
    meta_np: np.ndarray
    score: torch.Tensor  # float32 [size] on StepTrim's device
    out: torch.Tensor  # bool [size] result (pinned on CUDA)
    out_np: np.ndarray
    filled: int = 0  # columns ≥ this hold padding
    graphs: dict[torch.dtype, Any] = field(default_factory=dict)  # hidden dtype → captured graph


@dataclass
class _Lane:
    """The buffers of one launch in flight: row buckets by size and, on CUDA, the hidden states'
    (address, row stride) pair and the two timing events."""

    buckets: dict[int, _Bucket] = field(default_factory=dict)
    src: Any = None  # int64 [2] pinned (CUDA only)
    src_np: Any = None
    events: tuple[Any, Any] | None = None


@dataclass(frozen=True)
class Launched:
    """One launch's result as it will be once the GPU has run it, for a reader outside the launch
    order (:meth:`DecisionLauncher.unread`). Valid until its lane's next launch, ``depth`` launches
    later; it neither reads nor frees the launch, which :meth:`DecisionLauncher.result` still does."""

    lane: _Lane
    bucket: _Bucket
    n: int

    def fired(self) -> np.ndarray:
        """Wait for the launch (its second event) and copy out its fired rows, bool [n]."""
        if self.lane.events is not None:
            self.lane.events[1].synchronize()
        return self.bucket.out_np[:self.n].copy()


class DecisionLauncher:
    """Launches StepTrim decisions, one engine step per launch, up to ``depth`` in flight.

    steptrim: the engine's StepTrim (its device is where hidden states live). max_rows:
    buffers for up to this many decided rows are allocated now; larger ones on demand.
    cuda_graphs: replay each bucket's decision as a CUDA graph on CUDA. depth: launches that may
    be unread at once (results are read oldest first).
    """

    def __init__(self, steptrim: StepTrim, max_rows: int = 256, cuda_graphs: bool = True, depth: int = 1) -> None:
        if depth < 1:
            raise ValueError(f"DecisionLauncher: depth must be ≥ 1, got {depth}")
        self.steptrim = steptrim if steptrim.needs_hidden else steptrim.to("cpu")
        self.device = self.steptrim.device
        self.on_cuda = self.device.type == "cuda"
        self.use_graphs = bool(cuda_graphs) and self.on_cuda
        self.max_rows = bucket_size(max_rows)
        self.depth = depth
        self._lanes = [_Lane() for _ in range(depth)]
        self._next = 0  # the lane of the next launch
        self._inflight: deque[tuple[_Lane, _Bucket, int, torch.Tensor | None]] = deque()
        self._last: tuple[_Bucket, int] | None = None
        self.keep_scores = False  # off CUDA, also write the scores that last_scores() reads
        if self.on_cuda:
            from lora_kernels.steptrim import hidden_source  # Triton: imported only where the kernel runs

            self._hidden_source = hidden_source
            for lane in self._lanes:
                # the hidden states' (address, row stride), read by the kernel at run time
                lane.src = torch.zeros(2, dtype=torch.int64, pin_memory=True)
                lane.src_np = lane.src.numpy()
                # external: inside a graph they become event record nodes, so one replay records both
                lane.events = (_timing_event(), _timing_event())
            self._pool: Any = None
            self._stream: Any = None
        for lane in self._lanes:
            size = MIN_BUCKET
            while size <= self.max_rows:
                self._bucket(lane, size)
                size *= 2

    @property
    def mode(self) -> str:
        """'cuda-graph', 'cuda-eager' or 'cpu' (where StepTrim runs)."""
        return ("cuda-graph" if self.use_graphs else "cuda-eager") if self.on_cuda else "cpu"

    @property
    def in_flight(self) -> int:
        """Launches not read yet."""
        return len(self._inflight)

    def _bucket(self, lane: _Lane, size: int) -> _Bucket:
        b = lane.buckets.get(size)
        if b is None:
            meta = torch.zeros(3, size, dtype=torch.int64, pin_memory=self.on_cuda)
            meta[SLOT] = NO_SLOT
            out = torch.zeros(size, dtype=torch.bool, pin_memory=self.on_cuda)
            score = torch.zeros(size, dtype=torch.float32, device=self.device)
            b = lane.buckets[size] = _Bucket(size, meta, meta.numpy(), score, out, out.numpy())
        return b

    def launch(self, rows: Sequence[int], slots: Sequence[int], t: Sequence[int], hidden: torch.Tensor | None) -> None:
        """Queue the decision for rows ``rows`` of ``hidden`` [N, H] (slot and forward t each).

        Slots are never NO_SLOT here. ``hidden`` may be None without a learned policy. At most
        ``depth`` launches may be unread (:meth:`result`).
        """
        if len(self._inflight) >= self.depth:
            raise RuntimeError(f"DecisionLauncher.launch: {self.depth} decisions are unread (call result())")
        lane = self._lanes[self._next]
        self._next = (self._next + 1) % self.depth
        n = len(rows)
        b = self._bucket(lane, bucket_size(n))
        a = b.meta_np
        a[ROW, :n] = rows
        a[SLOT, :n] = slots
        a[T, :n] = t
        if b.filled > n:  # restore the padding that the last, larger launch overwrote
            a[ROW, n:b.filled] = 0
            a[SLOT, n:b.filled] = NO_SLOT
            a[T, n:b.filled] = 0
        b.filled = n
        st = self.steptrim
        if not self.on_cuda:  # hidden (if needed) is on the CPU, like StepTrim
            self._inflight.append((lane, b, n, None))
            h = hidden.index_select(0, b.meta[ROW, :n]) if st.needs_hidden else None
            b.out[:n] = st.fires(b.meta[SLOT, :n], b.meta[T, :n], h)
            if self.keep_scores:
                b.score[:n] = st.scores(b.meta[SLOT, :n], h) if st.needs_hidden else 0.0
            return
        # on CUDA StepTrim has a learned policy (else it is on the CPU), so hidden is given
        hidden = StepTrim.kernel_hidden(hidden)
        self._hidden_source(hidden, lane.src_np)  # through a numpy view: no torch call
        self._inflight.append((lane, b, n, hidden))
        if self.use_graphs:
            graph = self._graph(lane, b, hidden.dtype)
            if graph is not None:
                graph.replay()
                return
        self._run(lane, b, hidden.dtype)

    def result(self) -> tuple[np.ndarray, float | None]:
        """Wait for the oldest unread decision: (fired bool [n], a numpy view valid until its
        lane's next launch; the GPU time between the two events in ms, None off CUDA)."""
        if not self._inflight:
            raise RuntimeError("DecisionLauncher.result: nothing was launched")
        lane, b, n, _ = self._inflight.popleft()  # drops the hidden states once the wait is over
        gpu_ms = None
        if self.on_cuda:
            ev0, ev1 = lane.events
            ev1.synchronize()
            gpu_ms = ev0.elapsed_time(ev1)
        self._last = (b, n)
        return b.out_np[:n], gpu_ms

    def unread(self) -> list[Launched]:
        """The unread launches, oldest first, to be read ahead of :meth:`result` (:class:`Launched`)."""
        return [Launched(lane, b, n) for lane, b, n, _ in self._inflight]

    def last_scores(self) -> torch.Tensor:
        """The scores s of the last read decision's rows (float32 [n], on StepTrim's device; for
        checks: meaningful for learned slots, off CUDA only with ``keep_scores``)."""
        if self._last is None:
            raise RuntimeError("DecisionLauncher.last_scores: no decision was read")
        b, n = self._last
        return b.score[:n]

    def warm_up(self, hidden: torch.Tensor) -> int:
        """Compile the decision kernel and capture each preallocated bucket's CUDA graph, in every
        lane, for hidden states of ``hidden``'s dtype (any [N ≥ 1, H] tensor: vLLM's dummy batch at
        start-up), so that the first served steps pay neither (a Triton compile took ~0.3 s in
        the first decision of a fresh ``vllm serve``). Decides nothing: call it before serving,
        with nothing in flight; it leaves every bucket's rows as padding. Returns the number of
        buckets warmed (0 off CUDA, where nothing is compiled)."""
        if not self.on_cuda:
            return 0
        if self._inflight or self._last is not None:
            raise RuntimeError("DecisionLauncher.warm_up: call it before the first decision")
        hidden = StepTrim.kernel_hidden(hidden)
        for lane in self._lanes:
            self._hidden_source(hidden, lane.src_np)
            for b in lane.buckets.values():
                if self.use_graphs:
                    self._graph(lane, b, hidden.dtype)  # a direct launch (the compile), then the capture
                else:
                    self._run(lane, b, hidden.dtype)
        torch.cuda.synchronize(self.device)
        return sum(len(lane.buckets) for lane in self._lanes)

    # -- CUDA ------------------------------------------------------------------------------
    def _run(self, lane: _Lane, b: _Bucket, dtype: torch.dtype) -> None:
        ev0, ev1 = lane.events
        ev0.record()
        self.steptrim.fires_into(b.meta, lane.src, dtype, b.score, b.out)
        ev1.record()

    def _graph(self, lane: _Lane, b: _Bucket, dtype: torch.dtype) -> Any:
        """The bucket's graph for hidden states of ``dtype`` (captured now if new); None, and
        direct launches from then on, if the capture fails."""
        g = b.graphs.get(dtype)
        if g is None:
            try:
                g = b.graphs[dtype] = self._capture(lane, b, dtype)
            except Exception as e:  # a capture problem must not stop serving: same decisions, launched directly
                logger.warning("StepTrim decisions run without CUDA graphs: capturing %d rows failed (%s: %s).",
                               b.size, type(e).__name__, e)
                self.use_graphs = False
                return None
        return g

    def _capture(self, lane: _Lane, b: _Bucket, dtype: torch.dtype) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        main = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(main)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self._stream):
            self.steptrim.fires_into(b.meta, lane.src, dtype, b.score, b.out)  # compiles; outside the capture
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                self._run(lane, b, dtype)
            finally:
                graph.capture_end()
        main.wait_stream(self._stream)
        return graph


def _timing_event() -> Any:
    try:
        return torch.cuda.Event(enable_timing=True, external=True)
    except TypeError:  # a torch without external events: a capture that records one fails, and runs directly
        return torch.cuda.Event(enable_timing=True)
