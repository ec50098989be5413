"""The bridge's calibration mode: a runtime without bundle whose policies are set per pass.

``LORAZOR_CALIBRATION=1`` (:mod:`serve_bridge.vllm.settings`) makes the vLLM runner start a
:class:`CalibrationRuntime`. The calibration engine (``labeling.engines.vllm``) configures it
over ``LLM.collective_rpc`` before each ``generate`` (:func:`serve_bridge.vllm.rpc.lorazor_calibrate`):

- ``slots``: adapter names in slot order (the engine's adapter list); a request whose LoRA
  name is slot i has StepTrim slot i, any other request NO_SLOT.
- ``policy``: the release policy of the pass (a :class:`StepTrim`, as plain data; None = full
  LoRA). Decisions run through the same :class:`ReleaseRuntime` code as serving, and so
  through :meth:`StepTrim.fires` — the one implementation of docs/design.md §2.
- ``scorer``: a StepTrim whose learned heads score every forward (s_t), or None.
- ``capture``: the forwards t whose h_t is recorded.

Requests tagged with a uid (``SamplingParams.extra_args``, see :mod:`serve_bridge.runtime`)
get a record: the realized release r, s_t of the scorer at every forward, and h_t (float32
[H], the final-norm hidden state of the sampled position — exactly the rows ``decide``
receives) at the forwards of the capture set. :func:`serve_bridge.vllm.rpc.lorazor_captures`
returns the records as plain data (lists, floats, ints: they cross process boundaries
through vLLM's msgpack or pickle channels) and clears them.

Scores and hidden rows are gathered on the device right after the forward is launched, and
copied to the host without blocking; the copies are read at the next step (or read-out).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from serve_bridge.runtime import ReleaseRuntime, RequestState, logger, rows_match
from serve_bridge.steptrim import NO_SLOT, LearnedPolicy, Policy, ProfiledPolicy, StepTrim


# -- policies as plain data ------------------------------------------------------------------

def policy_to_data(p: Policy) -> dict[str, Any] | None:
    """One policy as JSON-like data (floats of a float32 head are exact as Python floats)."""
    if p is None:
        return None
    if isinstance(p, ProfiledPolicy):
        return {"kind": "profiled", "k": int(p.k)}
    if isinstance(p, LearnedPolicy):
        w = p.weight.detach().float().cpu()
        return {"kind": "learned", "weight": w.tolist(), "bias": float(np.float32(p.bias)),
                "tau": float(np.float32(p.tau)), "lag": int(p.lag)}
    raise TypeError(f"unsupported policy {type(p).__name__}")


def policy_from_data(d: Mapping[str, Any] | None) -> Policy:
    if d is None:
        return None
    if d.get("kind") == "profiled":
        return ProfiledPolicy(int(d["k"]))
    if d.get("kind") == "learned":
        return LearnedPolicy(torch.tensor(d["weight"], dtype=torch.float32), float(d["bias"]), float(d["tau"]),
                             int(d.get("lag", 0)))
    raise ValueError(f"unknown policy data {dict(d)!r}: kind must be 'profiled' or 'learned'")


def steptrim_to_data(st: StepTrim | None) -> list[dict[str, Any] | None] | None:
    """A StepTrim's slot-ordered policies as plain data (None stays None)."""
    return None if st is None else [policy_to_data(p) for p in st.policies]


def steptrim_from_data(data: Sequence[Mapping[str, Any] | None] | None, hidden_size: int,
                       device: torch.device | str = "cpu") -> StepTrim | None:
    return None if data is None else StepTrim([policy_from_data(d) for d in data], hidden_size, device)


def require_cacheable(policy: StepTrim | None, prefix_caching: bool) -> None:
    """Refuse a pass with a release policy on an engine that caches prefixes: the scheduler keys
    cached blocks by forced release positions only (:mod:`serve_bridge.vllm.prefix_cache`), and blocks
    decoded after a release the runtime decides would be cached under the adapter's name."""
    if prefix_caching and policy is not None and any(p is not None for p in policy.policies):
        raise ValueError("this pass has a release policy, and the vLLM engine caches prefixes "
                         "(engine.prefix_caching=true): releases decided while decoding would leave KV blocks "
                         "cached under the adapter's name. Run it with engine.prefix_caching=false; the cached "
                         "stages before it are kept.")


