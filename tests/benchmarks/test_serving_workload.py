"""The throughput benchmark's workload, release schedule and files, on CPU (benchmarks/serving/bench.py)."""
from __future__ import annotations

import argparse
import json
import random
import time
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
from safetensors import safe_open

from benchmarks.serving import bench, vllm_settings
from benchmarks.serving.bench_table import (HEADER, LATENCY_HEADER, MODE_LABEL, SLOT_HEADER, format_row, graphs_note,
                                            mode_label, render, run_note, slot_table)
from benchmarks.serving.bench_workload import (N_REQUESTS, arrival_times, choose_k, hot_adapter_count, make_workload,
                                               profiled_ks, workload_for)
from benchmarks.serving.host_memory import adapter_bytes, host_bytes_needed, host_memory_available, host_memory_problem
from benchmarks.serving.synthetic import LLAMA32_3B, MISTRAL_7B, lora_targets
from benchmarks.serving.vllm_settings import VllmSettings
from serve_bridge.bundle import adapter_fingerprint, load_bundle
from serve_bridge.steptrim import ProfiledPolicy, skip_fraction
from tests.serve_bridge.vllm.test_scheduler import sched  # noqa: F401 - fixture: the scheduler over a vLLM stand-in


@pytest.fixture(scope="module")
def workloads():
    return {(n, skewed): make_workload(n, skewed=skewed) for n in (4, 128) for skewed in (False, True)}


def test_seeded(workloads):
    again = make_workload(128)
    assert again == workloads[(128, False)]
    other = make_workload(128, seed=1)
    assert other.prompt != again.prompt and other.max_tokens != again.max_tokens and other.adapter != again.adapter


@pytest.mark.parametrize("n,skewed", [(4, False), (4, True), (128, False), (128, True)])
def test_lengths_in_range(workloads, n, skewed):
    wl = workloads[(n, skewed)]
    assert len(wl.prompt) == len(wl.max_tokens) == len(wl.adapter) == N_REQUESTS == 2048
    assert min(map(len, wl.prompt)) >= 100 and max(map(len, wl.prompt)) <= 300
    assert min(wl.max_tokens) >= 20 and max(wl.max_tokens) <= 100
    assert min(min(p) for p in wl.prompt) >= 3 and max(max(p) for p in wl.prompt) < 128256
    assert set(wl.adapter) <= set(range(n)) and len(wl.k) == n
    # both ends of the ranges occur, so the bounds are inclusive as in the paper's set-up
    assert {min(map(len, wl.prompt)), max(map(len, wl.prompt))} == {100, 300}
    assert {min(wl.max_tokens), max(wl.max_tokens)} == {20, 100}


def test_same_requests_for_every_adapter_count_and_traffic(workloads):
    ref = workloads[(128, False)]
    for wl in workloads.values():
        assert wl.prompt == ref.prompt and wl.max_tokens == ref.max_tokens


@pytest.mark.parametrize("n", [4, 128])
def test_uniform_traffic(workloads, n):
    counts = Counter(workloads[(n, False)].adapter)
    assert len(counts) == n  # every adapter is served
    expected = 2048 / n
    assert max(counts.values()) < expected + 5 * expected ** 0.5 and min(counts.values()) > expected - 5 * expected ** 0.5


@pytest.mark.parametrize("n,hot", [(4, 1), (128, 26)])
def test_skewed_share(workloads, n, hot):
    assert hot_adapter_count(n) == hot
    assert abs(hot / n - 0.2) <= 0.05  # ≈ 20% of the adapters (1 of 4 is the nearest)
    adapter = workloads[(n, True)].adapter
    share = sum(a < hot for a in adapter) / len(adapter)
    assert abs(share - 0.8) < 0.03  # ≈ 80% of the requests
    assert len(set(adapter)) == n  # the cold adapters still get traffic


def test_skewed_edge_cases():
    assert hot_adapter_count(1) == 1 and hot_adapter_count(2) == 1
    assert make_workload(1, 50, skewed=True).adapter == [0] * 50
    with pytest.raises(ValueError):
        make_workload(0, 10)


@pytest.mark.parametrize("n,skewed", [(4, False), (4, True), (128, False), (128, True)])
def test_profiled_k_skips_half(workloads, n, skewed):
    wl = workloads[(n, skewed)]
    assert wl.planned_skip == skip_fraction(wl.max_tokens, wl.releases())
    assert abs(wl.planned_skip - 0.5) <= 0.05
    # per adapter too: its k is chosen on its own requests' lengths
    for a in range(n):
        lengths = [m for m, b in zip(wl.max_tokens, wl.adapter) if b == a]
        if len(lengths) >= 8:
            assert abs(skip_fraction(lengths, [wl.k[a]] * len(lengths)) - 0.5) <= 0.05


def test_choose_k_is_the_nearest():
    rnd = random.Random(0)
    for _ in range(200):
        lengths = [rnd.randint(1, 60) for _ in range(rnd.randint(1, 12))]
        target = rnd.random()
        brute = min(range(max(lengths)), key=lambda k: (abs(skip_fraction(lengths, [k] * len(lengths)) - target), k))
        assert choose_k(lengths, target) == brute
    assert choose_k([]) == 0 and choose_k([1, 1]) == 0
    assert profiled_ks([0, 0], [21, 21], 3) == [10, 10, 10]  # adapters without requests: k of all lengths


