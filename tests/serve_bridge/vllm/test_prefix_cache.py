"""serve_bridge.vllm.prefix_cache: KV-block hash keys for released requests (forced, and marked
by the release-aware scheduler), over stand-ins for vLLM 0.26.0's ``v1/core/kv_cache_utils.py``
(its extra keys and chained block hashing restated) and ``v1/core/block_pool.py``, and for 0.34.0's
engine core taking a frontend's prompt block hashes (``frontend_block_hashes``,
``kv_cache_utils.py:1037-1058``, imported by name in ``v1/engine/core.py:67``); the hit counter;
the settings gate and the calibration runtime's refusal."""
from __future__ import annotations

import hashlib
import json
import importlib
import pickle
import sys
from types import ModuleType, SimpleNamespace

import pytest

from serve_bridge.vllm import prefix_cache, versions
from tests.serve_bridge.vllm.stubs import fake_lora_managers
from serve_bridge.calibration import CalibrationRuntime, calibration_config
from serve_bridge.vllm.settings import engine_fixes
from serve_bridge.steptrim import ProfiledPolicy, StepTrim

BLOCK = 4


def lora_extra_keys(request, start_token_idx, end_token_idx, start_mm_idx):
    """vLLM's generate_block_hash_extra_keys for a text-only LoRA request (kv_cache_utils.py:558-590)."""
    keys = [request.lora_request.lora_name] if request.lora_request else []
    return (tuple(keys) if keys else None), start_mm_idx


@pytest.fixture
def vllm_core(monkeypatch):
    """Stand-ins for vllm.v1.core.kv_cache_utils and block_pool, with vLLM's chained hashing of full
    blocks (kv_cache_utils.py:691-743) looking the extra-keys function up by module name."""
    kv = ModuleType("vllm.v1.core.kv_cache_utils")
    kv.generate_block_hash_extra_keys = lora_extra_keys

    def block_hashes(request, known=()):
        """The hashes of the request's full blocks after the ``known`` first ones (0.34's hasher
        continues from the first block a frontend's hashes do not cover, v1/request.py:238-243)."""
        out, parent = [], known[-1] if known else None
        for start in range(BLOCK * len(known), len(request.all_token_ids) - BLOCK + 1, BLOCK):
            extra, _ = kv.generate_block_hash_extra_keys(request, start, start + BLOCK, 0)
            parent = hashlib.sha256(pickle.dumps((parent, tuple(request.all_token_ids[start:start + BLOCK]),
                                                  extra))).digest()
            out.append(parent)
        return out

    kv.block_hashes = block_hashes
    pool = ModuleType("vllm.v1.core.block_pool")
    pool.generate_block_hash_extra_keys = lora_extra_keys
    core = ModuleType("vllm.v1.core")
    core.kv_cache_utils, core.block_pool = kv, pool
    engine_core = ModuleType("vllm.v1.engine.core")
    engine_core.frontend_block_hashes = frontend_block_hashes
    engine = ModuleType("vllm.v1.engine")
    engine.core = engine_core
    for name, module in {"vllm": ModuleType("vllm"), "vllm.v1": ModuleType("vllm.v1"), "vllm.v1.core": core,
                         "vllm.v1.core.kv_cache_utils": kv, "vllm.v1.core.block_pool": pool,
                         "vllm.v1.engine": engine, "vllm.v1.engine.core": engine_core}.items():
        monkeypatch.setitem(sys.modules, name, module)
    return kv, pool


def frontend_block_hashes(request, prefix_hash_config):
    """vLLM 0.34's (kv_cache_utils.py:1037-1058), restated: the frontend's prompt block hashes unless
    their count does not match the prompt's full blocks."""
    if request.block_hashes is None:
        return None
    full = max(len(request.prompt_token_ids) - prefix_hash_config.num_lookahead_tokens, 0)
    if len(request.block_hashes) != full // prefix_hash_config.hash_block_size:
        return None
    return request.block_hashes


def request(tokens, lora="a", release=None, extra=None):
    args = extra if extra is not None else ({"lorazor": {"release_position": release}} if release is not None else None)
    return SimpleNamespace(all_token_ids=list(tokens), lora_request=SimpleNamespace(lora_name=lora) if lora else None,
                           sampling_params=SimpleNamespace(extra_args=args))


