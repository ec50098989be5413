"""map_batches: every index once, values as computed here, a failing or dying worker fails the call."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from labeling.engines.batch_workers import WorkerError, available_cores, map_batches, resolve_workers


def _slow_square(i: int) -> tuple[int, int, torch.Tensor]:
    time.sleep(0.05)  # long enough that every worker claims some indices
    return i * i, os.getpid(), torch.full((3,), float(i))


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_every_index_once_with_its_value(workers: int) -> None:
    out = dict(map_batches(_slow_square, 12, workers))
    assert sorted(out) == list(range(12))
    assert all(out[i][0] == i * i and torch.equal(out[i][2], torch.full((3,), float(i))) for i in out)
    assert len({pid for _, pid, _ in out.values()}) == workers  # the work was shared


def test_more_workers_than_batches_and_no_batches() -> None:
    assert dict(map_batches(lambda i: i + 1, 2, 8)) == {0: 1, 1: 2}
    assert list(map_batches(lambda i: i, 0, 4)) == []


def test_an_error_in_a_worker_is_raised_here() -> None:
    parent = os.getpid()

    def fn(i: int) -> int:
        time.sleep(0.2)
        if os.getpid() != parent:
            raise ValueError(f"bad batch {i}")
        return i

    with pytest.raises(WorkerError, match=r"ValueError: bad batch \d"):
        dict(map_batches(fn, 4, 2))


def test_a_worker_that_dies_is_reported() -> None:
    parent = os.getpid()

    def fn(i: int) -> int:
        time.sleep(0.2)
        if os.getpid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)
        return i

    with pytest.raises(WorkerError, match="died"):
        dict(map_batches(fn, 4, 2))


def test_auto_is_one_per_core_on_one_torch_thread(monkeypatch) -> None:
    monkeypatch.delenv("LORAZOR_HF_WORKERS", raising=False)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert resolve_workers("auto", torch.device("cpu")) == available_cores()
        torch.set_num_threads(2)
        assert resolve_workers("auto", torch.device("cpu")) == 1
    finally:
        torch.set_num_threads(threads)
    assert resolve_workers("3", torch.device("cpu")) == 3
    assert resolve_workers("auto", torch.device("cuda")) == 1


def test_the_environment_says_what_auto_means(monkeypatch) -> None:
    monkeypatch.setenv("LORAZOR_HF_WORKERS", "3")
    assert resolve_workers("auto", torch.device("cpu")) == 3
    assert resolve_workers("2", torch.device("cpu")) == 2  # an explicit number wins
    for bad in ("none", "0", "-2", "1.5", ""):  # not a whole number of workers: one clear error
        monkeypatch.setenv("LORAZOR_HF_WORKERS", bad)
        with pytest.raises(ValueError, match="LORAZOR_HF_WORKERS"):
            resolve_workers("auto", torch.device("cpu"))
        assert resolve_workers("2", torch.device("cpu")) == 2  # not read when a number is given
    monkeypatch.delenv("LORAZOR_HF_WORKERS")
    torch_threads = torch.get_num_threads()
    assert resolve_workers("auto", torch.device("cpu")) == (available_cores() if torch_threads == 1 else 1)
