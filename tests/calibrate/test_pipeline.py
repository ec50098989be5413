"""`python -m calibrate` end to end on the embedded default (tiny sizes), resume after a kill,
and the user-facing errors."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hydra import compose, initialize_config_module
from safetensors.torch import load_file, save_file

from calibrate.context import Context
from calibrate.errors import ConfigError
from calibrate.pipeline import format_final, run_pipeline, stage_fingerprints
from calibrate.config import register
from calibrate.rundir import RunDir
from labeling.adapters import AdapterError
from labeling.engines.cpu_matmul import resolve_cpu_matmul
from labeling.tasks import TaskError
from serve_bridge.bundle import load_bundle
from tests.conftest import ROOT

# Four labeling points instead of the default seven: each labeled request forks one OFF branch per
# point, and the kill/resume and CLI tests run this config in several processes.
TINY = ["task=arith", "adapter=arith_demo", "task.sizes.train=6", "task.sizes.validation=3", "task.sizes.test=3", "task.options.max_new_tokens=40",
        "labeling.shard_requests=2", "labeling.points=[0,3,7,31]", "engine.progress=false"]


def compose_cfg(overrides: list[str]):
    register()
    with initialize_config_module(config_module="conf", version_base=None):
        return compose("config", overrides=overrides)


def run(tmp: Path, overrides: list[str]) -> dict:
    return run_pipeline(Context(compose_cfg(overrides), RunDir(tmp)))


def cli(run_dir: Path, *overrides: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "calibrate", f"hydra.run.dir={run_dir}", *overrides],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_end_to_end_tiny(tiny_run: tuple[Path, dict]) -> None:
    tmp_path, summaries = tiny_run
    assert set(summaries) == {"data", "labels", "heads", "sweep", "export", "test"}
    bundle = load_bundle(tmp_path / "bundle", expected_hidden_size=576, expected_backbone="smollm2",
                         known_adapters=["arith-a"])
    assert set(bundle.adapters) == {"arith-a"}
    entry = bundle.adapters["arith-a"]
    if entry.policy != "none":  # the validation release points, for serve_bridge.capacity
        hist = entry.stats["release_points"]
        assert sum(hist["count"]) + hist["never"] == 3  # task.sizes.validation
    for name in ("sweep/candidates", "sweep/frontier", "sweep/k_table", "export/selection", "export/budget_comparison"):
        assert len(pd.read_csv(tmp_path / f"{name}.csv")) > 0
    assert (tmp_path / "plots" / "frontier_arith-a.png").stat().st_size > 1000
    assert (tmp_path / "plots" / "positive_rate_per_t.png").stat().st_size > 1000
    realized = pd.read_csv(tmp_path / "test" / "realized.csv")
    assert list(realized["adapter"]) == ["arith-a"] and 0 <= realized["test_skip"].iloc[0] <= 1
    assert "arith-a" in format_final(summaries)
    # The sweep priced 32 τ + 9 k candidates from one tree pass, far below regenerating each.
    assert summaries["sweep"]["naive_tokens"] > 2 * summaries["sweep"]["tree_tokens"]
    # Re-running a finished run is a no-op: every stage is cached, outputs untouched.
    stamp = (tmp_path / "bundle" / "manifest.json").stat().st_mtime_ns
    again = run(tmp_path, TINY)
    assert again == json.loads(json.dumps(summaries))
    assert (tmp_path / "bundle" / "manifest.json").stat().st_mtime_ns == stamp


def test_fingerprints_follow_the_engine_not_its_throughput_knobs(tmp_path: Path) -> None:
    """Switching hf↔vllm (or the dtype, or the hf engine's multiplication dtype) re-runs the generation
    stages; batch sizes and the GGUF's location do not."""
    def fps(*overrides: str) -> dict[str, str]:
        return stage_fingerprints(Context(compose_cfg([*TINY, *overrides]), RunDir(tmp_path)))

    hf, hf_batch, vllm = fps(), fps("engine=hf", "engine.batch_size=4"), fps("engine=vllm")
    assert hf == hf_batch
    assert all(vllm[s] != hf[s] for s in ("labels", "heads", "sweep", "export", "test", "agreement"))
    assert vllm["data"] == hf["data"]
    assert fps("engine=vllm", "engine.max_num_seqs=64") == vllm
    assert fps("engine=vllm", "engine.kv_cache_memory_bytes=4294967296") == vllm
    assert fps("engine=vllm", "engine.dtype=float16")["labels"] != vllm["labels"]
    assert fps("+backbone.gguf_dir=/elsewhere") == hf
    # The hf engine's multiplications count as resolved on this machine (engine.cpu_matmul).
    fp32, bf16 = fps("engine=hf", "engine.cpu_matmul=float32"), fps("engine=hf", "engine.cpu_matmul=bfloat16")
    assert fp32["labels"] != bf16["labels"] and fp32["data"] == bf16["data"]
    assert hf == (bf16 if resolve_cpu_matmul("auto", "cpu", "float32") == "bfloat16" else fp32)
    # Another budget or rule re-runs the export and the test, not the sweep's generation.
    budget = fps("export.budget=5")
    assert budget["sweep"] == hf["sweep"] and budget["export"] != hf["export"] and budget["test"] != hf["test"]
    # Adapters count by content: the same files elsewhere keep the cache, new weights do not.
    demo = ROOT / "labeling" / "data" / "adapters" / "arith-a"
    copy = tmp_path / "arith-a"
    shutil.copytree(demo, copy)
    moved = fps(f"adapter.adapters=[{{name: arith-a, path: {copy}}}]")
    assert moved == hf
    weights = load_file(copy / "adapter_model.safetensors")
    name = next(iter(weights))
    weights[name] = weights[name] + 1
    save_file(weights, copy / "adapter_model.safetensors")
    changed = fps(f"adapter.adapters=[{{name: arith-a, path: {copy}}}]")
    assert changed["labels"] != hf["labels"] and changed["data"] == hf["data"]


def test_resume_after_kill_yields_identical_labels(tmp_path: Path, tiny_run: tuple[Path, dict]) -> None:
    labels_only = [*TINY, "stages=[data,labels]"]
    reference = tiny_run[0]  # the same labels config, run in one go
    killed = tmp_path / "killed"
    proc = cli(killed, *labels_only)
    first_shard = killed / "labels" / "shards" / "00000.done"
    deadline = time.time() + 300
    while not first_shard.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert first_shard.exists(), "the first labeling shard never finished"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed / "stages" / "labels.json").exists(), "the killed run must not be marked done"
    assert not (killed / "labels" / "shards" / "00002.done").exists()
    run(killed, labels_only)  # the resume, in this process (the kill needed the subprocess)
    pd.testing.assert_frame_equal(pd.read_parquet(killed / "labels" / "points.parquet"),
                                  pd.read_parquet(reference / "labels" / "points.parquet"))
    np.testing.assert_array_equal(np.load(killed / "labels" / "features.npy"),
                                  np.load(reference / "labels" / "features.npy"))
    # Another label config in the same directory never reuses the old config's shards.
    run(killed, [*labels_only, "labeling.points=[0,2]"])
    assert set(pd.read_parquet(killed / "labels" / "points.parquet")["t"]) <= {0, 2}


