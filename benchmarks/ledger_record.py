"""Recording results: the ledger's statement run by the driver against SQLAlchemy's executemany.

On a running job the ledger's thread records each group of results in one transaction, and
all the Python it runs there holds the GIL that the sending thread needs. This loads a job,
claims every item, and records them in groups of --group, alternating between two ways in
the same run: the same statement through SQLAlchemy's executemany, built for the call, with
a dict of parameters per row (as `Ledger.record` ran before), and `Ledger.record` as it is
(compiled once, rows handed to the driver as tuples: batchrun/ledger/driver.py; it also
looks for repeated lines waiting for the results, which the other way does not). It prints
the recording thread's CPU per row for each, and their ratio.

    python benchmarks/ledger_record.py [--items 12800] [--group 64] [--url sqlite:///...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from batchrun.inputs import InputItem  # noqa: E402
from batchrun.ledger import ItemResult, Ledger  # noqa: E402
from batchrun.ledger.rows import recording, result_row  # noqa: E402

BODY = b'{"messages":[{"role":"user","content":"Rewrite item 1."}]}'
OWNER = "w1"


def result(line: int) -> ItemResult:
    return ItemResult(
        line=line,
        status="done",
        attempts=1,
        latency_ms=5.0,
        ttft_ms=1.0,
        prompt_tokens=12,
        completion_tokens=30,
        finish_reason="stop",
        output="word " * 30,
        answered_by="local",
        answer_spec="a" * 64,
    )


def record_before(ledger: Ledger, job: str, results: list[ItemResult]) -> None:
    """The way before: the statement built for the call, SQLAlchemy's executemany of a dict of
    parameters per row."""
    stmt, names = recording(batched=False)
    head = (job, OWNER, time.time())
    params = [dict(zip(names, result_row(head, r, None), strict=True)) for r in results]
    with ledger.engine.begin() as conn:
        assert conn.execute(stmt, params).rowcount == len(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=12800)
    parser.add_argument("--group", type=int, default=64)
    parser.add_argument("--url", help="a ledger URL (default: a new SQLite file)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ledger = Ledger(args.url or f"sqlite:///{tmp}/ledger.db")
        job = f"bench-{time.time_ns()}"
        lines = (InputItem(n, f"i{n}", "chat", BODY, f"{n:064x}", None) for n in range(args.items))
        ledger.create_job(
            job, input_path="in", input_digest="x", spec={}, lines=lines, skip_invalid=False
        )
        claimed = []
        while batch := ledger.claim(job, OWNER, 1000, lease_ttl=3600):
            claimed += [c.line for c in batch]
        groups = [claimed[i : i + args.group] for i in range(0, len(claimed), args.group)]
        took: dict[str, list[float]] = {"before": [], "now": []}
        for n, group in enumerate(groups):
            results = [result(line) for line in group]
            way = "before" if n % 4 in (0, 3) else "now"  # ABBA: neither always first
            start = time.thread_time()
            if way == "before":
                record_before(ledger, job, results)
            else:
                assert ledger.record(job, OWNER, results) == len(results)
            took[way].append((time.thread_time() - start) / len(results) * 1e6)
        ledger.close()
    before, now = (statistics.median(took[w]) for w in ("before", "now"))
    print(f"{args.items} results in groups of {args.group}; CPU of the recording thread a row")
    print(f"SQLAlchemy executemany (before)  {before:6.1f} us")
    print(f"driver executemany (now)         {now:6.1f} us")
    print(f"now / before: {now / before:.2f}")


if __name__ == "__main__":
    main()
