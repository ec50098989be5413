"""No command writes over its own inputs or over a file it did not create (serve_bridge/safe_write.py):
an output named as an input (by its path, a hard link or a symbolic link), inside an input directory
or holding an input is refused in one line with exit code 2 and every input keeps its sha256; an
existing output is replaced only with ``--replace``, and then by a rename."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from serve_bridge import capacity
from tests.robustness.helpers import assert_one_error_line, digest, exit_code, sha256
from tests.robustness.test_battery_commands import QUICK, tiny_bundle


# --- python -m serve_bridge.capacity: --bundle in, --plot and --json out --------------------------

def _link(kind: str, target: Path, link: Path) -> Path:
    (os.link if kind == "hard" else os.symlink)(target, link)
    return link


CAPACITY_OUTPUTS = {  # name: (make the output path from (bundle, tmp), extra arguments, message fragment)
    "json_is_the_manifest": (lambda b, t: b / "manifest.json", [], "the command's input"),
    "plot_is_the_heads_file": (lambda b, t: b / "heads.safetensors", ["--replace"], "the command's input"),
    "json_is_a_hard_link_to_the_manifest": (lambda b, t: _link("hard", b / "manifest.json", t / "m.json"),
                                            ["--replace"], "is the command's input"),
    "json_is_a_symlink_to_the_manifest": (lambda b, t: _link("soft", b / "manifest.json", t / "m.json"),
                                          ["--replace"], "the command's input"),
    "json_new_inside_the_bundle": (lambda b, t: b / "slots.json", [], "lies inside the command's input"),
    "json_is_a_file_of_the_user": (lambda b, t: t / "notes", [], "exists; choose a new path, or pass --replace"),
}


@pytest.mark.parametrize("case", sorted(CAPACITY_OUTPUTS))
def test_capacity_never_writes_its_input_or_a_user_file(tmp_path: Path, capsys, case: str) -> None:
    make, extra, fragment = CAPACITY_OUTPUTS[case]
    bundle = tiny_bundle(tmp_path / "bundle")
    (tmp_path / "notes").write_text("mine")
    out = make(bundle, tmp_path)
    before = digest(tmp_path)
    flag = "--plot" if case.startswith("plot") else "--json"
    argv = ["--bundle", str(bundle), "--adapters", "4", *QUICK, flag, str(out), *extra]
    assert exit_code(lambda: capacity.main(argv)) == 2
    assert_one_error_line(capsys.readouterr().err, fragment)
    assert digest(tmp_path) == before and sha256(bundle / "manifest.json") == before["bundle/manifest.json"]


def test_capacity_json_and_plot_on_one_path(tmp_path: Path, capsys) -> None:
    bundle = tiny_bundle(tmp_path / "bundle")
    out = str(tmp_path / "slots")
    assert exit_code(lambda: capacity.main(["--bundle", str(bundle), "--adapters", "4", *QUICK, "--json", out,
                                            "--plot", out])) == 2
    assert_one_error_line(capsys.readouterr().err, "is also --plot")
    assert not os.path.lexists(out)


def test_capacity_replace_renames_a_new_file_into_place(tmp_path: Path) -> None:
    bundle = tiny_bundle(tmp_path / "bundle")
    out, other = tmp_path / "slots.json", tmp_path / "other"
    other.write_text("kept")
    os.link(other, out)  # the old output shares its inode with another name
    assert capacity.main(["--bundle", str(bundle), "--adapters", "4", *QUICK, "--json", str(out), "--replace"]) == 0
    assert json.loads(out.read_text())["results"] and other.read_text() == "kept"
