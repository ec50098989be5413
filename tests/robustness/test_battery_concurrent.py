"""Two runs on one run directory: one writer at a time (calibrate/rundir_access.py), and a stage
marker is never trusted without the outputs its stage must write.

Two `python -m calibrate` processes started together on a directory where one stage is to run
(every stage in turn) end with at most one refusal, a single line naming the holder's PID, and
the next run finds everything cached with outputs identical to a lone run's. The lock is
checked deterministically too: held by this process, a run is refused and changes nothing; held
by a process that is then killed, the kernel has released it."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.robustness.kill_resume import KILL_CONFIG, STAGE_ORDER, run_contents
from calibrate.rundir import RunDir
from calibrate.rundir_access import RunDirError
from tests.calibrate.test_pipeline import cli, run
from tests.conftest import ROOT
from tests.robustness.helpers import digest


def _copy(src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(src, tmp_path / "run"))


def _refusal(err: str, pid: int) -> bool:
    lines = [line for line in err.splitlines() if line.strip()]
    return len(lines) == 1 and re.fullmatch(rf"error: run directory .* is in use by another run \(PID {pid}\); "
                                            r"wait for it to finish, or choose another hydra\.run\.dir\.", lines[0]) \
        is not None


@pytest.mark.parametrize("stage", STAGE_ORDER)
def test_two_runs_together_then_the_next_run_equals_a_lone_run(tmp_path: Path, small_run, capsys, stage: str) -> None:
    run_dir = _copy(small_run[0], tmp_path)
    (run_dir / "stages" / f"{stage}.json").unlink()  # `stage` is to run; the others are cached
    procs = [cli(run_dir, *KILL_CONFIG) for _ in range(2)]
    ends = [(p.pid, *p.communicate(timeout=600), p.returncode) for p in procs]
    assert sorted(rc for *_, rc in ends) in ([0, 0], [0, 2]), ends
    assert any(f"[{stage}] running" in out for _, out, _, rc in ends if rc == 0), ends
    for i, (_, _, err, rc) in enumerate(ends):
        if rc == 2:  # refused while the other run held the directory
            assert _refusal(err, ends[1 - i][0]), err
    run(run_dir, KILL_CONFIG)  # the next run
    out = capsys.readouterr().out
    assert all(f"[{s}] cached" in out for s in STAGE_ORDER), out
    assert run_contents(run_dir) == small_run[1]


def test_a_run_on_a_directory_this_process_holds_is_refused_and_changes_nothing(tmp_path: Path, small_run) -> None:
    run_dir = _copy(small_run[0], tmp_path)
    held = RunDir(run_dir)
    with held.locked():
        before = digest(run_dir)
        proc = cli(run_dir, *KILL_CONFIG, "export.rule=P25")
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 2 and _refusal(err, os.getpid()), err
        assert digest(run_dir) == before
        with pytest.raises(RunDirError, match=f"in use by another run \\(PID {os.getpid()}\\)"):
            with RunDir(run_dir).locked():
                pass
    with held.locked():  # released on leaving the block: taken again at once
        pass


HOLD = "from calibrate.rundir import RunDir; import sys, time\nwith RunDir(sys.argv[1]).locked():\n" \
       "    print('held', flush=True); time.sleep(600)\n"


def test_a_killed_holder_leaves_no_stale_lock(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "run")], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(RunDirError, match=f"PID {holder.pid}"):
            with RunDir(tmp_path / "run").locked():
                pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with RunDir(tmp_path / "run").locked():  # the kernel released the killed holder's lock
        assert (tmp_path / "run" / ".lock").read_text() == f"{os.getpid()}\n"
    assert (tmp_path / "run" / ".lock").read_text() == ""  # released: nobody's PID


# the directory locked, no PID recorded: a holder between its lock and its record, or one whose record
# was emptied as it let go
BARE_HOLD = "import fcntl, os, sys, time\nfd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)\n" \
            "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(float(sys.argv[2]))\n"


def _bare_holder(run_dir: Path, seconds: float) -> subprocess.Popen:
    run_dir.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", BARE_HOLD, str(run_dir), str(seconds)], stdout=subprocess.PIPE,
                              text=True)
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    return holder


def test_a_holder_that_lets_go_while_the_pid_is_awaited_hands_the_lock_over(tmp_path: Path) -> None:
    """Two runs together, the first short: the second, refused at first, waits for the holder's PID
    and takes the lock once the holder lets go, instead of refusing with no PID to name."""
    holder = _bare_holder(tmp_path / "run", 0.5)
    try:
        with RunDir(tmp_path / "run").locked():
            assert holder.poll() is not None  # taken only once the holder had gone
            assert (tmp_path / "run" / ".lock").read_text() == f"{os.getpid()}\n"
    finally:
        holder.kill()
        holder.wait()


def test_a_holder_that_never_records_its_pid_is_named_so(tmp_path: Path) -> None:
    holder = _bare_holder(tmp_path / "run", 60)
    try:
        with pytest.raises(RunDirError, match=r"in use by another run \(a process that has not written its PID\)"):
            with RunDir(tmp_path / "run").locked():
                pass
    finally:
        holder.kill()
        holder.wait()


# --- a marker whose outputs do not satisfy its stage ------------------------------------------

def _drop_from_marker(run_dir: Path, stage: str, rel: str) -> None:
    """What two unlocked writers could leave: ``rel`` gone, and gone from the marker's list too."""
    marker = run_dir / "stages" / f"{stage}.json"
    m = json.loads(marker.read_text())
    del m["outputs"][rel]
    marker.write_text(json.dumps(m))
    (run_dir / rel).unlink()


@pytest.mark.parametrize("stage,rel", [("export", "bundle/manifest.json"), ("export", "export/selection.csv"),
                                       ("sweep", "sweep/candidates.csv"), ("test", "test/realized.csv")])
def test_marker_without_its_stage_outputs_is_recomputed_not_cached(tmp_path: Path, small_run, capsys, stage: str,
                                                                   rel: str) -> None:
    """The directory the issue found: a marker under the right fingerprint that lists neither the
    bundle nor the export tables, which every later run reported cached (and then failed on)."""
    run_dir = _copy(small_run[0], tmp_path)
    _drop_from_marker(run_dir, stage, rel)
    run(run_dir, KILL_CONFIG)
    out = capsys.readouterr().out
    assert f"[{stage}] recomputing: its marker records no {rel}" in out, out
    assert run_contents(run_dir) == small_run[1]


def test_a_stage_that_skips_an_output_publishes_nothing(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    with run.locked():
        run.begin("test")
        run.out("test", "other.csv").write_text("x")
        with pytest.raises(RuntimeError, match=r"finished without writing \['test/realized.csv'\]"):
            run.commit("test", "fp", {}, required=["test/realized.csv"])
    assert not (tmp_path / "run" / "stages").exists() and not (tmp_path / "run" / "test").exists()