def test_shard_requests_auto_follows_the_engine(tmp_path: Path) -> None:
    def shard(*overrides: str) -> int:
        return Context(compose_cfg(list(overrides)), RunDir(tmp_path)).shard_requests

    assert shard() == 64 and shard("engine=hf", "engine.batch_size=4") == 8
    assert shard("engine=vllm") == 1024 and shard("engine=vllm", "engine.data_parallel_size=2") == 2048
    assert shard("engine=vllm", "engine.max_num_seqs=256") == 256
    assert shard("labeling.shard_requests=5") == 5
    with pytest.raises(ConfigError, match="shard_requests"):
        shard("labeling.shard_requests=0")


def test_cli_prints_one_clear_error(tmp_path: Path) -> None:
    proc = cli(tmp_path, "task.name=nope")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [lines[0]] and "unknown task 'nope'" in lines[0] and "arith" in lines[0], err


@pytest.mark.parametrize("overrides,match", [
    (["task=arith", "task.options.val_sise=8"], "Key 'val_sise' not in 'ArithOptions'"),
    (["engine=hf", "engine.batch_size=many"], "could not be converted to Integer"),
    (["engine.batch_size=64"], "engine options need engine=hf or engine=vllm"),
    (["task=nope"], "available: arith, counter, demo, gsm8k"),
])
def test_config_mistakes_are_one_line_and_exit_2(tmp_path: Path, overrides: list[str], match: str) -> None:
    """The schema (calibrate/config.py) catches them while composing, before any work."""
    proc = cli(tmp_path / "run", *overrides)
    out, err = proc.communicate(timeout=300)
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and match in lines[0], err
    assert not (tmp_path / "run").exists()


def _adapter_for_hidden(tmp: Path, hidden: int) -> Path:
    import torch

    d = tmp / f"lora-h{hidden}"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                       "target_modules": ["q_proj"]}))
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, hidden),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(hidden, 4)},
              d / "adapter_model.safetensors")
    return d


