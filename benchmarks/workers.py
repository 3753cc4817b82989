"""Several workers on one job: items/s with 1, 2 and 4 worker processes, on SQLite and PostgreSQL.

Two measures, each against 1 worker in the same run (the machine is shared and noisy):

  ledger   each process only claims and records (batches of 64, no HTTP): what the ledger
           itself allows, claims and commits per second;
  job      each process is `batchrun resume JOB` against the zero-latency server
           (fast_server.py), not streamed, 32 in flight: the whole worker.

PostgreSQL is a throwaway cluster made with the machine's initdb (tests/postgres.py), or the
server --postgres URL names (a database the benchmark may fill). Needs psycopg (`.[postgres]`).

    python benchmarks/workers.py [--items 20000] [--workers 1,2,4] [--engines sqlite,postgresql]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from batchrun.ledger import Ledger  # noqa: E402
from tests.integration.helpers import cli_command  # noqa: E402

BATCH = 64

LEDGER_WORKER = """
import sys, time, uuid
from batchrun.ledger import ItemResult, Ledger
url, job = sys.argv[1], sys.argv[2]
led, me = Ledger(url), uuid.uuid4().hex
led.join(job, me, ttl=60)
claims = commits = 0
while True:
    batch = led.claim(job, me, 64, lease_ttl=60)
    if not batch:
        break
    claims += 1
    commits += led.record(job, me, [ItemResult(c.line, "done", 1, output="x") for c in batch]) > 0
led.release(job, me)
print(claims, commits)
"""


@contextlib.contextmanager
def ledger_urls(engine: str, work: Path, given: str | None) -> Iterator[str]:
    """A maker of fresh ledger URLs, one per measurement."""
    if engine == "sqlite":
        yield f"sqlite:///{work}/ledger-{{}}.db"
        return
    from tests.postgres import throwaway_server

    if given:
        yield given
        return
    with throwaway_server() as url:
        yield url


def fresh(url_pattern: str, engine: str) -> str:
    if engine == "sqlite":
        return url_pattern.format(uuid.uuid4().hex[:8])
    import psycopg

    name = f"bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(url_pattern.replace("+psycopg", ""), autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return url_pattern.rsplit("/", 1)[0] + f"/{name}"


def load(url: str, work: Path, items: int) -> Path:
    """A job named `bench` of `items` chat requests, loaded and not run."""
    path = work / "bench.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Say {i}."}) + "\n" for i in range(items)))
    home = work / f"home-{uuid.uuid4().hex[:8]}"
    submit = ("submit", str(path), "--job", "bench", "--no-run", "--quiet")
    done = subprocess.run(
        cli_command(home, "--ledger", url, *submit), capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(f"loading failed: {done.stderr}")
    return home


def ledger_only(url: str, workers: int) -> tuple[float, int, int]:
    started = time.perf_counter()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", LEDGER_WORKER, url, "bench"], stdout=subprocess.PIPE, text=True
        )
        for _ in range(workers)
    ]
    outs = [p.communicate()[0].split() for p in procs]
    wall = time.perf_counter() - started
    return wall, sum(int(o[0]) for o in outs), sum(int(o[1]) for o in outs)


def whole_job(url: str, home: Path, base_url: str, workers: int) -> float:
    flags = ("--base-url", base_url, "--model", "fast-1", "--concurrency", "32")
    command = cli_command(home, "--ledger", url, "resume", "bench", *flags, "--no-stream", "-q")
    started = time.perf_counter()
    procs = [subprocess.Popen(command, stderr=subprocess.PIPE, text=True) for _ in range(workers)]
    for p in procs:
        p.communicate()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=20_000)
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--engines", default="sqlite,postgresql")
    parser.add_argument("--postgres", help="a PostgreSQL admin URL instead of a throwaway one")
    args = parser.parse_args()
    counts = [int(n) for n in args.workers.split(",")]
    server = subprocess.Popen(
        [sys.executable, str(HERE / "fast_server.py")], stdout=subprocess.PIPE, text=True
    )
    assert server.stdout is not None
    base_url = server.stdout.readline().split()[-1]
    print(f"{args.items} items; workers are processes on this machine (2 cores here)")
    print(
        f"{'engine':10} {'measure':7} {'workers':>7} {'wall':>7} {'items/s':>8} "
        f"{'claims/s':>9} {'commits/s':>9} {'vs 1':>6}"
    )
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            for engine in args.engines.split(","):
                with ledger_urls(engine, work, args.postgres) as pattern:
                    for measure in ("ledger", "job"):
                        base = None
                        for n in counts:
                            url = fresh(pattern, engine)
                            home = load(url, work, args.items)
                            if measure == "ledger":
                                wall, claims, commits = ledger_only(url, n)
                            else:
                                wall, claims, commits = whole_job(url, home, base_url, n), 0, 0
                            done = Ledger(url).counts("bench")["done"]
                            assert done == args.items, (engine, measure, n, done)
                            rate = args.items / wall
                            base = base or rate
                            rates = (
                                f"{claims / wall:9.0f} {commits / wall:9.0f}"
                                if claims
                                else (f"{'-':>9} {'-':>9}")
                            )
                            print(
                                f"{engine:10} {measure:7} {n:7d} {wall:6.2f}s {rate:8.0f} "
                                f"{rates} {rate / base:5.2f}x"
                            )
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
