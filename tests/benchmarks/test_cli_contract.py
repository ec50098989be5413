"""Every benchmark command keeps the contract of LoRazor's commands (serve_bridge/command_line.py):
a mistake in its arguments is one line on stderr, ``error: …``, and exit code 2, before any work.

The commands are found, not listed: every module under benchmarks/ that runs as ``__main__``. Each
runs in this process through :mod:`runpy`, as ``python -m`` runs it.
"""
from __future__ import annotations

import importlib
import json
import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts)
                  for p in (ROOT / "benchmarks").rglob("*.py")
                  if "results" not in p.parts and 'if __name__ == "__main__":' in p.read_text())


def run_command(module: str, argv: list[str], monkeypatch, capsys) -> tuple[int, str]:
    """(exit code, stderr) of ``python -m module *argv``, which must exit through SystemExit."""
    monkeypatch.setattr(sys, "argv", [module.rsplit(".", 1)[-1] + ".py", *argv])
    monkeypatch.delitem(sys.modules, module, raising=False)  # runpy runs it afresh as __main__
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    return exit_.value.code, capsys.readouterr().err


def one_error_line(code: int, err: str) -> bool:
    return code == 2 and err.count("\n") == 1 and err.startswith("error: ")


def test_the_commands_are_found():
    assert len(COMMANDS) >= 20 and "benchmarks.serving.chat" in COMMANDS


@pytest.mark.parametrize("module", COMMANDS)
def test_an_unknown_option_is_one_line(module, monkeypatch, capsys):
    code, err = run_command(module, ["--no-such-option"], monkeypatch, capsys)
    assert one_error_line(code, err), err
    assert "--no-such-option" in err or "arguments are required" in err  # argparse names missing ones first


BAD_VALUES = [
    ("benchmarks.serving.bench", ["--adapters", "0"], "--adapters: '0': use a positive integer"),
    ("benchmarks.serving.bench", ["--arrival-rate", "nan"], "--arrival-rate: 'nan': use a positive number"),
    ("benchmarks.serving.bench", ["--capture-sizes", "8", "-1"], "--capture-sizes: '-1'"),
    ("benchmarks.serving.goodput", ["--factor", "1"], "--factor: '1': use a number above 1"),
    ("benchmarks.serving.goodput", ["--port", "65536"], "--port: '65536'"),
    ("benchmarks.serving.goodput", ["--seed", "x"], "--seed: 'x'"),
    ("benchmarks.serving.chat", ["--system-len", "300", "200"], "--system-len=[300, 200]: give MIN ≤ MAX"),
    ("benchmarks.serving.chat", ["--zipf", "-0.5"], "--zipf: '-0.5': use a non-negative number"),
    ("benchmarks.serving.chat", ["--bundle", "/no/such/bundle"], "--bundle: '/no/such/bundle': does not exist"),
    ("benchmarks.serving.chat_bundle", ["--work", "{tmp}", "--bundle", "{tmp}/b", "--target-skip", "1"],
     "--target-skip: '1': use a number in (0, 1)"),
    ("benchmarks.serving.chat_bundle", ["--work", "{tmp}", "--bundle", "{tmp}/b"], "has no prepared.json"),
    ("benchmarks.serving.check_slots", ["--out", "{tmp}/o", "--requests", "0"], "--requests: '0'"),
    ("benchmarks.sweep.tree_breakdown", ["--run", "{tmp}"], "has no sweep/trees.parquet"),
    ("benchmarks.sweep.bench_sweep_cost", ["--run", "{tmp}"], "has no .hydra/overrides.yaml"),
    ("benchmarks.engines.compare_engines", ["--run", "{tmp}/none", "--out", "{tmp}/o"], "does not exist"),
    ("benchmarks.robustness.kill_resume", ["--kills", "-1"], "--kills: '-1': use a positive integer"),
    ("benchmarks.serve_bridge.bench_decision", ["--out", "{tmp}/o", "--steps", "0"], "--steps: '0'"),
    ("benchmarks.kernels.bench_lora_ops", ["--out", "/dev/null/x.md"], "which is not a directory"),
    ("benchmarks.kernels.bench_overlap", ["--out", "{tmp}"], "is a directory; name a file"),
    ("benchmarks.serving.sweep_plot", ["{tmp}/none.json"], "not a goodput or chat table"),
    ("benchmarks.serving.sweep_plot", ["README.md", "--tpot-slo-ms", "0"], "--tpot-slo-ms: '0'"),
]


