"""StepTrim release semantics — the single implementation (DESIGN §2).

Forwards of a request are indexed t = 0, 1, 2, …: t = 0 is the prefill forward (it produces
the first generated token); decode forward t ≥ 1 consumes token t and produces token t+1.

*Release point* r: the adapter is applied at every forward t ≤ r and at none after. Release
is one-way and prefill is never released, so r ≥ 0.

- Profiled policy (k): r = k (k = 0 means prefill only).
- Learned policy (w, b, τ): after forward t, s_t = wᵀh_t + b with h_t the final-norm hidden
  state at the position that produced token t+1; r = the first t with s_t < τ.
- No policy (adapter absent from the bundle): never released (full LoRA, the safe default).

Skip fraction: decode forwards (t ≥ 1) that run without the adapter, over all decode
forwards, summed over requests. A response of L tokens takes forwards 0 … L−1, so it has
L−1 decode forwards, of which max(0, L−1−r) skip the adapter.

This module is pure torch and imports no vLLM: the hf engine, the sweep and the vLLM
runtime all call it, so calibrated numbers predict serving.
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


@dataclass(frozen=True)
class LearnedPolicy:
    """Release after the first forward t whose score wᵀh_t + b falls below ``tau``."""

    weight: torch.Tensor  # [H]
    bias: float
    tau: float

    def score(self, h: torch.Tensor) -> torch.Tensor:
        """s = hᵀw + b for h of shape [..., H], computed in float32."""
        return h.float() @ self.weight.float().to(h.device) + self.bias


Policy = ProfiledPolicy | LearnedPolicy | None

_NONE, _PROFILED, _LEARNED = 0, 1, 2


class StepTrim:
    """Batched, one-way release decisions for rows that each carry an adapter slot.

    ``policies`` maps slot index → policy (None = never release). Slots are the engine's
    adapter indices; rows with slot :data:`NO_SLOT` have no adapter and are never affected.
    All per-slot parameters are stacked so one call decides for the whole batch with a few
    tensor ops (one batched GEMV for the learned heads), on any device.
    """

    def __init__(self, policies: Sequence[Policy], hidden_size: int, device: torch.device | str = "cpu") -> None:
        n = len(policies)
        self.hidden_size = int(hidden_size)
        kind = torch.zeros(n + 1, dtype=torch.long)  # last entry serves NO_SLOT rows
        k = torch.zeros(n + 1, dtype=torch.long)
        w = torch.zeros(n + 1, hidden_size, dtype=torch.float32)
        b = torch.zeros(n + 1, dtype=torch.float32)
        tau = torch.zeros(n + 1, dtype=torch.float32)
        for i, p in enumerate(policies):
            if isinstance(p, ProfiledPolicy):
                kind[i], k[i] = _PROFILED, p.k
            elif isinstance(p, LearnedPolicy):
                if p.weight.shape != (hidden_size,):
                    raise ValueError(f"slot {i}: head weight shape {tuple(p.weight.shape)} != ({hidden_size},)")
                kind[i], w[i], b[i], tau[i] = _LEARNED, p.weight.float(), p.bias, p.tau
            elif p is not None:
                raise TypeError(f"slot {i}: unsupported policy {type(p).__name__}")
        self.kind, self.k, self.w, self.b, self.tau = (x.to(device) for x in (kind, k, w, b, tau))
        self.needs_hidden = bool((kind == _LEARNED).any())

    def _index(self, slots: torch.Tensor) -> torch.Tensor:
        return torch.where(slots < 0, torch.full_like(slots, self.kind.numel() - 1), slots)

    def scores(self, slots: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """s = w_slot · h + b_slot per row, float32 [R] (zeros for non-learned slots)."""
        idx = self._index(slots)
        return (hidden.float() * self.w[idx]).sum(-1) + self.b[idx]

    def step(self, slots: torch.Tensor, t: torch.Tensor, released: torch.Tensor,
             hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Decide after forward ``t`` (per row) which rows are released from forward t+1 on.

        slots [R] long, t [R] long, released [R] bool (state before this decision),
        hidden [R, H] final-norm hidden states of this forward (needed iff a learned policy
        is present). Returns the new released mask; release never reverts.
        """
        idx = self._index(slots)
        kind = self.kind[idx]
        fire = (kind == _PROFILED) & (t >= self.k[idx])
        if self.needs_hidden:
            if hidden is None:
                raise ValueError("a learned policy needs the final hidden states of the step")
            s = (hidden.float() * self.w[idx]).sum(-1) + self.b[idx]
            fire |= (kind == _LEARNED) & (s < self.tau[idx])
        return released | fire


def release_point_profiled(k: int) -> int:
    """r for a profiled policy."""
    return ProfiledPolicy(k).k


def release_point_learned(scores: Iterable[float], tau: float) -> int | None:
    """r for a learned policy: the first t with s_t < τ, or None if it never fires."""
    for t, s in enumerate(scores):
        if s < tau:
            return t
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
