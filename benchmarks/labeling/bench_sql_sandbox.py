"""SQL sandbox limits (labeling/evaluators/sql.py): stop time against the timeout, byte cap, start cost.

Stop time: runaway queries of three kinds — an endless recursive CTE (the worker's interrupt
stops it), one slow expression (a few built-in calls, fewer VM instructions than the
interrupt's check interval: only the kill stops it) and a per-row slow built-in — run with
several timeouts. A query's stop time runs from sending it to the worker until the caller has
the error (interrupt, or kill at 1.25× the timeout); it is divided by the timeout and the worst
ratio reported (acceptance: ≤ 1.5). ``call worst x`` is the whole call (private copy and its
opening included). A killed worker's replacement boots outside any timeout
(``SqlSandbox.start`` before each call); its longest wait is ``restart ms``. Byte cap: results
above the cap (many rows, one large string, one large blob) must fail, and the bytes read from
the worker are reported against the cap. Start cost: a query on a new worker against one on a
warm worker.

  python -m benchmarks.labeling.bench_sql_sandbox [--timeouts 0.1 0.25 0.5 1 2] [--repeat 5]
"""
from __future__ import annotations

import argparse
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

from labeling.evaluators.sql import QueryTimeout, ResultTooLarge, SqlSandbox
from serve_bridge.command_line import Parser, number

RUNAWAY = {
    "endless CTE": "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c",
    "one slow expression": ("SELECT length(replace(replace(replace(replace(printf('%.*c', 150000000, 'a'), "
                            "'a', 'b'), 'b', 'c'), 'c', 'd'), 'd', 'e'))"),
    "slow built-in per row": ("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 1000) "
                              "SELECT sum(length(replace(printf('%.*c', 2000000 + x, 'a'), 'a', 'bc'))) FROM c"),
}
OVERSIZED = {
    "many rows": "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT x, 'row' FROM c",
    "one large string": "SELECT printf('%.*c', 50000000, 'x')",
    "one large blob": "SELECT randomblob(50000000)",
}


def make_db(path: Path) -> Path:
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE t (x INTEGER)")
    conn.executemany("INSERT INTO t VALUES (?)", [(i,) for i in range(100)])
    conn.commit()
    conn.close()
    return path


def stop_times(sandbox: SqlSandbox, db: Path, timeouts: list[float], repeat: int) -> float:
    """Print the worst and median stop/timeout ratio per query kind and timeout, and the longest
    wait for a replacement worker after a kill; return the worst ratio."""
    worst = 0.0
    print(f"{'query':<24}{'timeout s':>10}{'worst x':>9}{'median x':>10}{'call worst x':>14}{'killed':>8}"
          f"{'restart ms':>12}")
    for name, sql in RUNAWAY.items():
        for timeout in timeouts:
            ratios, calls, killed, restart = [], [], 0, 0.0
            for _ in range(repeat):
                start = time.monotonic()
                sandbox.start()  # a replacement worker boots before the timed call, as between requests
                restart = max(restart, time.monotonic() - start)
                start = time.monotonic()
                try:
                    sandbox.execute(db, [sql], timeout_s=timeout, max_bytes=1 << 27)
                    raise SystemExit(f"{name}: finished within {timeout} s; make it slower")
                except QueryTimeout as err:
                    killed += "killed" in str(err)
                calls.append((time.monotonic() - start) / timeout)
                ratios.append(sandbox.last_query_s / timeout)
            worst = max(worst, max(ratios))
            print(f"{name:<24}{timeout:>10g}{max(ratios):>9.3f}{statistics.median(ratios):>10.3f}{max(calls):>14.3f}"
                  f"{killed:>5}/{repeat}{1e3 * restart:>12.1f}")
    return worst


def byte_cap(sandbox: SqlSandbox, db: Path, caps: list[int]) -> int:
    """Print the bytes read from the worker per oversized query and cap; return the largest excess
    over the cap (≤ 0: nothing above the cap reached this process)."""
    excess = -(1 << 62)
    print(f"\n{'query':<24}{'cap bytes':>12}{'read bytes':>12}  error")
    for name, sql in OVERSIZED.items():
        for cap in caps:
            try:
                sandbox.execute(db, [sql], timeout_s=30.0, max_bytes=cap)
                raise SystemExit(f"{name}: fit in {cap} bytes")
            except ResultTooLarge as err:
                read = sandbox.last_reply_bytes
                excess = max(excess, read - cap)
                print(f"{name:<24}{cap:>12}{read:>12}  {err}")
    return excess


def start_cost(db: Path, repeat: int) -> None:
    """Median wall time of one query on a new worker and on a warm one."""
    cold, warm = [], []
    for _ in range(repeat):
        sandbox = SqlSandbox()
        start = time.perf_counter()
        sandbox.execute(db, ["SELECT count(*) FROM t"])
        cold.append(time.perf_counter() - start)
        start = time.perf_counter()
        sandbox.execute(db, ["SELECT count(*) FROM t"])
        warm.append(time.perf_counter() - start)
        sandbox.stop()
    print(f"\none query, new worker: median {1e3 * statistics.median(cold):.1f} ms; warm worker: median "
          f"{1e3 * statistics.median(warm):.1f} ms (private copy included; {repeat} runs)")


def main() -> None:
    ap = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--timeouts", type=number("positive_number"), nargs="+", default=[0.1, 0.25, 0.5, 1.0, 2.0])
    ap.add_argument("--repeat", type=number("positive_int"), default=5)
    ap.add_argument("--caps", type=number("positive_int"), nargs="+", default=[4096, 1 << 20])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        db = make_db(Path(tmp) / "bench.sqlite")
        sandbox = SqlSandbox()
        sandbox.execute(db, ["SELECT 1"])  # a started worker, as in a running evaluation
        worst = stop_times(sandbox, db, args.timeouts, args.repeat)
        excess = byte_cap(sandbox, db, args.caps)
        sandbox.stop()
        start_cost(db, max(args.repeat, 10))
    print(f"\nworst stop time: {worst:.3f}x the timeout (acceptance ≤ 1.5); bytes read beyond the cap: "
          f"{max(excess, 0)} (largest read minus cap: {excess})")


if __name__ == "__main__":
    main()