@pytest.mark.parametrize("module,argv,message", BAD_VALUES)
def test_a_bad_value_is_one_line_before_any_work(module, argv, message, tmp_path, monkeypatch, capsys):
    before = sorted(tmp_path.rglob("*"))
    code, err = run_command(module, [a.replace("{tmp}", str(tmp_path)) for a in argv], monkeypatch, capsys)
    assert one_error_line(code, err), err
    assert message in err
    assert sorted(tmp_path.rglob("*")) == before  # nothing written


@pytest.mark.parametrize("module", ["benchmarks.kernels.bench_lora_ops", "benchmarks.kernels.bench_overlap"])
def test_an_existing_out_file_is_kept_without_replace(module, tmp_path, monkeypatch, capsys):
    mine = tmp_path / "notes.md"
    mine.write_text("mine")
    code, err = run_command(module, ["--out", str(mine)], monkeypatch, capsys)
    assert one_error_line(code, err) and "exists; choose a new path, or pass --replace" in err, err
    assert mine.read_text() == "mine"


DIR_OUTS = [("benchmarks.serve_bridge.bench_step_host", ["--rows", "4", "--steps", "12"], "step_host.json"),
            ("benchmarks.serve_bridge.bench_decision", ["--device", "cpu", "--steps", "2", "--warmup", "0", "--rows", "4",
                                                        "--heads", "2", "--hidden", "8"], "bench_decision.json")]


@pytest.mark.parametrize("module,argv,name", DIR_OUTS)
def test_an_out_directory_keeps_earlier_files_without_replace(module, argv, name, tmp_path, monkeypatch, capsys):
    """A file of the benchmark's own name in --out is a user's until --replace says otherwise; a
    file where --out should be a directory is refused; both before any work."""
    mine = tmp_path / name
    mine.write_text("mine")
    code, err = run_command(module, [*argv, "--out", str(tmp_path)], monkeypatch, capsys)
    assert one_error_line(code, err) and f"already holds {name}; choose another directory, or pass --replace" in err, err
    assert mine.read_text() == "mine" and [p.name for p in tmp_path.iterdir()] == [name]
    code, err = run_command(module, [*argv, "--out", str(mine)], monkeypatch, capsys)
    assert one_error_line(code, err) and "exists and is not a directory" in err, err
    assert mine.read_text() == "mine"
    importlib.import_module(module).main([*argv, "--out", str(tmp_path), "--replace"])
    assert json.loads(mine.read_text()) and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_printed_lines_reach_out_whole(tmp_path, capsys):
    from benchmarks.printed import Printed

    emit = Printed()
    emit("| a |")
    emit()
    emit.write(None)
    emit.write(tmp_path / "t.md")
    assert capsys.readouterr().out == "| a |\n\n" and (tmp_path / "t.md").read_text() == "| a |\n\n"
    assert [p.name for p in tmp_path.iterdir()] == ["t.md"]  # no temporary file left


def test_an_existing_bundle_is_refused_before_the_gpu_work(tmp_path, monkeypatch, capsys):
    """The bundle may lie inside --work (the chat benchmark keeps it there), but must be new."""
    (tmp_path / "prepared.json").write_text("{}")
    (tmp_path / "learned" / "b").mkdir(parents=True)
    (tmp_path / "learned" / "b" / "manifest.json").write_text("{}")
    argv = ["--work", str(tmp_path), "--bundle", str(tmp_path / "learned" / "b")]
    code, err = run_command("benchmarks.serving.chat_bundle", argv, monkeypatch, capsys)
    assert one_error_line(code, err) and "--bundle=" in err and "exists" in err, err
    assert (tmp_path / "learned" / "b" / "manifest.json").read_text() == "{}"
