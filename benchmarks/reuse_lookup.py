"""Reuse lookups as the ledger grows: a new job matched against many earlier answers.

Builds a SQLite ledger holding --earlier done answers (loaded through the ledger's own ingest
as jobs of 1M items, then marked done under one answer spec by a bulk update), loads a new
job of --items items of which --hit (98%) repeat earlier requests, and times the reuse pass
(`Ledger.prepare_reuse`: dedup marks, the indexed lookup, the copies). The baseline, in the
same run, is loading that new job (the ingest of the same items), so the figure is also a
ratio: what matching costs against what loading costs.

    python benchmarks/reuse_lookup.py [--earlier 10000000] [--items 1000000] [--hit 0.98]
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from sqlalchemy import update

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from batchrun.inputs import InputItem  # noqa: E402
from batchrun.ledger import Ledger  # noqa: E402
from batchrun.ledger.schema import items  # noqa: E402

SPEC = "a" * 64
BODY = b'{"messages":[{"role":"user","content":"x"}]}'
JOB_SIZE = 1_000_000


def lines(first: int, count: int) -> Iterator[InputItem]:
    for n in range(first, first + count):
        digest = hashlib.sha256(n.to_bytes(8, "little")).hexdigest()
        yield InputItem(n - first + 1, f"i{n}", "chat", BODY, digest, None)


def load(ledger: Ledger, name: str, first: int, count: int) -> float:
    started = time.perf_counter()
    ledger.create_job(
        name,
        input_path=name,
        input_digest=name,
        spec={},
        lines=lines(first, count),
        skip_invalid=False,
    )
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--earlier", type=int, default=10_000_000)
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--hit", type=float, default=0.98)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ledger = Ledger(f"sqlite:///{tmp}/ledger.db")
        started = time.perf_counter()
        for k, first in enumerate(range(0, args.earlier, JOB_SIZE)):
            count = min(JOB_SIZE, args.earlier - first)
            load(ledger, f"night{k}", first, count)
            with ledger.engine.begin() as conn:
                done = {"status": "done", "answer_spec": SPEC, "output": "answer"}
                conn.execute(update(items).where(items.c.job == f"night{k}").values(**done))
        built = time.perf_counter() - started
        # the new job: its first `hit` share repeats earlier requests, the rest is new
        repeats = int(args.items * args.hit)
        offset = max(0, args.earlier - repeats)
        ingest = load(ledger, "tonight", offset, args.items)
        started = time.perf_counter()
        waiting, reused = ledger.prepare_reuse("tonight", SPEC, reuse_since=None)
        lookup = time.perf_counter() - started
        size = Path(tmp, "ledger.db").stat().st_size
    print(f"ledger: {args.earlier:,} earlier answers ({size / 1e9:.1f} GB), built in {built:.0f} s")
    print(f"new job: {args.items:,} items loaded in {ingest:.1f} s (the baseline)")
    print(
        f"reuse pass: {reused:,} reused, {waiting:,} waiting, {lookup:.1f} s: "
        f"{lookup / args.items * 1000 * 1000:.2f} ms per 1,000 items, "
        f"{lookup / ingest:.2f}x the load"
    )


if __name__ == "__main__":
    main()
