"""Two checkouts of batchrun, alternated, against the zero-latency server: is a change faster?

This machine's speed drifts by a quarter between runs minutes apart, so a change is measured
against the code before it in the same run: the two trees take turns (ABBA order, so neither
always runs first), and each round's ratio is taken between runs a few seconds apart. It
prints the medians of each tree, and the median of the paired ratios (new / old: below 1 is
faster). A checkout of the old code: `git worktree add /tmp/old REV`.

    python benchmarks/ab_trees.py OLD_TREE NEW_TREE [--rounds 8] [--requests 4000]
        [--modes no-stream,stream] [--concurrency 32] [--url URL]

With `--url`, a server already running (a real engine) answers instead: requests ask for at
most 64 tokens.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from client_cost import CHILD_ENV, start_server, write_requests


def one_job(
    tree: Path, url: str, work: Path, mode: str, concurrency: int
) -> tuple[float, float, float]:
    """(wall, CPU, sending) seconds of one `batchrun submit` run from `tree`'s sources."""
    job = f"ab{time.monotonic_ns()}"
    # A home of its own per run: a ledger grown by earlier runs slows every run after them.
    command = [sys.executable, "-m", "batchrun", "--home", str(work / job), "submit"]
    command += [str(work / "requests.jsonl"), "--job", job, "--base-url", url]
    command += ["--model", "fast-1", "--concurrency", str(concurrency), "--quiet"]
    command.append(f"--{mode}")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run(command, cwd=tree, env=CHILD_ENV, check=True, capture_output=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    log = (work / job / "logs" / f"{job}.log").read_text().splitlines()
    stopped = next(e for e in map(json.loads, log) if e["event"] == "run_stopped")
    return wall, cpu, stopped["elapsed_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--modes", default="no-stream,stream")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument(
        "--url", help="a server already running (a real engine's /v1 URL) instead of fast_server"
    )
    args = parser.parse_args()
    trees, modes = [args.old.resolve(), args.new.resolve()], args.modes.split(",")
    server, url = (None, args.url) if args.url else start_server(30)
    runs: dict[tuple[int, str], list[tuple[float, float, float]]] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            write_requests(work, args.requests)
            for tree in trees:  # bytecode written, as an installed package has it
                subprocess.run(
                    [sys.executable, "-m", "batchrun", "--version"],
                    cwd=tree,
                    env=CHILD_ENV,
                    check=True,
                    capture_output=True,
                )
            for r in range(args.rounds):
                for mode in modes:
                    for i in (0, 1) if r % 2 == 0 else (1, 0):
                        run = one_job(trees[i], url, work, mode, args.concurrency)
                        runs.setdefault((i, mode), []).append(run)
    finally:
        if server is not None:
            server.terminate()
            server.wait()
    report(runs, modes, args)


def report(runs: dict, modes: list[str], args: argparse.Namespace) -> None:
    where = args.url or "the zero-latency server, 30 tokens an answer"
    print(f"{args.requests} chat requests, {args.concurrency} in flight, {where}; ", end="")
    print(f"{args.rounds} rounds")
    print(f"{'mode':10} {'tree':4} {'wall':>6} {'CPU':>6} {'sending':>8} {'run req/s':>9}")
    for mode in modes:
        for i, name in enumerate(("old", "new")):
            wall, cpu, run = (statistics.median(x[k] for x in runs[(i, mode)]) for k in range(3))
            rate = args.requests / run
            print(f"{mode:10} {name:4} {wall:5.2f}s {cpu:5.2f}s {run:7.2f}s {rate:9.0f}")
        pairs = list(zip(runs[(0, mode)], runs[(1, mode)], strict=True))
        ratio = [statistics.median(new[k] / old[k] for old, new in pairs) for k in range(3)]
        print(
            f"{mode:10} new / old, paired: wall {ratio[0]:.3f}  CPU {ratio[1]:.3f}  "
            f"sending {ratio[2]:.3f}"
        )


if __name__ == "__main__":
    main()
