"""StepTrim release semantics — the single implementation (docs/design.md §2).

Forwards of a request are indexed t = 0, 1, 2, …: t = 0 is the prefill forward (it produces
the first generated token); decode forward t ≥ 1 consumes token t and produces token t+1.

*Release point* r: the adapter is applied at every forward t ≤ r and at none after. Release
is one-way and prefill is never released, so r ≥ 0.

- Profiled policy (k): r = k (k = 0 means prefill only).
- Learned policy (w, b, τ, lag): after forward t, s_t = wᵀh_t + b with h_t the final-norm hidden
  state at the position that produced token t+1; the decision *fires* at the first t with s_t < τ,
  and r = that t + lag. With lag 0 the next forward runs without the adapter; with lag 1 it still
  runs with it, so a server may plan forward t+1 before the decision on forward t is read (vLLM's
  async scheduling). Calibration prices the lag its bundle records, so both rules are exact.
- No policy (adapter absent from the bundle): never released (full LoRA, the safe default).

Skip fraction: decode forwards (t ≥ 1) that run without the adapter, over all decode
forwards, summed over requests. A response of L tokens takes forwards 0 … L−1, so it has
L−1 decode forwards, of which max(0, L−1−r) skip the adapter.

This module is pure torch (on CUDA it launches the Triton kernel of ``lora_kernels.steptrim``) and
imports no vLLM: the hf engine, the sweep and the vLLM runtime all call it, so calibrated
numbers predict serving.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

NO_SLOT = -1  # a row without adapter (backbone only), as in vLLM's token→slot mapping


@dataclass(frozen=True)
class ProfiledPolicy:
    """Release after forward ``k`` (adapter applied at t ≤ k)."""

    k: int

    def __post_init__(self) -> None:
        if self.k < 0:
            raise ValueError(f"profiled k must be ≥ 0 (prefill is never released), got {self.k}")

    def fires(self, t: int) -> bool:
        """Whether the request is released after forward ``t`` (StepTrim's profiled rule, t ≥ k)."""
        return t >= self.k


MAX_LAG = 8  # forwards a learned release may trail its decision (a server needs 0 or 1)


@dataclass(frozen=True)
class LearnedPolicy:
    """Release after forward t + ``lag``, t the first forward whose score wᵀh_t + b falls below
    ``tau`` (0 ≤ lag ≤ :data:`MAX_LAG`)."""

    weight: torch.Tensor  # [H]
    bias: float
    tau: float
    lag: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.lag, bool) or not isinstance(self.lag, int) or not 0 <= self.lag <= MAX_LAG:
            raise ValueError(f"a learned policy's lag must be an int in 0…{MAX_LAG} (forwards between its decision "
                             f"and the release), got {self.lag!r}")

    def score(self, h: torch.Tensor) -> torch.Tensor:
        """s = hᵀw + b for h of shape [..., H], computed in float32."""
        return h.float() @ self.weight.float().to(h.device) + self.bias


Policy = ProfiledPolicy | LearnedPolicy | None

_K, _TAU, _B, _W = 0, 1, 2, 3  # columns of StepTrim's per-slot table; the head weight is _W:
K_LIMIT = 1 << 24  # profiled k is held in float32, exact below 2**24
_EXACT_UPCAST = (torch.float32, torch.bfloat16, torch.float16)  # promote to float32 exactly