def calibration_config(slots: Sequence[str], policy: StepTrim | None = None, scorer: StepTrim | None = None,
                       capture: Iterable[int] = ()) -> dict[str, Any]:
    """The argument of :func:`serve_bridge.vllm.rpc.lorazor_calibrate` (plain data)."""
    for name, st in (("policy", policy), ("scorer", scorer)):
        if st is not None and len(st.policies) != len(slots):
            raise ValueError(f"{name} has {len(st.policies)} slots for {len(slots)} adapters {list(slots)}")
    return {"slots": list(slots), "policy": steptrim_to_data(policy), "scorer": steptrim_to_data(scorer),
            "capture": sorted({int(t) for t in capture})}


# -- records -----------------------------------------------------------------------------------

@dataclass
class CaptureRecord:
    """What one uid-tagged request recorded; its state gives the release and forwards."""

    state: RequestState
    scores: dict[int, float] = field(default_factory=dict)
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)

    def as_data(self) -> dict[str, Any]:
        """release (r or None), forced_release_position, forwards, scores [s_0 … s_{forwards−1}]
        (NaN where a forward was not scored; empty without a scorer), hidden {t: [H] floats}."""
        st = self.state
        scores = [self.scores.get(t, float("nan")) for t in range(st.forwards)] if self.scores else []
        return {"release": st.release, "forced_release_position": st.forced_release_position,
                "forwards": st.forwards, "scores": scores,
                "hidden": {t: h.tolist() for t, h in sorted(self.hidden.items())}}


@dataclass
class _CapturePlan:
    num_rows: int
    rows: list[int]
    records: list[CaptureRecord]
    forwards: list[int]


@dataclass
class _Captured:
    """One step's device→host copies, read at the next step."""

    records: list[CaptureRecord]
    forwards: list[int]
    keep: list[int]  # indices into records whose h_t is captured
    scores: torch.Tensor | None
    hidden: torch.Tensor | None
    event: Any


