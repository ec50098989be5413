"""Calibration engine on a supported vLLM (docs/serving.md), through serve_bridge's calibration mode
(docs/design.md §3.3, §4).

:class:`VLLMEngine` has the interface of :class:`labeling.engines.hf.HFEngine` (``adapters``,
``hidden_size``, ``encode``, ``decode``, ``generate`` with the same GenRequest / GenResult), so
labeling, the sweep pass, the test stage and the agreement stage run on it unchanged.

How it maps the hf engine's semantics onto vLLM:

- **ON pass**: every request in one ``LLM.generate`` — greedy (temperature 0), its adapter's
  ``LoRARequest`` (slot i → ``adapters[i]``, NO_SLOT → none), ``max_tokens = max_new_tokens``,
  and exactly the hf engine's stop set: ``stop_token_ids`` = that set and ``ignore_eos=True``,
  which only turns off vLLM's own EOS lookup (``sampling_params.py:629-657``;
  ``v1/core/sched/utils.py:103-111`` then stops on ``stop_token_ids`` alone). The stop token
  is kept in ``token_ids`` (``v1/core/sched/scheduler.py:2013-2021``,
  ``v1/engine/detokenizer.py:41-42``), as the hf engine keeps it in ``tokens``.
- **Release, s_t, h_t**: the runner installed by ``LORAZOR_CALIBRATION=1`` makes StepTrim
  decisions with the pass's policy and records, per uid-tagged request, the realized release,
  the scorer's s_t at every forward and h_t at the capture set (:mod:`serve_bridge.calibration`),
  configured and read over ``collective_rpc`` around each ``generate``.
- **Forks** are decided post hoc: ``fork(result, t, s_t)`` is called in increasing t, exactly
  where the hf engine calls it (after forward t, for a request with an adapter, if token t+1
  is not its last and it is not released after forward t's decision), with a partial result
  holding what the hf engine's has at that point (scores and h_t up to t, release if ≤ t,
  no tokens yet).
- **OFF branches** by prefix replay: requests of prompt + ON tokens[:t+1] with the forced
  release position
  len(prompt) + t (``SamplingParams.extra_args``, :mod:`serve_bridge.runtime`): the adapter is
  applied to the positions ON consumed at forwards ≤ t and not from token t+1 on — OFF_t =
  profiled k = t — with ``max_tokens = max_new_tokens − (t+1)``. ``branches[t]`` = ON
  tokens[:t+1] + that output, the hf engine's layout. By default (``engine.pipeline``) a
  request's OFF branches join the ON pass's engine run as soon as its ON response finishes
  (:meth:`LocalBackend.run_pipelined`), so the ON pass's tail, when few long responses are
  left, runs next to OFF work instead of alone. Otherwise (``pipeline: false``, data-parallel
  replicas, or a pass with a release policy) they run as a second ``generate`` after it.
  Prefix caching is off by default (docs/design.md §4). With ``prefix_caching: true`` the bridge keys the
  KV blocks of forced releases by release position (:mod:`serve_bridge.vllm.prefix_cache`): an OFF
  branch then reuses the prompt and ON-prefix blocks its ON request computed with the adapter,
  instead of re-prefilling them, and passes with a release policy are refused.

Modules: :mod:`.requests` (what is sent to vLLM and how results come back: capture set, ON and
OFF requests, fork replay, branch assembly), :mod:`.options` (the ``engine=vllm`` config schema
and ``vllm.LLM``'s arguments), :mod:`.backend` (one ``LLM`` in this process and the pipelined
engine loop), :mod:`.data_parallel` (replicas in worker processes), :mod:`.engine` (the facade,
:class:`~labeling.engines.vllm.engine.VLLMEngine`). The pure parts are tested on CPU against the
hf engine, the rest over a CPU stand-in for ``vllm.LLM`` (tests/engines/fake_vllm.py).
"""
