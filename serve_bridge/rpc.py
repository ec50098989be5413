"""Counter read-outs for ``LLM.collective_rpc`` (one result per worker).

vLLM runs a callable passed to ``collective_rpc`` as ``callable(worker, *args)``
(``v1/serial_utils.py:486-510`` in 0.26.0)::

    from serve_bridge.rpc import lorazor_counters, lorazor_requests
    counters = llm.collective_rpc(lorazor_counters)[0]
    records = llm.collective_rpc(lorazor_requests, kwargs={"clear": True})[0]
"""
from __future__ import annotations

from typing import Any

from serve_bridge.runtime import ReleaseRuntime
from serve_bridge.settings import BUNDLE_ENV


def _runtime(worker: Any) -> ReleaseRuntime:
    runtime = getattr(getattr(worker, "model_runner", None), "lorazor", None)
    if runtime is None:
        raise RuntimeError(f"LoRazor StepTrim is not active in this vLLM worker: start vLLM with {BUNDLE_ENV}=<bundle "
                           f"directory> and VLLM_USE_V2_MODEL_RUNNER=0.")
    return runtime


def lorazor_counters(worker: Any) -> dict[str, Any]:
    """Released requests, realized skip per adapter and overall, decision latency."""
    return _runtime(worker).counters()


def lorazor_requests(worker: Any, clear: bool = False) -> list[dict[str, Any]]:
    """Per-request records: vLLM's internal request id, adapter, forwards run, release
    point r (None: not released) and ``finished``.

    Finished requests come first, oldest first, then the tracked ones. The runner learns
    that a request finished only at the next engine step, so the requests of the last
    step of a batch stay tracked (with final values) until more work arrives. ``clear``
    empties the finished records after reading them.
    """
    runtime = _runtime(worker)
    runtime.resolve()
    records = [{**rec, "finished": True} for rec in runtime.finished_log]
    records += [{"req_id": req_id, "adapter": st.adapter, "forwards": st.forwards, "release": st.release,
                 "finished": False} for req_id, st in runtime.states.items()]
    if clear:
        runtime.finished_log.clear()
    return records