class StepTrim:
    """Batched, one-way release decisions for rows that each have an adapter slot.

    ``policies`` maps slot index → policy (None = never release). Slots are the engine's
    adapter indices; rows with slot :data:`NO_SLOT` have no adapter and are never affected.

    All per-slot parameters live in one float32 table, one row per slot plus a last row for
    NO_SLOT (torch indexing wraps −1 to that row, so slots need no remapping). Columns: k
    (profiled; +inf otherwise, exact for k < 2**24), τ (learned; −inf otherwise, so s < τ never
    holds), b, then the head weight w [H] (zeros for non-learned slots; present only when a
    learned policy is). One decision is one gather of that table plus a few elementwise ops:

        fire = (t ≥ k) | (s < τ),  s = Σ_j h_j·w_j + b  in float32,

    i.e. the profiled rule for profiled slots, the learned rule for learned slots, neither for
    the rest. s is the float32 sum of the float32 products h_j·w_j (no GEMM: no TF32, no
    reduction order that changes with the number of heads). Its order of summation belongs to
    the device: torch's ``(h.float() * w).sum(-1) + b`` off CUDA, and on CUDA the fused kernel
    of :mod:`lora_kernels.steptrim` (one launch: gather, score, compare), whose order depends on the
    hidden size only, not on the batch. ``kernel`` picks the path (default: the kernel on CUDA;
    True off CUDA needs Triton's interpreter). On one device, :meth:`scores`, :meth:`fires`,
    :meth:`step` and :meth:`fires_into` agree bit for bit on the same rows, so the sweep's
    recorded scores are the ones serving compares with τ.
    """

    def __init__(self, policies: Sequence[Policy], hidden_size: int, device: torch.device | str = "cpu",
                 kernel: bool | None = None) -> None:
        self.policies = tuple(policies)
        self.hidden_size = int(hidden_size)
        self.needs_hidden = any(isinstance(p, LearnedPolicy) for p in self.policies)
        # per slot, forwards between a firing decision and the release (learned slots' lag, else 0)
        self.lags = tuple(p.lag if isinstance(p, LearnedPolicy) else 0 for p in self.policies)
        learned_lags = [p.lag for p in self.policies if isinstance(p, LearnedPolicy)]
        self.min_lag = min(learned_lags, default=0)
        n = len(self.policies)
        table = torch.zeros(n + 1, _W + (self.hidden_size if self.needs_hidden else 0), dtype=torch.float32)
        table[:, _K] = float("inf")
        table[:, _TAU] = float("-inf")
        for i, p in enumerate(self.policies):
            if isinstance(p, ProfiledPolicy):
                if p.k >= K_LIMIT:
                    raise ValueError(f"slot {i}: profiled k={p.k} is ≥ 2**24, which StepTrim cannot hold exactly; "
                                     f"no response has that many forwards: use no policy (never release) instead")
                table[i, _K] = p.k
            elif isinstance(p, LearnedPolicy):
                if p.weight.shape != (hidden_size,):
                    raise ValueError(f"slot {i}: head weight shape {tuple(p.weight.shape)} != ({hidden_size},)")
                table[i, _TAU], table[i, _B] = p.tau, p.bias
                table[i, _W:] = p.weight.detach().float().cpu()
            elif p is not None:
                raise TypeError(f"slot {i}: unsupported policy {type(p).__name__}")
        self.device = torch.device(device)
        self.table = table.to(self.device)  # [n_slots + 1, 3 (+ H)]; the last row serves NO_SLOT
        self.kernel = self.device.type == "cuda" if kernel is None else bool(kernel)

    def release_point(self, slot: int, t: int) -> int:
        """r of a row of ``slot`` whose decision fired after forward ``t`` (t plus the slot's lag)."""
        return t + self.lags[slot]

    def to(self, device: torch.device | str) -> StepTrim:
        """The same policies on another device (self if already there), on that device's path."""
        device = torch.device(device)
        return self if device == self.device else StepTrim(self.policies, self.hidden_size, device)

    @staticmethod
    def exact_hidden(hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` as float32/bf16/fp16 (other dtypes become float32): types whose float32
        promotion is exact, so every path multiplies the same float32 values."""
        return hidden if hidden.dtype in _EXACT_UPCAST else hidden.float()

    @classmethod
    def kernel_hidden(cls, hidden: torch.Tensor) -> torch.Tensor:
        """:meth:`exact_hidden` with unit column stride, as the kernel reads rows (usually
        ``hidden`` itself; a copy only where a dtype or the column stride needs one)."""
        hidden = cls.exact_hidden(hidden)
        return hidden if hidden.stride(-1) == 1 else hidden.contiguous()

    def _score(self, params: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        # bf16/fp16 × float32 promotes inside the kernel: the same float32 products as hidden.float() * w
        return (self.exact_hidden(hidden) * params[:, _W:]).sum(-1).add_(params[:, _B])

    def scores(self, slots: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """s = w_slot · h + b_slot per row, float32 [R] (zeros for non-learned slots)."""
        if not self.needs_hidden:
            return torch.zeros(slots.shape[0], dtype=torch.float32, device=self.device)
        if self.kernel:
            return self._launch(slots, torch.zeros_like(slots), hidden)[0]
        return self._score(self.table[slots], hidden)

    def margins(self, slots: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """s − τ_slot per row, float32 [R]: below 0 a learned policy fires; +inf for other slots."""
        return scores.float() - self.table[slots.to(self.device), _TAU]

    def fires(self, slots: torch.Tensor, t: torch.Tensor, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Rows whose policy releases them after forward ``t`` (bool [R]), ignoring earlier release.

        The engine-facing form of :meth:`step` for rows known to be unreleased; same arguments.
        """
        if self.needs_hidden and hidden is None:
            raise ValueError("a learned policy needs the final hidden states of the step")
        if self.kernel:
            return self._launch(slots, t, hidden)[1]
        params = self.table[slots]  # one gather: k, τ, b (and w) per row
        fire = t >= params[:, _K]
        if self.needs_hidden:
            fire |= self._score(params, hidden) < params[:, _TAU]
        return fire

    def fires_into(self, meta: torch.Tensor, src: torch.Tensor, hidden_dtype: torch.dtype, score: torch.Tensor,
                   fire: torch.Tensor) -> None:
        """The kernel path's launch, for callers that keep their own buffers (the serving
        runtime's CUDA graphs): rows ``meta`` (int64 [3, B]: hidden row, slot, t; padding rows
        have slot NO_SLOT) of the hidden states that ``src`` points at
        (:func:`lora_kernels.steptrim.hidden_source`, dtype ``hidden_dtype``) into ``score``
        (float32 [B]) and ``fire`` (bool [B]). Buffers may be pinned host memory."""
        from lora_kernels.steptrim import launch_steptrim  # Triton, imported on the kernel path only

        if not self.kernel:
            raise RuntimeError("StepTrim.fires_into: this StepTrim computes with torch (kernel=False)")
        launch_steptrim(meta, src, hidden_dtype, self.table, self.needs_hidden, score, fire)

    def _launch(self, slots: torch.Tensor, t: torch.Tensor,
                hidden: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        from lora_kernels.steptrim import hidden_source

        n = slots.shape[0]
        meta = torch.stack([torch.arange(n, device=self.device), slots.to(self.device, torch.int64),
                            t.to(self.device, torch.int64)])
        if self.needs_hidden:
            hidden = self.kernel_hidden(hidden)
            src, dtype = hidden_source(hidden), hidden.dtype
        else:
            src, dtype = meta, torch.float32  # not read
        score = torch.empty(n, dtype=torch.float32, device=self.device)
        fire = torch.empty(n, dtype=torch.bool, device=self.device)
        self.fires_into(meta, src, dtype, score, fire)
        return score, fire

    def step(self, slots: torch.Tensor, t: torch.Tensor, decided: torch.Tensor,
             hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Decide after forward ``t`` (per row) which rows have a release decided: each such row
        runs without its adapter from forward :meth:`release_point` + 1 on.

        slots [R] long (:data:`NO_SLOT` = −1 for rows without adapter; no other negative
        value), t [R] long, decided [R] bool (state before this decision), hidden [R, H]
        final-norm hidden states of this forward (needed iff a learned policy is present).
        Returns the new decided mask; a decision never reverts.
        """
        return decided | self.fires(slots, t, hidden)


def release_point_profiled(k: int) -> int:
    """r for a profiled policy."""
    return ProfiledPolicy(k).k


def release_point_learned(scores: Iterable[float], tau: float, lag: int = 0) -> int | None:
    """r for a learned policy: the first t with s_t < τ, plus ``lag``; None if it never fires."""
    for t, s in enumerate(scores):
        if s < tau:
            return t + lag
    return None


def skipped_decode_forwards(length: int, release: int | None) -> int:
    """Decode forwards without adapter for a response of ``length`` tokens released at r."""
    if release is None:
        return 0
    return max(0, length - 1 - release)


def skip_fraction(lengths: Sequence[int], releases: Sequence[int | None]) -> float:
    """Σ skipped decode forwards / Σ decode forwards (longer responses weigh more)."""
    if len(lengths) != len(releases):
        raise ValueError("lengths and releases must align")
    total = sum(max(0, n - 1) for n in lengths)
    skipped = sum(skipped_decode_forwards(n, r) for n, r in zip(lengths, releases))
    return skipped / total if total else 0.0


def policies_for(adapters: Sequence[str], by_name: Mapping[str, Policy]) -> list[Policy]:
    """Slot-ordered policies; an adapter without a policy gets None (never released)."""
    return [by_name.get(a) for a in adapters]
