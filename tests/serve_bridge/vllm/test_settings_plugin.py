"""Activation from the environment, the version / runner / engine gates, and the entry point."""
from __future__ import annotations

import importlib
import importlib.util
import sys
import tomllib
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from serve_bridge.gridtrim import COMPILED_LAUNCHES, DEFAULT_LAUNCH
from serve_bridge.vllm import compile_cache, lora_manager, plugin, versions
from serve_bridge.vllm.settings import (BridgeError, BridgeSettings, engine_fixes, gridtrim_from_env,
                                        gridtrim_launch_from_env, parse_adapters,
                                        refuse)
from tests.serve_bridge.vllm.stubs import fake_lora_managers

ROOT = Path(__file__).resolve().parents[3]


def test_inactive_without_bundle():
    assert BridgeSettings.from_env({}) is None
    assert BridgeSettings.from_env({"LORAZOR_BUNDLE": "  "}) is None


def test_settings_from_env():
    s = BridgeSettings.from_env({"LORAZOR_BUNDLE": "~/b", "LORAZOR_ADAPTERS": " sql=/a/sql , math=/a/math,",
                                 "LORAZOR_LOG_INTERVAL_S": "0"})
    assert s.bundle == Path("~/b").expanduser()
    assert s.adapters == {"sql": "/a/sql", "math": "/a/math"} and s.log_interval_s == 0.0
    assert BridgeSettings.from_env({"LORAZOR_BUNDLE": "/b"}).log_interval_s == 60.0


@pytest.mark.parametrize("text,match", [("sql", "not name=path"), ("=/p", "not name=path"),
                                        ("a=/x,a=/y", "listed twice")])
def test_bad_adapter_list(text, match):
    with pytest.raises(BridgeError, match=match):
        parse_adapters(text)


@pytest.mark.parametrize("value", ["-1", "soon", "nan"])
def test_bad_log_interval(value):
    with pytest.raises(BridgeError, match="LORAZOR_LOG_INTERVAL_S"):
        BridgeSettings.from_env({"LORAZOR_BUNDLE": "/b", "LORAZOR_LOG_INTERVAL_S": value})


def test_version_gate_picks_one_seam_per_supported_vllm():
    for version, runner, v1 in (("0.34.0", "V2", False), ("0.33.0", "V2", True), ("0.26.0", "V1", True)):
        seam = versions.seam(version)
        assert (seam.VERSION, seam.RUNNER, seam.V1_RUNNER) == (version, runner, v1)
        assert versions.has_v1_runner(version) is v1
    assert versions.SUPPORTED == ("0.34.0", "0.33.0", "0.26.0")  # newest first
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["vllm"]
    assert extra == [f"vllm=={versions.EXTRA}"] and versions.EXTRA in versions.SUPPORTED  # the newest maintained
    for other in ("0.26.1", "0.32.0", "0.34.1", "0.35.0"):
        with pytest.raises(BridgeError) as err:
            versions.seam(other)
        message = str(err.value)
        assert "\n" not in message and f"vLLM {other} is installed" in message
        assert message.index("vllm==0.34.0 (pip install 'lorazor[vllm]')") \
            < message.index("vllm==0.33.0 (pip install lorazor 'vllm==0.33.0')") < message.index("vllm==0.26.0")
    assert not versions.has_v1_runner("0.35.0")


def test_runner_gate_per_vllm_line():
    v26, v33, v34 = versions.seam("0.26.0"), versions.seam("0.33.0"), versions.seam("0.34.0")
    v26.require_runner({"VLLM_USE_V2_MODEL_RUNNER": "0"})
    for env in ({}, {"VLLM_USE_V2_MODEL_RUNNER": "1"}):
        with pytest.raises(BridgeError, match="0.26.0 runs inside vLLM's V1 GPU model runner; set VLLM_USE_V2_MODEL_RUNNER=0"):
            v26.require_runner(env)
    for env in ({}, {"VLLM_USE_V2_MODEL_RUNNER": "1"}):
        v33.require_runner(env)
    for value in ("0", "false"):
        with pytest.raises(BridgeError, match="0.33.0 runs inside vLLM's V2 GPU model runner.*unset VLLM_USE_V2"):
            v33.require_runner({"VLLM_USE_V2_MODEL_RUNNER": value})
    for env in ({}, {"VLLM_USE_V2_MODEL_RUNNER": "1"}):
        v34.require_runner(env)  # the V2 runner is 0.34's only one; vLLM itself refuses any other value