class CalibrationRuntime(ReleaseRuntime):
    """A :class:`ReleaseRuntime` without bundle; :meth:`configure` sets its slots, release
    policy, scorer and capture set, and uid-tagged requests are recorded (module docstring).

    Adapters are not checked against a bundle (the calibration engine serves the adapters it
    calibrates): a request's slot is its LoRA name's index in the configured slots.
    """

    def __init__(self, hidden_size: int, device: torch.device | str, log_interval_s: float = 60.0,
                 max_rows: int = 256, cuda_graphs: bool = True, prefix_caching: bool = False) -> None:
        super().__init__(None, StepTrim([], hidden_size, device), [],  # type: ignore[arg-type]  # no bundle
                         log_interval_s=log_interval_s, max_rows=max_rows, cuda_graphs=cuda_graphs)
        self.hidden_size = int(hidden_size)
        self.device = torch.device(device)
        self.scorer: StepTrim | None = None
        self.capture_set: frozenset[int] = frozenset()
        self.records: dict[str, CaptureRecord] = {}
        self._capture_plan: _CapturePlan | None = None
        self._captured: list[_Captured] = []
        self.prefix_caching = prefix_caching

    # -- configuration ---------------------------------------------------------------------
    def configure(self, config: Mapping[str, Any]) -> None:
        """Set slots, policy, scorer and capture set (:func:`calibration_config` data) for the
        requests added from now on. Records are kept until read."""
        slots = list(config.get("slots") or [])
        policy = steptrim_from_data(config.get("policy"), self.hidden_size, self.device)
        scorer = steptrim_from_data(config.get("scorer"), self.hidden_size, self.device)
        for name, st in (("policy", policy), ("scorer", scorer)):
            if st is not None and len(st.policies) != len(slots):
                raise ValueError(f"calibration {name}: {len(st.policies)} slots for {len(slots)} adapters")
        require_cacheable(policy, self.prefix_caching)
        if policy is None:  # full LoRA: no slot ever releases
            policy = StepTrim([None] * len(slots), self.hidden_size, self.device)
        self.set_steptrim(policy, slots)
        self.scorer = scorer
        self.capture_set = frozenset(int(t) for t in config.get("capture") or ())

    def _slot(self, adapter: str, path: str | None) -> int:
        return self.slot_of.get(adapter, NO_SLOT)

    # -- request lifecycle -----------------------------------------------------------------
    def add(self, req_id: str, adapter: str | None, adapter_path: str | None, num_prompt_tokens: int,
            extra_args: Mapping[str, Any] | None = None) -> None:
        known = req_id in self.states
        super().add(req_id, adapter, adapter_path, num_prompt_tokens, extra_args)
        st = self.states[req_id]
        if known or st.uid is None:
            return
        if st.uid in self.records and self.records[st.uid].state is not st:
            logger.warning("LoRazor calibration: uid %r was tagged on two requests; the later one's record "
                           "replaces the earlier one's.", st.uid)
        self.records[st.uid] = CaptureRecord(st)

    # -- one engine step -------------------------------------------------------------------
    def begin_step(self, req_ids: Sequence[str], num_computed: np.ndarray, num_scheduled: np.ndarray,
                   num_tokens: np.ndarray, token_mapping: Sequence[int], sampled_mapping: Sequence[int]):
        self._flush()
        mapping = super().begin_step(req_ids, num_computed, num_scheduled, num_tokens, token_mapping,
                                     sampled_mapping)
        plan = _CapturePlan(len(req_ids), [], [], [])
        for i, st, t in self.completed:
            rec = self.records.get(st.uid) if st.uid is not None else None
            if rec is None or rec.state is not st:
                continue  # untagged, or its record was read and cleared
            plan.rows.append(i)
            plan.records.append(rec)
            plan.forwards.append(t)
        self._capture_plan = plan if plan.rows else None
        return mapping

    def wants_hidden(self) -> bool:
        return super().wants_hidden() or self._capture_plan is not None

    def capture(self, hidden: torch.Tensor) -> None:
        """Record s_t (scorer) and h_t (capture set) of this step's tagged rows from ``hidden``
        [R, H], the rows :meth:`decide` receives; call it before or after ``decide``."""
        plan, self._capture_plan = self._capture_plan, None
        if not rows_match(plan, hidden, "LoRazor calibration"):
            return
        keep = [j for j, t in enumerate(plan.forwards) if t in self.capture_set]
        if self.scorer is None and not keep:
            return
        dev = hidden.device
        rows = torch.tensor(plan.rows, dtype=torch.long).to(dev, non_blocking=True)
        h = hidden.index_select(0, rows)
        scores = kept = None
        if self.scorer is not None:
            if self.scorer.device != dev:
                self.scorer = self.scorer.to(dev)
            slots = torch.tensor([r.state.slot for r in plan.records], dtype=torch.long).to(dev, non_blocking=True)
            scores = self.scorer.scores(slots, h).to("cpu", non_blocking=True)
        if keep:
            kept = h.index_select(0, torch.tensor(keep, dtype=torch.long).to(dev, non_blocking=True))
            kept = kept.float().to("cpu", non_blocking=True)
        event = None
        if hidden.is_cuda:
            event = torch.cuda.Event()
            event.record()
        self._captured.append(_Captured(plan.records, plan.forwards, keep, scores, kept, event))

    def _flush(self) -> None:
        """Move finished device→host copies into the records."""
        for c in self._captured:
            if c.event is not None:
                c.event.synchronize()
            if c.scores is not None:
                for rec, t, s in zip(c.records, c.forwards, c.scores.tolist()):
                    rec.scores[t] = s
            if c.hidden is not None:
                for k, j in enumerate(c.keep):
                    c.records[j].hidden[c.forwards[j]] = c.hidden[k]
        self._captured.clear()

    # -- read-out ----------------------------------------------------------------------------
    def take_records(self, clear: bool = True, uids: Iterable[str] | None = None) -> dict[str, dict[str, Any]]:
        """uid → :meth:`CaptureRecord.as_data` of every tagged request since the last read, or
        of those among ``uids`` (unknown ones are left out); ``clear`` drops what is returned.

        A request's record is complete once vLLM has returned its last token: the forward that
        produced it was counted at its step's start, and its pending copies and decision are
        read here first."""
        self._flush()
        self.resolve()
        keys = list(self.records) if uids is None else [u for u in uids if u in self.records]
        out = {uid: self.records[uid].as_data() for uid in keys}
        if clear:
            for uid in keys:
                del self.records[uid]
        return out

    def counters(self) -> dict[str, Any]:
        c = super().counters()
        c["calibration"] = {"slots": list(self.slot_of), "records": len(self.records),
                            "capture": sorted(self.capture_set), "scorer": self.scorer is not None}
        return c
