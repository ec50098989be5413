"""Every user-facing command keeps `python -m calibrate`'s contract (serve_bridge/command_line.py): a
user mistake is one line on stderr naming the argument or file:line, exit code 2, before any model
loads and before anything is written. The capacity model's command runs in process through its
``main``."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from serve_bridge import capacity
from serve_bridge.bundle import AdapterEntry, write_bundle
from tests.robustness.helpers import assert_one_error_line, digest, exit_code

H = 8


def tiny_bundle(path: Path, release_points: object = None) -> Path:
    """A bundle of a profiled adapter ``p`` (k = 3; ``release_points`` in its stats if given) and a
    learned one ``l``."""
    stats = {} if release_points is None else {"release_points": release_points}
    entries = [AdapterEntry("p", "0" * 64, "profiled", k=3, stats=stats),
               AdapterEntry("l", "1" * 64, "learned", tau=0.0, weight=np.zeros(H, np.float32), bias=0.0)]
    return write_bundle(path, backbone="m", hidden_size=H, config_fingerprint="c", adapters=entries)


# --- python -m serve_bridge.capacity ---------------------------------------------------------

QUICK = ["--requests", "40", "--prompt-len", "5", "9", "--output-len", "3", "9"]  # a case's own arguments win
CAPACITY_MISTAKES = {  # name: (arguments besides --bundle and QUICK, message fragment)
    "adapters_not_a_number": (["--adapters", "x"], "argument --adapters: invalid int value: 'x'"),
    "adapters_missing": ([], "the following arguments are required: --adapters"),
    "unknown_argument": (["--adapters", "8", "--colour", "red"], "unrecognized arguments: --colour red"),
    "requests_zero": (["--adapters", "8", "--requests", "0"], "--requests=0: use a positive integer"),
    "requests_negative": (["--adapters", "8", "--requests", "-5"], "--requests=-5: use a positive integer"),
    "tolerance_nan": (["--adapters", "8", "--tolerance", "nan"], "--tolerance=nan: use a number in [0, 1)"),
    "tolerance_above_one": (["--adapters", "8", "--tolerance", "1.5"], "--tolerance=1.5"),
    "tolerance_negative": (["--adapters", "8", "--tolerance", "-0.1"], "--tolerance=-0.1"),
    "seed_negative": (["--adapters", "8", "--seed", "-1"], "--seed=-1: use an integer from 0"),
    "skew_over_one_adapter": (["--adapters", "1", "--skew", "0.5"], "--skew=0.5: needs --adapters ≥ 2"),
    "adapters_past_int64": (["--adapters", str(10 ** 19)], f"--adapters={10 ** 19}: use at most"),
    "prompt_length_past_int64": (["--adapters", "8", "--prompt-len", "1", str(10 ** 20)], "--prompt-len="),
    "json_under_a_file": (["--adapters", "8", "--json", "{tmp}/notes/out.json"], "which is not a directory"),
    "json_is_a_directory": (["--adapters", "8", "--json", "{tmp}/shelf"], "is a directory; name a file"),
    "plot_on_a_pseudo_file_system": (["--adapters", "8", "--plot", "/proc/lorazor-slots.png"],
                                     "on a file system without storage"),
}


@pytest.mark.parametrize("case", sorted(CAPACITY_MISTAKES))
def test_capacity_mistake_is_one_line(tmp_path: Path, capsys, case: str) -> None:
    args, fragment = CAPACITY_MISTAKES[case]
    bundle = tiny_bundle(tmp_path / "bundle")
    (tmp_path / "notes").write_text("mine")
    (tmp_path / "shelf").mkdir()
    before = digest(tmp_path)
    argv = ["--bundle", str(bundle), *QUICK, *(a.format(tmp=tmp_path) for a in args)]
    assert exit_code(lambda: capacity.main(argv)) == 2
    assert_one_error_line(capsys.readouterr().err, fragment)
    assert digest(tmp_path) == before


BAD_RELEASE_POINTS = {  # stats['release_points'] a bundle may hold, each refused by name
    "negative_count": {"r": [1], "count": [-1], "never": 2},
    "counts_fewer_than_points": {"r": [1, 2], "count": [1], "never": 0},
    "nothing_counted": {"r": [1], "count": [0], "never": 0},
    "not_an_object": [1, 2],
    "negative_point": {"r": [-3], "count": [1], "never": 0},
    "point_not_an_integer": {"r": ["a"], "count": [1], "never": 0},
    "never_missing": {"r": [1], "count": [1]},
}


@pytest.mark.parametrize("case", sorted(BAD_RELEASE_POINTS))
def test_capacity_refuses_malformed_release_points(tmp_path: Path, capsys, case: str) -> None:
    bundle = tiny_bundle(tmp_path / "bundle", BAD_RELEASE_POINTS[case])
    assert exit_code(lambda: capacity.main(["--bundle", str(bundle), "--adapters", "4", *QUICK])) == 2
    assert_one_error_line(capsys.readouterr().err, "adapter 'p': stats['release_points'] is not")


def test_capacity_with_good_release_points_runs(tmp_path: Path, capsys) -> None:
    bundle = tiny_bundle(tmp_path / "bundle", {"r": [1, 4], "count": [3, 1], "never": 4})
    assert capacity.main(["--bundle", str(bundle), "--adapters", "4", *QUICK]) == 0
    assert "max_loras needed with release" in capsys.readouterr().out