@pytest.mark.parametrize("case", ["missing_adapter", "wrong_hidden", "empty_split", "missing_local", "bad_stage"])
def test_bad_input_gets_one_clear_error(tmp_path: Path, case: str) -> None:
    overrides, error, match = {
        "missing_adapter": (["adapter.adapters=[{name: x, path: /nonexistent/lora}]", "stages=[labels]"],
                            AdapterError, "does not exist"),
        "wrong_hidden": ([f"adapter.adapters=[{{name: big, path: {_adapter_for_hidden(tmp_path, 4096)}}}]",
                          "stages=[labels]"], AdapterError, "hidden size 4096.*576"),
        "empty_split": (["task.sizes.validation=0", "stages=[data]"], ConfigError, "validation=0: .* empty"),
        "missing_local": (["task=gsm8k", "task.options.source=/nonexistent/gsm8k", "stages=[data]"], TaskError,
                          "does not exist"),
        "bad_stage": (["stages=[data,typo]"], ConfigError, "unknown stage"),
    }[case]
    with pytest.raises(error, match=match):
        run(tmp_path / "run", [*TINY, *overrides])
    assert not list((tmp_path / "run").glob("stages/*.json")) or case == "bad_stage"


def test_demo_config_routes_each_adapter_to_its_part(tmp_path: Path) -> None:
    """The two-adapter demo (task=demo adapter=demo); an adapter's `task` must name a part of the mix,
    every part needs an adapter, and a plain task refuses `task`."""
    ctx = Context(compose_cfg(["task=demo", "adapter=demo"]), RunDir(tmp_path))
    assert ctx.section("task")["name"] == "mix" and ctx.adapter_names == ["arith-a", "counter-a"]
    assert ctx.adapter_parts == {0: "arith", 1: "counter"}
    arith = f"{{name: a, path: {ROOT / 'labeling/data/adapters/arith-a'}"
    cases = {f"adapter.adapters=[{arith}, task: arith}}]": "part.*counter.*have no adapter",
             f"adapter.adapters=[{arith}, task: arith}}, {arith.replace('name: a', 'name: b')}}}]": "needs each",
             f"adapter.adapters=[{arith}, task: arith}}, {arith.replace('name: a', 'name: b')}, task: x}}]":
                 "task 'x' is not a part"}
    for override, match in cases.items():
        with pytest.raises(AdapterError, match=match):
            Context(compose_cfg(["task=demo", "adapter=custom", override]), RunDir(tmp_path)).adapters
    with pytest.raises(AdapterError, match="not a mix"):
        Context(compose_cfg([*TINY, f"adapter.adapters=[{arith}, task: arith}}]"]), RunDir(tmp_path)).adapters


def test_wheel_ships_configs_and_demo_adapter(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(ROOT)], check=True)
    import zipfile

    names = zipfile.ZipFile(next(tmp_path.glob("lorazor-*.whl"))).namelist()
    for f in ("conf/config.yaml", "conf/task/arith.yaml", "conf/task/demo.yaml", "conf/adapter/demo.yaml",
              "conf/backbone/llama3b.yaml", "labeling/data/adapters/arith-a/adapter_model.safetensors",
              "labeling/data/adapters/counter-a/adapter_model.safetensors", "calibrate/__main__.py"):
        assert f in names, f


def test_preview_measures_the_first_shards_and_stops(tmp_path: Path, capsys) -> None:
    """preview=true: the engine choice, then the preview from the first two labeling shards (kept,
    with their stats; the first is the warm-up), then the run stops before the third; the labels
    stage is not done."""
    from labeling.engines.auto import MachineFacts

    cpu = MachineFacts(cuda=False, gpus=0, gpu_memory=0, vllm_version=None)
    summaries = run_pipeline(Context(compose_cfg([*TINY, "stages=[data,labels]", "preview=true"]), RunDir(tmp_path),
                                     facts=cpu))
    assert list(summaries) == ["data"]
    out = capsys.readouterr().out
    assert "engine=auto → hf on cpu: no CUDA device is visible." in out
    assert "preview on hf (cpu), measured on 2 of 3 labeling shard(s): 4 requests" in out
    assert "tokens/s after the warm-up shard)" in out
    assert "labels: 6 ON + ~" in out and "preview=true: stopped after the preview" in out
    stats = json.loads((tmp_path / "labels" / "shards" / "00001.done").read_text())["stats"]
    assert stats["requests"] == 2 and stats["on_tokens"] > 0 and stats["seconds"] > 0
    assert not (tmp_path / "labels" / "shards" / "00002.done").exists()
    assert not (tmp_path / "stages" / "labels.json").exists()
    assert json.loads((tmp_path / "engine.json").read_text())["device"] == "cpu"