def test_llama32_3b_config_and_targets():
    cfg = LLAMA32_3B
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["intermediate_size"], cfg["vocab_size"]) == (3072, 28, 24, 8, 8192, 128256)
    assert cfg["rope_theta"] == 500000.0 and cfg["rope_scaling"]["rope_type"] == "llama3"
    assert cfg["max_position_embeddings"] == 131072 and cfg["tie_word_embeddings"] is True
    t = lora_targets(cfg)
    assert t["q_proj"][1:] == (3072, 3072) and t["k_proj"][1:] == (3072, 1024) and t["o_proj"][1:] == (3072, 3072)
    assert t["gate_proj"][1:] == (3072, 8192) and t["down_proj"][1:] == (8192, 3072)


def test_config_loads_with_llama3_rope(tmp_path):
    transformers = pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps(LLAMA32_3B))
    cfg = transformers.AutoConfig.from_pretrained(tmp_path)
    rope = cfg.rope_parameters
    assert rope["rope_type"] == "llama3" and rope["factor"] == 32.0 and rope["rope_theta"] == 500000.0


def test_engine_options_are_vllms_defaults_with_the_workloads_limits():
    """The main configuration: no option turns a vLLM default off (torch.compile and its CUDA-graph
    mode, async scheduling, prefix caching); the workload's batch limits and adapters."""
    opts = bench.engine_options(128)
    assert opts["max_loras"] == 128 and opts["max_lora_rank"] == 8 and opts["max_cpu_loras"] == 128
    assert opts["max_num_seqs"] == 256 and opts["max_num_batched_tokens"] == 2048
    assert not {"enable_prefix_caching", "async_scheduling", "compilation_config"} & set(opts)
    assert "specialize_active_lora" not in opts and opts["load_format"] == "dummy"  # vLLM's default: off
    assert opts["skip_tokenizer_init"] is True
    assert "lora_target_modules" not in opts and "tensor_parallel_size" not in opts  # vLLM's defaults


def test_second_line_settings_and_their_labels():
    """Every mode runs a table's settings; a row names what they change from vLLM's defaults, and its
    ratio is to the stock row of the same settings."""
    sync_full = VllmSettings("full", async_scheduling=False, prefix_caching=False)
    for mode in bench.MODES:
        opts = bench.engine_options(128, mode=mode, settings=sync_full)
        assert opts["async_scheduling"] is False and opts["enable_prefix_caching"] is False
        assert opts["compilation_config"] == {"mode": 0, "cudagraph_mode": "FULL",
                                              "cudagraph_capture_sizes": vllm_settings.CAPTURE_SIZES}
    sized = bench.engine_options(128, settings=VllmSettings(capture_sizes=[1, 8]))
    assert sized["compilation_config"] == {"cudagraph_capture_sizes": [1, 8]}  # vLLM's own modes
    decode = bench.engine_options(128, settings=VllmSettings("decode"))["compilation_config"]
    assert decode["mode"] == 0 and decode["cudagraph_mode"] == "FULL_DECODE_ONLY"
    row = {"mode": "stock", "adapters": 4, "skewed": False, "req_per_s": 10.0, "output_tok_per_s": 600.0,
           "counters": None, "settings": sync_full.as_dict()}
    assert format_row(row, row) == ("| 4 | uniform | stock [full CUDA graphs, sync, prefix caching off] | 10.0 | "
                                          "600 | — | 1.00 |")
    assert mode_label(row | {"settings": VllmSettings().as_dict()}) == "stock"
    tuned = VllmSettings(specialize_active_lora=True).as_dict()
    assert mode_label(row | {"settings": tuned}) == "stock [adapter-count graphs for vLLM's kernels]"
    both = row | {"mode": "both", "req_per_s": 30.0}
    table = render([], [row, row | {"settings": VllmSettings().as_dict(), "req_per_s": 20.0},
                              both | {"settings": VllmSettings().as_dict()}], [])
    assert "| 4 | uniform | steptrim + gridtrim (release, our LoRA kernels) | 30.0 | 600 | — | 1.50 |" in table
    assert [bench.expected_scheduler(bundle, asy) for bundle, asy in ((True, False), (True, True), (False, True),
                                                                (False, False))] == [
        "ReleaseScheduler", "ReleaseAsyncScheduler", "AsyncScheduler", "Scheduler"]


def test_settings_arguments_round_trip():
    ap = argparse.ArgumentParser()
    vllm_settings.add_arguments(ap)
    for settings in (VllmSettings(), VllmSettings("full", False, True, (1, 2048)), VllmSettings("decode", True, False),
                     VllmSettings(specialize_active_lora=True)):
        assert vllm_settings.from_arguments(ap.parse_args(settings.arguments())) == settings
    assert vllm_settings.from_arguments(ap.parse_args([])).defaults
    with pytest.raises(ValueError, match="graphs='eager'"):
        VllmSettings("eager")


def test_target_modules_and_tensor_parallel_apply_to_every_mode():
    mods = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    for mode in bench.MODES:
        opts = bench.engine_options(128, mode=mode, lora_target_modules=mods, tensor_parallel_size=2)
        assert opts.get("lora_target_modules") == (None if mode == "nolora" else mods)
        assert opts["tensor_parallel_size"] == 2