def test_released_blocks_hash_apart_and_earlier_blocks_are_shared(vllm_core):
    kv, pool = vllm_core
    prefix_cache.install()
    prefix_cache.install()  # idempotent: wrapped once
    assert prefix_cache.installed() and pool.generate_block_hash_extra_keys is kv.generate_block_hash_extra_keys
    on = list(range(100, 124))  # prompt + ON tokens: 6 blocks
    on_hashes = kv.block_hashes(request(on))
    # OFF branch released at position 13: blocks [0,4) [4,8) [8,12) lie before it, [12,16) holds it
    off = kv.block_hashes(request(on[:20], release=13))
    assert off[:3] == on_hashes[:3] and off[3] != on_hashes[3] and off[4] != on_hashes[4]
    # another release point in the same block gets other keys; one at a block edge shares that block
    other = kv.block_hashes(request(on[:20], release=14))
    assert other[:3] == off[:3] and other[3] != off[3]
    edge = kv.block_hashes(request(on[:20], release=16))
    assert edge[:4] == on_hashes[:4] and edge[4] != on_hashes[4]
    # the keys themselves: unchanged before the release, the marker with r from its block on
    assert kv.generate_block_hash_extra_keys(request(on, release=13), 8, 12, 0) == (("a",), 0)
    assert kv.generate_block_hash_extra_keys(request(on, release=13), 12, 16, 0) == \
        (("a", (prefix_cache.RELEASED_KEY, 13)), 0)
    assert kv.generate_block_hash_extra_keys(request(on, lora=None, release=0), 0, 4, 0) == \
        (((prefix_cache.RELEASED_KEY, 0),), 0)


@pytest.mark.parametrize("extra", [None, {}, {"lorazor": {"uid": "q1"}}, {"lorazor": {"release_position": -1}},
                                   {"lorazor": "bad"}])
def test_requests_without_a_valid_forced_release_keep_vllms_keys(vllm_core, extra):
    kv, _ = vllm_core
    prefix_cache.install()
    req = request(range(8), extra=extra)
    assert kv.generate_block_hash_extra_keys(req, 4, 8, 0) == lora_extra_keys(req, 4, 8, 0)
    assert prefix_cache.forced_release(SimpleNamespace(sampling_params=None)) is None


def _config(prefix: bool):
    return SimpleNamespace(lora_config=object(), model_config=SimpleNamespace(runner_type="generate"),
                           cache_config=SimpleNamespace(enable_prefix_caching=prefix),
                           scheduler_config=SimpleNamespace(async_scheduling=False), speculative_config=None,
                           parallel_config=SimpleNamespace(pipeline_parallel_size=1))


def test_prefix_caching_is_allowed_only_with_keyed_blocks(vllm_core):
    assert not prefix_cache.installed()
    assert any("disable prefix caching" in f for f in engine_fixes(_config(True)))
    prefix_cache.install()
    assert prefix_cache.installed()
    assert engine_fixes(_config(True), released_blocks_keyed=True) == engine_fixes(_config(False)) == []


def test_marked_release_keys_blocks_from_its_position_on(vllm_core):
    """A release the scheduler learns (a profiled k at admission, a learned decision with a step's
    output) keys every block hashed after it that reaches it; blocks before it stay shared, and a
    forced release inside the prompt still wins when it is earlier."""
    kv, _ = vllm_core
    prefix_cache.install()
    tokens = list(range(200, 224))
    plain = kv.block_hashes(request(tokens))
    marked = request(tokens)
    prefix_cache.mark_release(marked, 9)
    hashed = kv.block_hashes(marked)
    assert hashed[:2] == plain[:2] and all(a != b for a, b in zip(hashed[2:], plain[2:]))
    assert prefix_cache.release_position(marked) == 9
    both = request(tokens, release=5)
    prefix_cache.mark_release(both, 9)
    assert prefix_cache.release_position(both) == 5
    assert kv.block_hashes(both)[1] != hashed[1]  # keyed from the forced position on