def test_engines_lorazor_starts_set_the_runner_of_their_line_and_never_v1_on_0_34():
    assert versions.runner_environment("0.26.0") == {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    assert versions.runner_environment("0.33.0") == {"VLLM_USE_V2_MODEL_RUNNER": "1"}
    assert versions.runner_environment("0.34.0") == {}  # 0 stops vLLM 0.34 (platforms/interface.py:1481)
    assert versions.runner_environment("0.35.0") == {}  # refused by the plugin, in one line
    versions.runner_environment("0.34.0")["VLLM_USE_V2_MODEL_RUNNER"] = "0"  # a copy: the seam keeps its own
    assert versions.seam("0.34.0").RUNNER_ENV == {}


def _config(**over):
    cfg = dict(lora_config=object(), model_config=SimpleNamespace(runner_type="generate"), cache_config=SimpleNamespace(enable_prefix_caching=False),
               scheduler_config=SimpleNamespace(async_scheduling=False), speculative_config=None,
               parallel_config=SimpleNamespace(pipeline_parallel_size=1))
    cfg.update(over)
    return SimpleNamespace(**cfg)


def test_engine_gate_accepts_supported_settings():
    assert engine_fixes(_config()) == []


def _refused(fixes: list[str], match: str) -> None:
    with pytest.raises(BridgeError, match=match) as err:
        refuse(fixes)
    assert "\n" not in str(err.value)  # one line


@pytest.mark.parametrize("over,match", [
    ({"lora_config": None}, "enable LoRA"),
    ({"model_config": SimpleNamespace(runner_type="pooling")}, "generative model.*'pooling'"),
    ({"cache_config": SimpleNamespace(enable_prefix_caching=True)}, "disable prefix caching"),
    ({"scheduler_config": SimpleNamespace(async_scheduling=True)}, "disable async scheduling"),
    ({"speculative_config": object()}, "disable speculative decoding"),
    ({"parallel_config": SimpleNamespace(pipeline_parallel_size=2)}, "pipeline_parallel_size=1"),
])
def test_engine_gate_refuses(over, match):
    _refused(engine_fixes(_config(**over)), match)


def test_async_scheduling_and_prefix_caching_where_allowed():
    """vLLM's defaults (async scheduling, prefix caching) pass where the runner plans ahead and
    released blocks are keyed; elsewhere they are refused."""
    defaults = _config(scheduler_config=SimpleNamespace(async_scheduling=True),
                       cache_config=SimpleNamespace(enable_prefix_caching=True))
    assert engine_fixes(defaults, released_blocks_keyed=True, async_allowed=True) == []
    _refused(engine_fixes(defaults, released_blocks_keyed=True), "disable async scheduling")
    _refused(engine_fixes(defaults, async_allowed=True), "disable prefix caching")


def test_engine_gate_lists_every_fix_at_once():
    fixes = engine_fixes(_config(cache_config=SimpleNamespace(enable_prefix_caching=True),
                                 scheduler_config=SimpleNamespace(async_scheduling=True), speculative_config=object(),
                                 parallel_config=SimpleNamespace(pipeline_parallel_size=2)))
    _refused(fixes, "prefix caching.*async scheduling.*speculative decoding.*pipeline_parallel_size=1")


def test_entry_point_names_register():
    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["vllm.general_plugins"]
    module, _, attr = eps["lorazor"].partition(":")
    assert getattr(importlib.import_module(module), attr) is plugin.register


def test_a_checkout_dist_info_provides_the_entry_point(tmp_path):
    """What scripts/env.sh and tests/gpu/conftest.py put on PYTHONPATH where LoRazor is not installed."""
    from importlib.metadata import distributions

    spec = importlib.util.spec_from_file_location("plugin_dist_info", ROOT / "scripts" / "plugin_dist_info.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    found = [ep for dist in distributions(path=[str(module.write_dist_info(tmp_path))])
             for ep in dist.entry_points if ep.group == "vllm.general_plugins"]
    assert [(ep.name, ep.value) for ep in found] == [("lorazor", "serve_bridge.vllm.plugin:register")]


@pytest.mark.parametrize("gridtrim", [None, "", "0", "off", " OFF "])
def test_register_is_a_no_op_without_bundle_or_gridtrim(monkeypatch, gridtrim):
    monkeypatch.delenv("LORAZOR_BUNDLE", raising=False)
    if gridtrim is None:
        monkeypatch.delenv("LORAZOR_GRIDTRIM", raising=False)
    else:
        monkeypatch.setenv("LORAZOR_GRIDTRIM", gridtrim)
    monkeypatch.setitem(sys.modules, "vllm", None)  # importing vllm would fail
    plugin.register()


@pytest.mark.parametrize("value,on", [("1", True), ("on", True), (" On ", True), ("0", False), ("off", False),
                                      ("", False), ("  ", False)])
def test_gridtrim_switch(value, on):
    assert gridtrim_from_env({"LORAZOR_GRIDTRIM": value}) is on
    assert gridtrim_from_env({}) is False


@pytest.mark.parametrize("value", ["yes", "true", "2", "gridtrim"])
def test_gridtrim_switch_refuses_other_values(value, monkeypatch):
    with pytest.raises(BridgeError, match=r"LORAZOR_GRIDTRIM=.*use 1 or on.*0, off or unset"):
        gridtrim_from_env({"LORAZOR_GRIDTRIM": value})
    monkeypatch.delenv("LORAZOR_BUNDLE", raising=False)
    monkeypatch.setenv("LORAZOR_GRIDTRIM", value)
    monkeypatch.setitem(sys.modules, "vllm", None)  # refused before vLLM is imported
    with pytest.raises(BridgeError, match="LORAZOR_GRIDTRIM"):
        plugin.register()


class _Platform:
    """Stands in for vLLM's platform classes: a classmethod names the punica wrapper."""

    cuda = True

    def is_cuda(self):
        return self.cuda

    @classmethod
    def get_punica_wrapper(cls):
        return "vllm.lora.punica_wrapper.punica_gpu.PunicaWrapperGPU"


RUNNER_MODULE = {"0.26.0": "model_runner", "0.33.0": "model_runner_v2", "0.34.0": "model_runner_v2"}  # StepTrim's


def _fake_vllm(monkeypatch, platform_cls, version="0.26.0"):
    """vLLM ``version`` faked: its platform, LoRA managers and, where the line ships one, the V1
    runner's module; the StepTrim runner modules must not load."""
    fake = ModuleType("vllm")
    fake.__version__ = version
    platforms = ModuleType("vllm.platforms")
    platforms.current_platform = platform_cls()
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    compilation, caching = ModuleType("vllm.compilation"), ModuleType("vllm.compilation.caching")
    # vLLM's own factors: its environment's and its config's hashes (compilation/caching.py)
    caching.aot_compile_hash_factors = lambda vllm_config: ["env-hash", f"config-hash:{vllm_config}"]
    compilation.caching = caching
    monkeypatch.setitem(sys.modules, "vllm.compilation", compilation)
    monkeypatch.setitem(sys.modules, "vllm.compilation.caching", caching)
    if versions.has_v1_runner(version):
        v1 = ModuleType("vllm.v1.worker.gpu_model_runner")
        v1.GPUModelRunner = type("GPUModelRunner", (), {})
        for name, module in (("vllm.v1", ModuleType("vllm.v1")), ("vllm.v1.worker", ModuleType("vllm.v1.worker")),
                             ("vllm.v1.worker.gpu_model_runner", v1)):
            monkeypatch.setitem(sys.modules, name, module)
    fake_lora_managers(monkeypatch)
    for module in RUNNER_MODULE.values():  # the StepTrim runners must not load
        monkeypatch.setitem(sys.modules, f"serve_bridge.vllm.{module}", None)
    monkeypatch.delenv("LORAZOR_BUNDLE", raising=False)
    monkeypatch.setenv("LORAZOR_GRIDTRIM", "1")
    if version == "0.26.0":
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    else:
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    return platforms.current_platform


@pytest.mark.parametrize("version", ["0.26.0", "0.33.0", "0.34.0"])
def test_register_gridtrim_selects_the_wrapper(monkeypatch, version):
    cuda = type("CudaPlatform", (_Platform,), {})
    platform = _fake_vllm(monkeypatch, cuda, version)
    plugin.register()
    assert platform.get_punica_wrapper() == cuda.get_punica_wrapper() == plugin.GRIDTRIM_WRAPPER
    worker_manager = sys.modules["vllm.lora.worker_manager"].LRUCacheWorkerLoRAManager
    assert worker_manager._apply_adapters is lora_manager.apply_adapters
    assert worker_manager.lorazor_sync_allowed is versions.seam(version).sync_allowed
    assert sys.modules["vllm.lora.model_manager"].LoRAModelManager.activate_adapter is lora_manager.activate_adapter
    plugin.register()  # idempotent
    assert platform.get_punica_wrapper() == plugin.GRIDTRIM_WRAPPER
    assert _Platform.get_punica_wrapper() != plugin.GRIDTRIM_WRAPPER  # only the live platform's class
    # vLLM's compile-cache key gains the wrapper, once
    factors = sys.modules["vllm.compilation.caching"].aot_compile_hash_factors("cfg")
    assert factors == ["env-hash", "config-hash:cfg", compile_cache.factor(plugin.GRIDTRIM_WRAPPER, DEFAULT_LAUNCH)]


@pytest.mark.parametrize("value, launch", [("", DEFAULT_LAUNCH), ("ops", "ops"), (" Inductor ", "inductor")])
def test_gridtrim_launch_setting(value, launch):
    assert gridtrim_launch_from_env({"LORAZOR_GRIDTRIM_LAUNCH": value}) == launch
    assert gridtrim_launch_from_env({}) == DEFAULT_LAUNCH


def test_gridtrim_launch_setting_refuses_other_values():
    choices = " or ".join(COMPILED_LAUNCHES)
    with pytest.raises(BridgeError, match=rf"LORAZOR_GRIDTRIM_LAUNCH='triton': use {choices} .*or unset it\.$"):
        gridtrim_launch_from_env({"LORAZOR_GRIDTRIM_LAUNCH": "triton"})


def test_register_keys_the_compile_cache_by_the_launch(monkeypatch):
    """An engine whose compiled forward launches through Inductor never loads one compiled with the
    ops (nor the reverse); a bad value stops start-up in one line before anything is installed."""
    platform = _fake_vllm(monkeypatch, type("CudaPlatform", (_Platform,), {}), "0.33.0")
    monkeypatch.setenv("LORAZOR_GRIDTRIM_LAUNCH", "inductor")
    plugin.register()
    factors = sys.modules["vllm.compilation.caching"].aot_compile_hash_factors("cfg")
    assert factors == ["env-hash", "config-hash:cfg", compile_cache.factor(plugin.GRIDTRIM_WRAPPER, "inductor")]
    ops = compile_cache.factor(plugin.GRIDTRIM_WRAPPER, "ops")
    assert compile_cache.factor(plugin.GRIDTRIM_WRAPPER, "inductor") != ops
    monkeypatch.setenv("LORAZOR_GRIDTRIM_LAUNCH", "ops")
    plugin.register()  # another launch replaces the factor, never stacks a second one
    factors = sys.modules["vllm.compilation.caching"].aot_compile_hash_factors("cfg")
    assert factors == ["env-hash", "config-hash:cfg", compile_cache.factor(plugin.GRIDTRIM_WRAPPER, "ops")]
    monkeypatch.setenv("LORAZOR_GRIDTRIM_LAUNCH", "fast")
    with pytest.raises(BridgeError, match="LORAZOR_GRIDTRIM_LAUNCH='fast'"):
        plugin.register()
    assert platform.get_punica_wrapper() == plugin.GRIDTRIM_WRAPPER


def test_compile_cache_factor_names_the_wrapper_and_its_ops(monkeypatch):
    """The factor changes with the wrapper and with any op schema, so a stock engine's compiled model
    (or one of an older GridTrim) is never loaded by a GridTrim engine, nor GridTrim's by stock."""
    from serve_bridge import gridtrim

    factor = compile_cache.factor(plugin.GRIDTRIM_WRAPPER, "ops")
    assert plugin.GRIDTRIM_WRAPPER in factor
    assert compile_cache.factor("vllm.lora.punica_wrapper.punica_gpu.PunicaWrapperGPU", "ops") != factor
    name = sorted(gridtrim.OP_SCHEMAS)[0]
    monkeypatch.setitem(gridtrim.OP_SCHEMAS, name, gridtrim.OP_SCHEMAS[name].replace("-> ()", ", int extra) -> ()"))
    assert compile_cache.factor(plugin.GRIDTRIM_WRAPPER, "ops") != factor


def test_register_gridtrim_refuses_non_cuda(monkeypatch):
    cpu = type("CpuPlatform", (_Platform,), {"cuda": False})
    platform = _fake_vllm(monkeypatch, cpu)
    with pytest.raises(BridgeError, match="NVIDIA GPUs only.*CpuPlatform.*unset LORAZOR_GRIDTRIM"):
        plugin.register()
    assert platform.get_punica_wrapper() != plugin.GRIDTRIM_WRAPPER
    assert sys.modules["vllm.compilation.caching"].aot_compile_hash_factors("cfg") == ["env-hash", "config-hash:cfg"]


@pytest.mark.parametrize("version, v2_runner, message", [
    ("0.26.0", None, "0.26.0 runs inside vLLM's V1 GPU model runner.*on through LORAZOR_GRIDTRIM"),
    ("0.33.0", "0", "0.33.0 runs inside vLLM's V2 GPU model runner.*on through LORAZOR_GRIDTRIM"),
])
def test_register_gridtrim_refuses_the_other_runner(monkeypatch, version, v2_runner, message):
    _fake_vllm(monkeypatch, type("CudaPlatform", (_Platform,), {}), version)
    if v2_runner is None:
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    else:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", v2_runner)
    with pytest.raises(BridgeError, match=message):
        plugin.register()


@pytest.mark.parametrize("version, v2_runner, message", [
    ("0.27.0", "0", "vLLM 0.27.0 is installed"),
    ("0.35.0", None, "vLLM 0.35.0 is installed"),
    ("0.26.0", None, "V1 GPU model runner"),
    ("0.33.0", "0", "V2 GPU model runner"),
])
def test_register_refuses_an_unsupported_vllm(monkeypatch, version, v2_runner, message):
    """Another vLLM version, or the other runner than the line's, is refused."""
    fake = ModuleType("vllm")
    fake.__version__ = version
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setenv("LORAZOR_BUNDLE", "/some/bundle")
    if v2_runner is None:
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    else:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", v2_runner)
    with pytest.raises(BridgeError, match=message):
        plugin.register()


@pytest.mark.parametrize("version", ["0.26.0", "0.33.0", "0.34.0"])
@pytest.mark.parametrize("slots", [None, "0"])
def test_register_installs_the_release_scheduler_with_a_bundle(monkeypatch, slots, version):
    _fake_vllm(monkeypatch, type("CudaPlatform", (_Platform,), {}), version)
    monkeypatch.delenv("LORAZOR_GRIDTRIM")
    monkeypatch.setenv("LORAZOR_BUNDLE", "/some/bundle")
    if slots is None:
        monkeypatch.delenv("LORAZOR_SLOTS", raising=False)
    else:
        monkeypatch.setenv("LORAZOR_SLOTS", slots)
    calls = []
    for name in (*RUNNER_MODULE.values(), "scheduler", "prefix_cache"):
        stub = ModuleType(f"serve_bridge.vllm.{name}")
        stub.install = lambda name=name: calls.append(name)
        monkeypatch.setitem(sys.modules, f"serve_bridge.vllm.{name}", stub)
        monkeypatch.setattr(sys.modules["serve_bridge.vllm"], name, stub, raising=False)
    if version == "0.34.0":  # its seam also wraps the engine core's frontend_block_hashes
        core = ModuleType("vllm.v1.engine.core")
        core.frontend_block_hashes = lambda request, config: None
        for name, module in (("vllm.v1", ModuleType("vllm.v1")), ("vllm.v1.engine", ModuleType("vllm.v1.engine")),
                             ("vllm.v1.engine.core", core)):
            monkeypatch.setitem(sys.modules, name, module)
        sys.modules["vllm.v1.engine"].core = core
    plugin.register()
    runner = RUNNER_MODULE[version]
    assert calls == [runner, "scheduler", "prefix_cache"]  # LORAZOR_SLOTS=0 only stops hand-back
    if version == "0.33.0":  # vLLM falls back to V1 for features V2 lacks; 0.34 has no V1 (and nothing is imported)
        assert sys.modules["vllm.v1.worker.gpu_model_runner"].GPUModelRunner.lorazor_refused
    # StepTrim alone leaves the compiled model stock's, and so vLLM's compile-cache key
    assert sys.modules["vllm.compilation.caching"].aot_compile_hash_factors("cfg") == ["env-hash", "config-hash:cfg"]