def test_adapters_and_bundle_on_a_tiny_model(tmp_path):
    """The adapters come from the GPU tests' writer; the bundle's fingerprints match them."""
    tiny = {**LLAMA32_3B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}
    fps = bench.write_model_and_adapters(tmp_path, 40, tiny)  # more than the GPU tests' own 32
    assert json.loads((tmp_path / "model" / "config.json").read_text()) == tiny
    assert fps == {bench.adapter_name(a): adapter_fingerprint(tmp_path / "adapters" / bench.adapter_name(a))
                   for a in range(40)}
    peft = json.loads((tmp_path / "adapters" / "a00" / "adapter_config.json").read_text())
    assert peft["r"] == 8 and set(peft["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                              "up_proj", "down_proj"}
    wl = make_workload(40, 256)
    bundle = load_bundle(bench.write_profiled_bundle(tmp_path / "b", wl, fps, tiny), expected_hidden_size=64,
                         known_adapters=list(fps))
    assert bundle.policies == {bench.adapter_name(a): ProfiledPolicy(wl.k[a]) for a in range(40)}
    assert {n: e.weights_sha256 for n, e in bundle.adapters.items()} == fps
    # 40 names over DISTINCT_WEIGHTS (32) files: a name past 32 shares its file's inode and bytes
    files = [tmp_path / "adapters" / bench.adapter_name(a) / "adapter_model.safetensors" for a in range(40)]
    assert len({f.stat().st_ino for f in files}) == bench.DISTINCT_WEIGHTS
    assert files[35].samefile(files[3]) and fps["a35"] == fps["a03"] and fps["a03"] != fps["a04"]


def test_adapter_bytes_are_the_adapter_files_tensors(tmp_path):
    tiny = {**LLAMA32_3B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}
    for rank in (4, 8):
        bench.write_model_and_adapters(tmp_path / str(rank), 1, tiny, rank)
        path = tmp_path / str(rank) / "adapters" / bench.adapter_name(0) / "adapter_model.safetensors"
        with safe_open(str(path), "pt") as f:
            stored = sum(f.get_tensor(k).nbytes for k in f.keys())
        assert adapter_bytes(tiny, rank) == stored
    assert adapter_bytes(LLAMA32_3B, 8) / 1e6 == pytest.approx(24.3, abs=0.1)  # the tables' adapters
    assert adapter_bytes(bench.MODELS["llama8b"], 16) / 1e6 == pytest.approx(83.9, abs=0.1)


def test_host_memory_preflight(tmp_path, monkeypatch, capsys):
    one = adapter_bytes(LLAMA32_3B, 8)
    assert host_bytes_needed(LLAMA32_3B, 8, 512, 32, None) == 2 * 512 * one
    assert host_bytes_needed(LLAMA32_3B, 8, 512, 32, 64) == 2 * 64 * one
    assert host_bytes_needed(LLAMA32_3B, 8, 16, 32, 8) == 2 * 32 * one  # vLLM raises it to max_loras
    assert host_memory_problem(10, 100) is None and host_memory_problem(10**12, None) is None
    assert "give fewer --adapters" in host_memory_problem(95, 100)
    available = host_memory_available()
    assert available is None or available > 0
    monkeypatch.setattr(bench, "host_memory_available", lambda: 4 * 2**30)
    rc = bench.main(["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--adapters", "512"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert f"{2 * 512 * one / 2**30:.1f} GiB" in err and "4.0 GiB is available" in err
    assert not (tmp_path / "work").exists() and not (tmp_path / "out").exists()  # refused before writing


def test_table_rows():
    stock = {"mode": "stock", "adapters": 128, "skewed": False, "req_per_s": 40.0, "output_tok_per_s": 2400.0,
             "counters": None}
    grid = {**stock, "mode": "gridtrim", "req_per_s": 50.0}
    trim = {**stock, "mode": "steptrim", "req_per_s": 42.0, "counters": {"realized_skip": 0.5001}}
    both = {**stock, "mode": "both", "req_per_s": 60.0, "output_tok_per_s": 3600.0,
            "counters": {"realized_skip": 0.4996}}
    text = render(["pre"], [stock, grid, trim, both, {"mode": "stock", "adapters": 4, "skewed": True,
                                                           "error": "timed out"},
                                  {"mode": "gridtrim", "adapters": 4, "skewed": True, "req_per_s": 9.0,
                                   "output_tok_per_s": 500.0, "counters": None}], ["note"])
    lines = text.splitlines()
    assert lines[2] == HEADER
    assert lines[4] == "| 128 | uniform | stock | 40.0 | 2400 | — | 1.00 |"
    assert lines[5] == "| 128 | uniform | gridtrim (our LoRA kernels, no release) | 50.0 | 2400 | — | 1.25 |"
    assert lines[6] == "| 128 | uniform | steptrim (release, vLLM's LoRA kernels) | 42.0 | 2400 | 0.500 | 1.05 |"
    assert lines[7] == ("| 128 | uniform | steptrim + gridtrim (release, our LoRA kernels) | 60.0 | 3600 | 0.500 | "
                        "1.50 |")
    assert lines[8].startswith("| 4 | skewed 80/20 | stock | timed out |")
    assert lines[9].endswith("| — |")  # no stock row to compare with
    assert lines[-1] == "note"
    assert "GridTrim not integrated" not in text


def test_passes_alternate_the_order_and_compare_within_a_pass():
    assert bench.schedule(["stock", "gridtrim", "both"], 3) == [
        (0, "stock"), (0, "gridtrim"), (0, "both"), (1, "both"), (1, "gridtrim"), (1, "stock"),
        (2, "stock"), (2, "gridtrim"), (2, "both")]
    assert bench.schedule(["both", "stock"], 1) == [(0, "both"), (0, "stock")]
    row = {"adapters": 128, "skewed": False, "output_tok_per_s": 1.0, "counters": None}
    rows = [{**row, "mode": m, "req_per_s": r, "pass": k}
            for k, m, r in ((0, "stock", 40.0), (0, "gridtrim", 60.0), (1, "gridtrim", 45.0), (1, "stock", 30.0))]
    lines = render(["pre"], rows, []).splitlines()
    assert lines[5].endswith("| 60.0 | 1 | — | 1.50 |")
    assert lines[6] == "| 128 | uniform, pass 2 | gridtrim (our LoRA kernels, no release) | 45.0 | 1 | — | 1.50 |"
    assert lines[7].startswith("| 128 | uniform, pass 2 | stock | 30.0 |")


def test_modes_and_their_engines():
    assert bench.DEFAULT_MODES == ("stock", "gridtrim", "steptrim", "both")
    assert bench.MODES == bench.DEFAULT_MODES + ("nolora", "stockfix")
    assert set(MODE_LABEL) == set(bench.MODES)
    # stockfix differs from stock only by the registry fix it installs in-process, not by options
    assert bench.engine_options(4, mode="stockfix") == bench.engine_options(4, mode="stock")
    # vLLM's defaults: the same options in every LoRA mode, adapter-count graphs off everywhere
    opts = [bench.engine_options(4, mode=m) for m in bench.MODES if m != "nolora"]
    assert all(o == opts[0] for o in opts) and "specialize_active_lora" not in opts[0]
    # a second line turns adapter-count graphs on only where vLLM's LoRA kernels run
    tuned = VllmSettings(specialize_active_lora=True)
    spec = {m: bench.engine_options(4, mode=m, settings=tuned).get("specialize_active_lora", False)
            for m in bench.MODES}
    assert spec == {"stock": True, "gridtrim": False, "steptrim": True, "both": False, "nolora": False,
                    "stockfix": True}
    assert spec == {m: bench.specializes(m, tuned) for m in bench.MODES}
    assert not any(bench.specializes(m, VllmSettings()) for m in bench.MODES)
    # nolora: the same engine without any LoRA option (vLLM's enable_lora defaults to False)
    lora_keys = {"enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras"}
    assert bench.engine_options(4, mode="nolora") == {k: v for k, v in opts[0].items() if k not in lora_keys}
    def found(mode: str, **change: str | None) -> dict[str, str | None]:
        return {"runner": bench.RUNNER[mode], "punica_wrapper": bench.WRAPPER[mode],
                "registry": bench.REGISTRY[mode]} | change

    assert found("nolora") == {"runner": "GPUModelRunner", "punica_wrapper": None, "registry": None}
    assert found("stock") == {"runner": "GPUModelRunner", "punica_wrapper": "PunicaWrapperGPU",
                              "registry": "per adapter"}
    assert found("stockfix") == found("stock", registry="once per step")
    assert found("gridtrim") == {"runner": "GPUModelRunner", "punica_wrapper": "GridTrimPunicaWrapper",
                                 "registry": "once per step"}
    assert found("steptrim") == found("stockfix", runner="LoRazorGPUModelRunner")
    assert found("both") == found("gridtrim", runner="LoRazorGPUModelRunner")
    for mode in bench.MODES:
        bench.check_engine_classes(mode, found(mode))
    for mode, wrong in (("nolora", found("nolora", punica_wrapper="PunicaWrapperGPU")),
                        ("stock", found("stock", punica_wrapper="GridTrimPunicaWrapper")),
                        ("stock", found("stock", registry="once per step")),
                        ("stockfix", found("stock")),
                        ("gridtrim", found("gridtrim", punica_wrapper="PunicaWrapperGPU")),
                        ("both", found("both", runner="GPUModelRunner"))):
        with pytest.raises(RuntimeError, match=f"mode {mode}: the engine runs"):
            bench.check_engine_classes(mode, wrong)


def test_engine_classes_follow_vllms_path():
    from types import SimpleNamespace

    from serve_bridge.vllm.lora_manager import apply_adapters

    class GridTrimPunicaWrapper:
        pass

    class LoRazorGPUModelRunner:
        lora_manager = SimpleNamespace(_adapter_manager=SimpleNamespace(
            punica_wrapper_mapping={"language_model": GridTrimPunicaWrapper()}))

    worker = SimpleNamespace(model_runner=LoRazorGPUModelRunner())
    assert bench.engine_classes(worker) == {"runner": "LoRazorGPUModelRunner",
                                            "punica_wrapper": "GridTrimPunicaWrapper", "registry": "per adapter"}

    class LRUCacheWorkerLoRAManager:  # as after serve_bridge.vllm.lora_manager.install()
        _apply_adapters = apply_adapters
        _adapter_manager = LoRazorGPUModelRunner.lora_manager._adapter_manager

    LoRazorGPUModelRunner.lora_manager = LRUCacheWorkerLoRAManager()
    assert bench.engine_classes(worker)["registry"] == "once per step"

    class GPUModelRunner:  # LoRA off: vLLM never sets lora_manager (lora_model_runner_mixin.py:70)
        pass

    assert bench.engine_classes(SimpleNamespace(model_runner=GPUModelRunner())) == {
        "runner": "GPUModelRunner", "punica_wrapper": None, "registry": None}


def test_mode_env(tmp_path):
    environ = {"PATH": "/bin", "LORAZOR_BUNDLE": "/stale", "LORAZOR_GRIDTRIM": "1", "LORAZOR_X": "y"}
    adapters = {"a00": tmp_path / "a00", "a01": tmp_path / "a01"}
    envs = {m: bench.mode_env(m, environ, tmp_path / "b", adapters) for m in bench.MODES}
    assert envs["stock"] == envs["nolora"] == envs["stockfix"] == {"PATH": "/bin"}
    assert envs["gridtrim"] == {"PATH": "/bin", "LORAZOR_GRIDTRIM": "1"}
    bundle = {"LORAZOR_BUNDLE": str(tmp_path / "b"), "LORAZOR_LOG_INTERVAL_S": "0",
              "LORAZOR_ADAPTERS": f"a00={tmp_path / 'a00'},a01={tmp_path / 'a01'}"}
    assert envs["steptrim"] == {"PATH": "/bin", **bundle}
    assert envs["both"] == {"PATH": "/bin", "LORAZOR_GRIDTRIM": "1", **bundle}
    from serve_bridge.vllm.settings import BridgeSettings, gridtrim_from_env

    for m, e in envs.items():  # what the plugin reads back in the engine's processes
        assert gridtrim_from_env(e) is (m in ("gridtrim", "both"))
        assert (BridgeSettings.from_env(e) is not None) is (m in ("steptrim", "both"))
    assert BridgeSettings.from_env(envs["both"]).adapters == {k: str(v) for k, v in adapters.items()}


def test_mistral7b_config_and_workload():
    cfg = bench.MODELS["mistral7b"]
    assert cfg["architectures"] == ["MistralForCausalLM"] and cfg["model_type"] == "mistral"
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["head_dim"], cfg["vocab_size"]) == (4096, 14336, 32, 32, 8, 128, 32768)
    assert cfg["rope_theta"] == 1e6 and cfg["max_position_embeddings"] == 32768 and cfg["rms_norm_eps"] == 1e-5
    assert cfg["tie_word_embeddings"] is False and (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    t = lora_targets(cfg)
    assert t["q_proj"][1:] == (4096, 4096) and t["k_proj"][1:] == (4096, 1024) and t["down_proj"][1:] == (14336, 4096)
    wl = workload_for(8, 256, False, 0, cfg)
    ref = make_workload(8, 256)
    assert max(max(p) for p in wl.prompt) < 32768 and min(min(p) for p in wl.prompt) >= 3
    assert [len(p) for p in wl.prompt] == [len(p) for p in ref.prompt] and wl.max_tokens == ref.max_tokens
    assert wl.adapter == ref.adapter and wl.k == ref.k
    assert workload_for(8, 256, False, 0, LLAMA32_3B) == ref


def test_mistral7b_config_loads(tmp_path):
    transformers = pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps(MISTRAL_7B))
    cfg = transformers.AutoConfig.from_pretrained(tmp_path)
    assert type(cfg).__name__ == "MistralConfig" and cfg.head_dim == 128 and cfg.num_key_value_heads == 8
    rope = getattr(cfg, "rope_parameters", None) or {"rope_theta": cfg.rope_theta}
    assert rope["rope_theta"] == 1e6


def test_model_switch_restamps_the_work_dir(tmp_path):
    tiny = {**LLAMA32_3B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}
    bench.prepare(tmp_path, [3], False, 32, 0, tiny)
    assert json.loads((tmp_path / "prepared.json").read_text())["key"] == bench._prep_key([3], tiny)
    bench.drop_stale_stamp(tmp_path, [3], tiny)
    assert (tmp_path / "prepared.json").exists()
    bench.drop_stale_stamp(tmp_path, [3], {**tiny, "model_type": "mistral"})
    assert not (tmp_path / "prepared.json").exists()


def test_poisson_arrivals():
    t = arrival_times(4000, 20.0, seed=0)
    assert len(t) == 4000 and t[0] == 0.0 and all(b >= a for a, b in zip(t, t[1:]))
    gaps = [b - a for a, b in zip(t, t[1:])]
    mean = sum(gaps) / len(gaps)
    assert abs(mean - 1 / 20) < 0.05 / 20 * 4  # within ~4 standard errors of the exponential mean
    assert sum(g < 1 / 20 for g in gaps) / len(gaps) == pytest.approx(1 - 2.718281828 ** -1, abs=0.03)
    assert arrival_times(4000, 20.0, seed=0) == t and arrival_times(4000, 20.0, seed=1) != t
    assert arrival_times(0, 5.0) == [] and arrival_times(1, 5.0) == [0.0]
    slow = arrival_times(4000, 2.0, seed=0)  # the rate only scales the gaps
    assert slow[-1] == pytest.approx(t[-1] * 10)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="arrival rate"):
            arrival_times(10, bad)


def test_latency_summary_and_table():
    s = bench.latency_summary([0.0, 1.0, 2.0], [0.1, 1.3, 2.2], [1.1, 1.3, 2.6], [11, 1, 5])
    assert s["ttft_p50_ms"] == pytest.approx(200.0) and s["ttft_p90_ms"] == pytest.approx(280.0)
    assert s["tpot_p50_ms"] == pytest.approx(100.0) and s["tpot_p90_ms"] == pytest.approx(100.0)  # 1-token request out
    stock = {"mode": "stock", "adapters": 4, "skewed": False, "req_per_s": 10.0, "output_tok_per_s": 600.0,
             "counters": None, "ttft_p50_ms": 50.0, "ttft_p90_ms": 90.0, "tpot_p50_ms": 20.0, "tpot_p90_ms": 30.0}
    both = {**stock, "mode": "both", "tpot_p50_ms": 16.0, "counters": {"realized_skip": 0.5}}
    lines = render(["pre"], [stock, both, {"mode": "gridtrim", "adapters": 4, "skewed": False,
                                                "error": "failed (rc 1)"}], [], latency=True).splitlines()
    assert lines[2] == LATENCY_HEADER and lines[3] == "|" + "---|" * 11
    assert lines[4] == "| 4 | uniform | stock | 10.0 | 600 | 50.0 | 90.0 | 20.0 | 30.0 | — | 1.00 |"
    assert lines[5].endswith("| 16.0 | 30.0 | 0.500 | 1.25 |")
    assert lines[6].count("|") == lines[4].count("|")
    offline = render(["pre"], [stock], []).splitlines()
    assert offline[2] == HEADER and offline[3] == "|---|---|---|---|---|---|---|"


class _StepEngine:
    """vLLM V1 ``LLMEngine``'s add_request / has_unfinished_requests / step contract: request i
    finishes after its own number of steps, and only final outputs are returned."""

    def __init__(self, steps_of):
        self.steps_of, self.left, self.added = steps_of, {}, []

    def add_request(self, request_id, prompt, params, lora_request=None):
        self.added.append((request_id, prompt, params, lora_request))
        self.left[request_id] = self.steps_of(len(self.added) - 1)

    def has_unfinished_requests(self):
        return bool(self.left)

    def abort_request(self, request_ids):
        for rid in request_ids:
            self.left.pop(rid, None)

    def step(self):
        from types import SimpleNamespace

        out = []
        for rid in list(self.left):
            self.left[rid] -= 1
            if self.left[rid] == 0:
                del self.left[rid]
                n = int(rid[1:]) + 3
                out.append(SimpleNamespace(request_id=rid, finished=True,
                                           outputs=[SimpleNamespace(token_ids=list(range(n)))]))
        return out


def test_serve_offline_times_every_step_and_maps_outputs_back():
    engine = _StepEngine(lambda i: 5 - (i % 3))  # requests finish out of order, over 5 steps
    prompts, params, loras = [[1, 2]] * 7, [f"p{i}" for i in range(7)], [None, "a"] * 3 + [None]
    elapsed, tokens, steps = bench.serve_offline(engine, prompts, params, loras)
    assert tokens == [i + 3 for i in range(7)]
    assert len(steps) == 5 and all(s >= 0 for s in steps) and elapsed >= sum(steps)
    assert [a[2] for a in engine.added] == params and [a[3] for a in engine.added] == loras

    class Stuck(_StepEngine):
        def step(self):
            self.left.clear()  # finishes without reporting
            return []

    with pytest.raises(RuntimeError, match="7 of 7 requests never finished"):
        bench.serve_offline(Stuck(lambda i: 1), prompts, params, loras)


def test_timed_runs_repeat_the_workload_in_one_engine():
    engine = _StepEngine(lambda i: 5 - (i % 3))
    prompts, params, loras = [[1, 2]] * 7, ["p"] * 7, [None] * 7
    seen = []
    runs, tokens, steps = bench.timed_runs(engine, prompts, params, loras, 3, lambda: seen.append(len(engine.added)))
    assert len(runs) == 3 and all(r >= 0 for r in runs) and tokens == [i + 3 for i in range(7)]
    assert len(steps) == 5  # the first run's steps
    assert seen == [7]  # once, between the first run and the repeats
    assert len(engine.added) == 21 and not engine.has_unfinished_requests()
    assert len(bench.timed_runs(_StepEngine(lambda i: 2), prompts, params, loras, 1)[0]) == 1
    engine, before = _StepEngine(lambda i: 2), []
    bench.timed_runs(engine, prompts, params, loras, 3, None, None, lambda: before.append(len(engine.added)))
    assert before == [0, 7, 14]  # right before each run

    class Drifting(_StepEngine):
        def step(self):
            out = super().step()
            for o in out:
                if len(self.added) > 7:  # a repeat: one token more
                    o.outputs[0].token_ids.append(0)
            return out

    with pytest.raises(RuntimeError, match="run 2 produced other token counts"):
        bench.timed_runs(Drifting(lambda i: 2), prompts, params, loras, 2)


@pytest.mark.parametrize("argv", [["--repeats", "0"], ["--repeats", "2", "--arrival-rate", "5"]])
def test_repeats_are_offline_runs_only(argv, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2 and "--repeats" in capsys.readouterr().err


def test_step_summary():
    s = bench.step_summary([0.010, 0.020, 0.030, 0.100])
    assert s["steps"] == 4 and s["step_ms_max"] == pytest.approx(100.0)
    assert s["step_ms_mean"] == pytest.approx(40.0) and s["step_ms_p50"] == pytest.approx(25.0)
    assert s["step_ms_p90"] == pytest.approx(79.0)  # numpy's linear interpolation
    assert bench.step_summary([]) == {"steps": 0}


def test_profile_workload_runs_a_fresh_copy_and_leaves_the_engine_empty():
    engine = _StepEngine(lambda i: 100)
    prompts, params, loras = [[1, 2]] * 4, ["x"] * 4, [None, "a", None, "b"]
    report = bench.profile_workload(engine, prompts, params, loras, n_steps=3)
    assert [a[0] for a in engine.added] == ["p0", "p1", "p2", "p3"] and [a[3] for a in engine.added] == loras
    assert report.startswith("profiled steps: 3,") and not engine.has_unfinished_requests()
    engine = _StepEngine(lambda i: 100)
    report = bench.profile_workload(engine, prompts, params, loras, n_steps=3, python=True)
    assert "cProfile: 3 steps," in report and not engine.has_unfinished_requests()


def test_host_probe_times_a_fixed_workload():
    probes = [bench.host_probe_ms(repeats=2) for _ in range(2)]
    assert all(0 < p < 5000 for p in probes)
    # the best of more repeats can only be faster or equal on the same host state; allow noise
    assert bench.host_probe_ms(repeats=5) < 3 * max(probes)


def test_probe_times_the_host_and_the_gpu_where_there_is_one():
    got = bench.probe()
    assert 0 < got["host_ms"] < 5000
    import torch
    if torch.cuda.is_available():
        assert set(got) == {"host_ms", "matmul_ms", "copy_ms"} and min(got.values()) > 0
    else:
        assert set(got) == {"host_ms"} and bench.device_probe_ms() == {}


def test_run_note_gives_each_runs_probes_and_an_older_rows_before_and_after():
    row = {"elapsed_s": 12.0, "startup_s": 100.0, "warmup_s": 30.0, "counters": None, "loadavg": [1.25, 1.0, 1.0],
           "probes": [{"host_ms": 1.5, "matmul_ms": 1.71, "copy_ms": 0.09}, {"host_ms": 1.625}]}
    note = run_note("N=512 both", row, 280.0)
    assert note.endswith("; probes host/matmul/copy ms, each run in its turn: 1.50/1.71/0.09, 1.62/—/—, load 1.2")
    older = {k: v for k, v in row.items() if k != "probes"} | {"host_probe_ms": [1.48, 2.01]}
    assert run_note("N=512 both", older, 280.0).endswith("; host probe 1.48/2.01 ms before/after, load 1.2")


def test_profile_python_needs_profile_steps(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--profile-python", "--out", "/nonexistent/out"])
    assert "--profile-python needs --profile-steps" in capsys.readouterr().err


def test_slot_bound_options_env_and_table(tmp_path):
    opts = bench.engine_options(512, mode="both", max_loras=32)
    assert opts["max_loras"] == 32 and opts["max_cpu_loras"] == 512  # every adapter stays in host memory
    assert bench.engine_options(1024, max_loras=64, max_cpu_loras=256)["max_cpu_loras"] == 256
    assert bench.engine_options(1024, max_loras=512, max_cpu_loras=256)["max_cpu_loras"] == 512  # vLLM: ≥ max_loras
    env = bench.mode_env("both", {"LORAZOR_SLOTS": "1", "X": "1"}, tmp_path, {"a00": tmp_path})
    assert "LORAZOR_SLOTS" not in env and env["X"] == "1"  # hand-back on by default with the bundle
    assert bench.mode_env("both", {}, tmp_path, {}, slots=False)["LORAZOR_SLOTS"] == "0"
    assert "LORAZOR_SLOTS" not in bench.mode_env("gridtrim", {}, tmp_path, {}, slots=False)
    row = {"mode": "both", "adapters": 512, "skewed": False, "req_per_s": 90.0, "max_loras": 32, "slot_steps": 600,
           "mean_running": 200.04, "mean_slots_held": 27.0, "model_steps": 582, "model_mean_running": 208.7,
           "model_mean_slots_held": 27.2}
    earlier = {**row, "mode": "gridtrim"}  # a row measured before the model counted slot loads
    row |= {"model_slot_loads": 513, "model_lora_share": 0.8875}
    table = slot_table([row, earlier, {"mode": "stock", "adapters": 512, "skewed": False, "error": "timed out"}])
    assert table.splitlines()[1] == SLOT_HEADER
    assert table.splitlines()[3] == ("| 512 | uniform | both | 32 | 90.0 | 600 | 200.0 | 27.0 | 582 | 208.7 | 27.2 | "
                                     "513 | 88.8% |")
    assert table.splitlines()[4].endswith("| 27.2 | — | — |")
    assert slot_table([{"mode": "stock"}]) == ""


def test_slot_stats_and_prediction(sched):  # noqa: F811
    from serve_bridge import capacity

    wl = make_workload(64, 96, seed=2, prompt_len=(5, 40), output_len=(3, 20))
    requests = {}

    class Scheduler:  # scheduled_occupancy reads requests / num_scheduled_tokens only
        def __init__(self):
            self.steps = 0

        def schedule(self):
            self.steps += 1
            ids = [f"r{self.steps}", f"s{self.steps}"]
            for j, rid in enumerate(ids):
                requests[rid] = SimpleNamespace(num_computed_tokens=4, lora_request=SimpleNamespace(lora_int_id=j))
            tokens = 600 if self.steps % 2 else 2  # odd steps: a prefill past the largest graph
            time.sleep(0.02 if self.steps % 2 else 0.0)  # taken by the next schedule as this step's time
            return SimpleNamespace(num_scheduled_tokens={ids[0]: tokens - 1, ids[1]: 1},
                                   total_num_scheduled_tokens=tokens)

    sched = Scheduler()
    sched.requests = requests
    stats = bench.SlotStats(sched, graph_tokens=512)
    assert stats.scheduler_class == "Scheduler"
    sched.schedule()  # warm-up: not counted
    stats.start()
    for _ in range(5):
        sched.schedule()
    summary = stats.summary()
    assert summary["slot_steps"] == 5 and summary["mean_running"] == 2 and summary["mean_slots_held"] == 2
    assert summary["max_slots_held"] == summary["max_adapters_scheduled"] == 2
    # steps 2-6: 2, 600, 2, 600, 2 tokens; a step runs from its schedule call to the next (the
    # sleep inside a 600-token step's call is its time); the last step is not timed
    assert summary["graph_tokens"] == 512 and summary["steps_past_graphs"] == 2
    assert summary["step_ms_past_graphs"] >= 15 and summary["step_ms_within_graphs"] < 15
    assert summary["step_ms"] == pytest.approx((summary["step_ms_within_graphs"] + summary["step_ms_past_graphs"]) / 2)
    note = graphs_note(summary)
    assert note.startswith("; 2/5 steps past the largest CUDA graph (512 tokens), ") and note.endswith(" ms")
    assert graphs_note({}) == "" and "ms each" not in graphs_note(summary | {"step_ms_past_graphs": None})
    assert "(512 tokens; model 3), " in graphs_note(summary | {"model_steps_past_graphs": 3})
    opts = bench.engine_options(64, max_loras=8)
    pred = bench.predicted_slots(wl, 8, True, opts)
    reqs = capacity.Requests(np.asarray(wl.adapter), np.asarray([len(p) for p in wl.prompt]),
                             np.asarray(wl.max_tokens), np.asarray(wl.releases()), np.zeros(96, np.int64))
    ref = capacity.simulate(reqs, 8, release=True, max_num_seqs=256, token_budget=2048)
    assert pred == {"model_steps": ref.steps, "model_mean_running": ref.mean_running,
                    "model_mean_slots_held": ref.mean_occupancy, "model_slot_loads": ref.slot_loads,
                    "model_lora_share": ref.lora_share}
    assert bench.predicted_slots(wl, 8, False, opts)["model_steps"] > pred["model_steps"]
    # the steps past a CUDA-graph size: every work step past 0 tokens, none past the token budget
    steps_ref = capacity.simulate(reqs, 8, release=True, max_num_seqs=256, token_budget=2048, graph_tokens=0)
    assert steps_ref.steps_past_graphs == steps_ref.steps  # offline: every step has work
    assert bench.predicted_slots(wl, 8, True, opts, graph_tokens=2048)["model_steps_past_graphs"] == 0
    some = bench.predicted_slots(wl, 8, True, opts, graph_tokens=40)["model_steps_past_graphs"]
    assert 0 < some < ref.steps


def test_rank_reaches_the_adapters_the_engine_and_the_stamp(tmp_path):
    """--rank writes rank-R adapters (alpha 2R: the same scale as rank 8's alpha 16), sizes vLLM's
    max_lora_rank and restamps a work directory prepared at another rank."""
    tiny = {**LLAMA32_3B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}
    bench.prepare(tmp_path, [3], False, 32, 0, tiny, rank=16)
    peft = json.loads((tmp_path / "adapters" / "a00" / "adapter_config.json").read_text())
    assert (peft["r"], peft["lora_alpha"]) == (16, 32)
    with safe_open(str(tmp_path / "adapters" / "a00" / "adapter_model.safetensors"), "pt") as f:
        assert f.get_tensor("base_model.model.model.layers.0.mlp.down_proj.lora_A.weight").shape == (16, 128)
    assert bench.engine_options(4, rank=16)["max_lora_rank"] == 16 and bench.engine_options(4)["max_lora_rank"] == 8
    bench.drop_stale_stamp(tmp_path, [3], tiny, rank=16)
    assert (tmp_path / "prepared.json").exists()
    bench.drop_stale_stamp(tmp_path, [3], tiny)  # rank 8 now
    assert not (tmp_path / "prepared.json").exists()


def test_llama8b_shape_gives_the_production_table_sizes():
    """Llama-3.1-8B's config: about 8.0 B parameters, and a rank-16 adapter on the seven
    projections is about 84 MB in bf16 (scripts/gpu_slot_bench.sh's llama8b256 table)."""
    cfg = bench.MODELS["llama8b"]
    h, f, n, kv = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["num_key_value_heads"]
    kv_dim = kv * cfg["head_dim"]
    per_layer = h * h * 2 + h * kv_dim * 2 + 3 * h * f
    params = n * per_layer + 2 * cfg["vocab_size"] * h  # untied embedding and lm_head
    assert 7.9e9 < params < 8.1e9
    lora = n * 16 * sum(n_in + n_out for _, n_in, n_out in lora_targets(cfg).values())  # what the writer writes
    assert 83e6 < 2 * lora < 85e6


def test_largest_graph_tokens_reads_the_engines_compilation_config():
    """vLLM runs a step of more tokens than max_cudagraph_capture_size without a CUDA graph, and
    none at all with cudagraph_mode NONE (CUDAGraphMode is an enum: its members have a name)."""
    def config(mode: str, size: int | None) -> SimpleNamespace:
        return SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_mode=SimpleNamespace(name=mode),
                                                                  max_cudagraph_capture_size=size))

    assert bench.largest_graph_tokens(config("FULL_AND_PIECEWISE", 512)) == 512
    assert bench.largest_graph_tokens(config("FULL", 2048)) == 2048
    assert bench.largest_graph_tokens(config("NONE", 512)) == 0
    assert bench.largest_graph_tokens(config("FULL_AND_PIECEWISE", None)) == 0