class _Manager:
    """A KV-cache manager whose lookups find ``cached`` tokens (vLLM 0.33.0 returns the blocks, the
    token count and a boundary, ``v1/core/kv_cache_manager.py:266-268``)."""

    def __init__(self, cached: int) -> None:
        self.cached = cached

    def get_computed_blocks(self, request, max_cache_hit_length=None):
        return ["block"] * (self.cached // BLOCK), self.cached, 0


def test_hit_counter_counts_hits_and_hits_past_the_release(monkeypatch):
    monkeypatch.setattr(prefix_cache, "HITS", None)
    assert prefix_cache.hit_stats() is None
    warm, none = _Manager(12), _Manager(0)
    prefix_cache.count_hits(warm, BLOCK)
    prefix_cache.count_hits(none, BLOCK)
    assert warm.get_computed_blocks(request(range(16))) == (["block"] * 3, 12, 0)  # the result is vLLM's
    none.get_computed_blocks(request(range(16)))
    resumed = request(range(16))
    prefix_cache.mark_release(resumed, 6)  # a preempted request finding its own blocks [4,8) and [8,12)
    warm.get_computed_blocks(resumed)
    assert prefix_cache.hit_stats() == {"lookups": 3, "hit_tokens": 24, "hit_blocks": 6, "released_hit_blocks": 2}


def test_calibration_runtime_refuses_a_release_policy_when_prefixes_are_cached():
    rt = CalibrationRuntime(8, "cpu", cuda_graphs=False, prefix_caching=True)
    rt.configure(calibration_config(["a", "b"]))  # full LoRA
    rt.configure(calibration_config(["a", "b"], policy=StepTrim([None, None], 8)))
    with pytest.raises(ValueError, match="release policy.*prefix_caching=false"):
        rt.configure(calibration_config(["a", "b"], policy=StepTrim([ProfiledPolicy(2), None], 8)))
    plain = CalibrationRuntime(8, "cpu", cuda_graphs=False)
    plain.configure(calibration_config(["a", "b"], policy=StepTrim([ProfiledPolicy(2), None], 8)))


def test_vllm_0_34_hashes_a_released_requests_prompt_itself(vllm_core):
    """0.34's Rust frontend may send prompt block hashes made with vLLM's keys only; the engine core
    keeps them (v1/engine/core.py:1287) unless they are dropped, as they are for a forced release."""
    kv, _ = vllm_core
    frontend = kv.generate_block_hash_extra_keys  # what the frontend's hasher knows: vLLM's own keys
    config = SimpleNamespace(hash_block_size=BLOCK, num_lookahead_tokens=0)
    core = sys.modules["vllm.v1.engine.core"]
    versions.seam("0.34.0").install_prefix_cache()
    wrapped = core.frontend_block_hashes
    versions.seam("0.34.0").install_prefix_cache()  # idempotent: wrapped once
    assert prefix_cache.installed() and core.frontend_block_hashes is wrapped is not frontend_block_hashes
    prompt = list(range(100, 120))  # 5 full blocks
    for release in (None, 13):
        req = request(prompt, release=release)
        kv.generate_block_hash_extra_keys, keyed = frontend, kv.generate_block_hash_extra_keys
        req.prompt_token_ids, req.block_hashes = prompt, kv.block_hashes(req)  # the frontend's, in its process
        kv.generate_block_hash_extra_keys = keyed
        hashes = list(core.frontend_block_hashes(req, config) or [])
        hashes += kv.block_hashes(req, hashes)  # Request(...): the engine hashes what the frontend did not
        assert hashes == kv.block_hashes(req)  # every block has the key where the engine would put it
        assert (hashes == req.block_hashes) is (release is None)  # a frontend's hashes are kept otherwise
    assert not core.frontend_block_hashes(SimpleNamespace(block_hashes=None, sampling_params=None), config)


@pytest.mark.parametrize("version, runner", [("0.26.0", "model_runner"), ("0.34.0", "model_runner_v2")])
def test_the_plugin_installs_the_keys_in_calibration_mode(vllm_core, monkeypatch, version, runner):
    kv, _ = vllm_core
    sys.modules["vllm"].__version__ = version
    monkeypatch.setitem(sys.modules, f"serve_bridge.vllm.{runner}", SimpleNamespace(install=lambda: None))
    monkeypatch.setattr(sys.modules["serve_bridge.vllm"], runner, sys.modules[f"serve_bridge.vllm.{runner}"],
                        raising=False)
    fake_lora_managers(monkeypatch)
    for name in ("LORAZOR_BUNDLE", "LORAZOR_GRIDTRIM", "VLLM_USE_V2_MODEL_RUNNER"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LORAZOR_CALIBRATION", "1")
    for name, value in versions.runner_environment(version).items():  # what engines LoRazor starts set
        monkeypatch.setenv(name, value)
    importlib.import_module("serve_bridge.vllm.plugin").register()
    assert prefix_cache.installed()
    keyed_frontend = getattr(sys.modules["vllm.v1.engine.core"].frontend_block_hashes, "lorazor_keyed", False)
    assert keyed_frontend is (version == "0.34.0")


def to_event_extra_keys(extra_keys):
    """vLLM 0.33.0's ``to_event_extra_keys`` (``v1/core/kv_cache_utils.py:678-704``), restated: one
    untagged entry per block, a multimodal key without its tag, any other key as its second element."""
    if not extra_keys:
        return None
    return [None if keys is None else tuple(key[1:] if key[0] == "mm" else key[1] for key in keys)
            for keys in extra_keys] or None


def test_kv_events_of_released_blocks_stay_plain_data(vllm_core):
    """KV-cache events publish each block's extra keys untagged: a block past a release keeps its
    LoRA name first and adds its release position, a plain int, so the event stays one entry per
    block of JSON-able values for external indexers."""
    kv, pool = vllm_core
    prefix_cache.install()

    def tagged(request, start, end, mm):  # 0.33.0's keys are tagged: ("lora", name, path)
        return (("lora", request.lora_request.lora_name, "/p"),), mm

    req = request(range(12))
    prefix_cache.mark_release(req, 6)
    keys = [prefix_cache.released_keys(tagged(req, s, s + BLOCK, 0)[0], req, s + BLOCK) for s in (0, 4, 8)]
    events = to_event_extra_keys(keys)
    assert events == [("a",), ("a", 6), ("a", 6)] and json.loads(json.dumps(events)) == [["a"], ["a", 6], ["a", 6]]
    assert kv.generate_block_hash_extra_keys is pool.generate_block_hash_extra_keys  # events use the same keys
