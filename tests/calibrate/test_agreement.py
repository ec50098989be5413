"""engine=vllm's config errors on a machine without vLLM, and the agreement stage with its
engine injected: on the hf engine, the realized side must equal what the sweep and the test
stage predicted, exactly (same engine, greedy decoding, exact one-pass sweep)."""
from __future__ import annotations

import json
import re
import shutil
import sys
from functools import cached_property
from pathlib import Path

import pandas as pd
import pytest

from calibrate.context import Context
from calibrate.errors import ConfigError
from calibrate.pipeline import STAGES, run_pipeline
from calibrate.rundir import RunDir
from labeling.engines.vllm.options import SUPPORTED_VLLM
from tests.calibrate.test_pipeline import TINY, compose_cfg


class HFAgreement(Context):
    """The agreement stage realized on the run's own (hf) engine instead of vLLM."""

    @property
    def agreement_options(self):
        return self.engine_options

    @cached_property
    def agreement_engine(self):
        return self.engine


@pytest.mark.parametrize("override,prop", [("engine=vllm", "engine"), ("engine=hf", "agreement_engine")])
def test_vllm_engine_without_vllm_is_one_clear_error(tmp_path: Path, monkeypatch, override: str, prop: str) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    ctx = Context(compose_cfg([*TINY, override]), RunDir(tmp_path))
    supported = re.escape(" or ".join(SUPPORTED_VLLM))
    with pytest.raises(ConfigError, match=rf"engine=vllm needs vLLM \({supported}\) and a GPU: pip install 'lorazor\[vllm\]'"):
        getattr(ctx, prop)


def test_vllm_engine_config_composes() -> None:
    cfg = compose_cfg(["engine=vllm", "engine.tensor_parallel_size=2"])
    assert cfg.engine.name == "vllm" and cfg.engine.tensor_parallel_size == 2 and cfg.engine.max_lora_rank == "auto"
    assert cfg.agreement is False and "agreement" in STAGES


def test_agreement_stage_on_injected_engine(tmp_path: Path, tiny_run: tuple[Path, dict], capsys) -> None:
    tmp_path = Path(shutil.copytree(tiny_run[0], tmp_path / "run"))  # data … test cached: only agreement runs
    summaries = run_pipeline(HFAgreement(compose_cfg([*TINY, "agreement=true"]), RunDir(tmp_path)))
    assert list(summaries) == ["data", "labels", "heads", "sweep", "export", "test", "agreement"]
    assert {k: v for k, v in summaries.items() if k != "agreement"} == json.loads(json.dumps(tiny_run[1]))
    df = pd.read_csv(tmp_path / "agreement" / "agreement.csv")
    assert sorted(zip(df["adapter"], df["split"])) == [("arith-a", "test"), ("arith-a", "validation")]
    for col in ("skip_diff_points", "accuracy_diff_points", "loss_diff_points"):
        assert (df[col].abs() < 1e-9).all(), df[[col, "split"]]
    test = pd.read_csv(tmp_path / "test" / "realized.csv").iloc[0]
    row = df[df["split"] == "test"].iloc[0]
    assert row["realized_skip_pct"] == pytest.approx(100 * test["test_skip"])
    assert row["realized_by"] == "HFEngine" and row["predicted_by"] == "test stage (hf)"
    assert df["within_band"].all()
    assert (tmp_path / "plots" / "agreement.png").stat().st_size > 1000
    out = capsys.readouterr().out
    assert "agreement: the bundle realized on HFEngine" in out and "2/2 agree within ±3 points" in out
    assert "[test] cached" in out  # the copied run's earlier stages were not re-run
    again = run_pipeline(HFAgreement(compose_cfg([*TINY, "agreement=true"]), RunDir(tmp_path)))
    assert again["agreement"] == summaries["agreement"]
    assert "[agreement] cached" in capsys.readouterr().out
