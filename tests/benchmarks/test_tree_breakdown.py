"""The sweep-tree breakdown: tokens per adapter split by profiled and learned-only release points."""
import pytest

from benchmarks.sweep import tree_breakdown as tb
from predictors.candidates import Candidates
from predictors.sweep import RequestTree, save_trees


def _trees():
    return [RequestTree("u1", "a", 10, 1, [], {0: (0, 9), 1: (1, 12), 3: (1, 10)}),
            RequestTree("u2", "a", 6, 0, [], {1: (0, 2)}),
            RequestTree("u3", "b", 4, 1, [], {2: (1, 4)})]


def test_breakdown_splits_profiled_and_learned_only_branches():
    a, b = tb.breakdown(_trees(), ks=[0, 1, 2])
    assert (a.adapter, a.requests, a.on) == ("a", 2, 16)
    # tokens past the shared r+1: r=0: 9-1, r=1: 12-2 and 2-2, r=3: 10-4
    assert a.profiled == 8 + 10 + 0 and a.learned_only == 6
    assert a.by_r == {0: (8, 1), 1: (10, 2), 3: (6, 1)}
    assert (b.on, b.profiled, b.learned_only) == (4, 1, 0)
    assert a.generations(a.on + a.profiled + a.learned_only) == (16 + 18 + 6) / 16


def test_cli_on_a_run_directory(tmp_path, capsys):
    (tmp_path / "sweep").mkdir()
    (tmp_path / "heads").mkdir()
    save_trees(tmp_path / "sweep" / "trees.parquet", _trees())
    Candidates({}, ks=(0, 1, 2)).save(tmp_path / "heads" / "candidates.json")
    assert tb.main(["--run", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| a | 2 | 16 | 18 (1.12) | 6 (0.38) | 2.50 |" in out
    assert "r=0*: 8 (0.50), 1, r=1*: 10 (0.62), 2, r=3: 6 (0.38), 1" in out


def test_cli_refuses_a_run_without_a_sweep(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        tb.main(["--run", str(tmp_path)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "has no sweep/trees.parquet" in err
