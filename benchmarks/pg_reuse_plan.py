"""PostgreSQL: the reuse step of a freshly loaded job, with and without ANALYZE after the load.

Until autovacuum analyses `items`, PostgreSQL's planner takes a just-loaded job for a few rows,
and reuse's one UPDATE ... FROM over it (every worker runs it at start, under the job's lock)
joins by nested loops: its time grows with the square of the job. The ledger now ends a load
with `ANALYZE items` (Dialect.loaded). This loads the same N unique lines twice, each time into
a new database on a throwaway server (tests/postgres.py, PostgreSQL 15's binaries), once as a
load used to leave it (the baseline) and once as it leaves it now, and times prepare_reuse.

    python benchmarks/pg_reuse_plan.py [--lines 10000]
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

from sqlalchemy import Engine

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchrun.inputs import InputItem
from batchrun.ledger import Ledger
from batchrun.ledger.dialect import Postgres
from tests.postgres import fresh_database, throwaway_server


class AsBefore(Postgres):
    """The baseline: a load that leaves the planner's statistics as they were."""

    def loaded(self, engine: Engine) -> None:
        pass


def timed_reuse(url: str, lines: int, *, analyse: bool) -> float:
    ledger = Ledger(url)
    if not analyse:
        ledger.dialect = AsBefore()
    items = [
        InputItem(n, f"i{n}", "chat", b"{}", hashlib.sha256(b"%d" % n).hexdigest(), None)
        for n in range(1, lines + 1)
    ]
    ledger.create_job(
        "night", input_path="in", input_digest="d", spec={}, lines=items, skip_invalid=False
    )
    started = time.perf_counter()
    ledger.prepare_reuse("night", "a" * 64, reuse_since=None)
    took = time.perf_counter() - started
    ledger.close()
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lines", type=int, default=10_000)
    args = parser.parse_args()
    with throwaway_server() as server:
        with fresh_database(server) as url:
            before = timed_reuse(url, args.lines, analyse=False)
        with fresh_database(server) as url:
            after = timed_reuse(url, args.lines, analyse=True)
    print(f"reuse step on a fresh job of {args.lines:,} lines (PostgreSQL):")
    print(f"  as a load left it (baseline) {before:8.2f} s")
    print(f"  after ANALYZE at the load    {after:8.2f} s")
    print(f"  baseline / now: {before / max(after, 1e-6):,.0f}x")


if __name__ == "__main__":
    main()
