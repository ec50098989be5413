"""Read-outs and calibration control over ``LLM.collective_rpc`` (one result per worker)::

    from serve_bridge.vllm.rpc import lorazor_counters, lorazor_requests
    counters = llm.collective_rpc(lorazor_counters)[0]
    records = llm.collective_rpc(lorazor_requests, kwargs={"clear": True})[0]

Calibration mode (``LORAZOR_CALIBRATION=1``, :mod:`serve_bridge.calibration`)::

    from serve_bridge.calibration import calibration_config
    from serve_bridge.vllm.rpc import lorazor_calibrate, lorazor_captures
    llm.collective_rpc(lorazor_calibrate, args=(calibration_config(names, policy, scorer, {0, 3}),))
    llm.generate(...)  # requests tagged with extra_args={"lorazor": {"uid": ...}}
    records = llm.collective_rpc(lorazor_captures)[0]  # uid -> release, scores, hidden

Arguments and results are plain data, so they cross vLLM's process boundaries; vLLM sends the
callables themselves only in-process or with insecure serialization allowed
(docs/vllm_integration.md §8).
"""
from __future__ import annotations

from typing import Any

from serve_bridge.calibration import CalibrationRuntime
from serve_bridge.runtime import ReleaseRuntime
from serve_bridge.vllm import prefix_cache
from serve_bridge.vllm.settings import BUNDLE_ENV, CALIBRATION_ENV


def _runtime(worker: Any) -> ReleaseRuntime:
    runtime = getattr(getattr(worker, "model_runner", None), "lorazor", None)
    if runtime is None:
        raise RuntimeError(f"LoRazor StepTrim is not active in this vLLM worker: start vLLM with {BUNDLE_ENV}=<bundle "
                           f"directory> (and, on vLLM 0.26.0, VLLM_USE_V2_MODEL_RUNNER=0).")
    return runtime


def lorazor_counters(worker: Any) -> dict[str, Any]:
    """Released requests, realized skip per adapter and overall, decision latency."""
    return _runtime(worker).counters()


def lorazor_requests(worker: Any, clear: bool = False) -> list[dict[str, Any]]:
    """Per-request records: vLLM's internal request id, adapter, forwards run, release
    point r (None: not released), ``margins`` ([t, s_t − τ] of each learned decision, while
    :func:`lorazor_record_margins` is on) and ``finished``.

    Finished requests come first, oldest first, then the tracked ones. The runner learns
    that a request finished only at the next engine step, so the requests of the last
    step of a batch stay tracked (with final values) until more work arrives. ``clear``
    empties the finished records after reading them.
    """
    runtime = _runtime(worker)
    runtime.resolve()
    records = [{**st.record(req_id), "finished": True} for req_id, st in runtime.finished_log]
    records += [{**st.record(req_id), "finished": False} for req_id, st in runtime.states.items()]
    if clear:
        runtime.finished_log.clear()
    return records


def lorazor_prefix_cache(worker: Any) -> dict[str, int] | None:
    """The release-aware scheduler's prefix-cache hits (:class:`serve_bridge.vllm.prefix_cache.HitStats`),
    read in the worker's process: the engine core's with one GPU (``uni`` executor); None in a
    tensor-parallel worker process, or without prefix caching."""
    _runtime(worker)
    return prefix_cache.hit_stats()


def lorazor_record_margins(worker: Any, on: bool = True) -> None:
    """Keep each learned decision's margin s_t − τ in its request's record from the next step on
    (one device-to-host read per step; for checks, not for serving)."""
    _runtime(worker).record_margins = on


def _calibration(worker: Any) -> CalibrationRuntime:
    runtime = _runtime(worker)
    if not isinstance(runtime, CalibrationRuntime):
        raise RuntimeError(f"this vLLM worker runs LoRazor in serving mode; calibration needs {CALIBRATION_ENV}=1 "
                           f"(and no {BUNDLE_ENV}) in every vLLM process.")
    return runtime


def lorazor_calibrate(worker: Any, config: dict[str, Any]) -> None:
    """Set the calibration runtime's slots, release policy, scorer and capture set for the
    next requests (``config``: :func:`serve_bridge.calibration.calibration_config`)."""
    _calibration(worker).configure(config)


def lorazor_captures(worker: Any, clear: bool = True, uids: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """uid → {release, forced_release_position, forwards, scores, hidden} of every uid-tagged
    request since the last read, or of those in ``uids`` (:meth:`CalibrationRuntime.take_records`);
    ``clear`` drops what is returned."""
    return _calibration(worker).take_records(clear=clear, uids=uids)


class LoRazorWorkerExtension:
    """The read-outs as worker methods, for callers that can only name a method.

    Pass ``worker_extension_cls="serve_bridge.vllm.rpc.LoRazorWorkerExtension"`` (``vllm serve
    --worker-extension-cls ...``): then ``llm.collective_rpc("lorazor_counters")`` works, and so does
    the OpenAI server's ``POST /collective_rpc`` with ``{"method": "lorazor_counters"}`` when
    ``VLLM_SERVER_DEV_MODE=1`` (arguments arrive as strings).
    """

    def lorazor_counters(self) -> dict[str, Any]:
        """:func:`lorazor_counters` of this worker."""
        return lorazor_counters(self)

    def lorazor_prefix_cache(self) -> dict[str, int] | None:
        """:func:`lorazor_prefix_cache` of this worker."""
        return lorazor_prefix_cache(self)

    def lorazor_requests(self, clear: bool | str = False) -> list[dict[str, Any]]:
        """:func:`lorazor_requests` of this worker; ``clear`` may arrive as the string "true"."""
        return lorazor_requests(self, clear=clear is True or str(clear).lower() == "true")
