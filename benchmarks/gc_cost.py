"""What Python's cyclic collector costs a job: the command's own settings against the default.

Runs the same `batchrun submit` against the zero-latency server (fast_server.py) in child
processes that time every collection (gc.callbacks), once through the CLI group with Python's
default collector settings and once through the `batchrun` command's entry (which freezes
start-up's objects and collects the young generation less often), alternating, and prints the
collector's seconds per job, collections by generation, and the ratio.

    python benchmarks/gc_cost.py [--requests 5000] [--repeat 3] [--no-stream]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from client_cost import CHILD_ENV, start_server, write_requests

# The child: times each collection, then runs the CLI one way or the other.
CHILD = """
import atexit, gc, json, sys, time
spent, counts, started = [0.0], [0, 0, 0], []
def timed(phase, info):
    if phase == "start":
        started.append(time.perf_counter())
    else:
        spent[0] += time.perf_counter() - started.pop()
        counts[info["generation"]] += 1
gc.callbacks.append(timed)
atexit.register(lambda: print(json.dumps({"seconds": spent[0], "collections": counts})))
how, sys.argv = sys.argv[1], ["batchrun", *sys.argv[2:]]
if how == "entry":
    from batchrun.__main__ import entry
    entry()
else:
    from batchrun.cli import main
    main()
"""


def job(how: str, run: int, url: str, work: Path, args: argparse.Namespace) -> dict:
    command = [sys.executable, "-c", CHILD, how, "--home", str(work / "home"), "submit"]
    command += [str(work / "requests.jsonl"), "--base-url", url, "--model", "fast-1", "--quiet"]
    command += ["--concurrency", "32", "--no-reuse", "--job", f"gc-{how}-{run}"]
    command += ["--no-stream"] if args.no_stream else []
    done = subprocess.run(command, env=CHILD_ENV, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-stream", action="store_true")
    args = parser.parse_args()
    server, url = start_server(30)
    seen: dict[str, list[dict]] = {"default": [], "entry": []}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            write_requests(work, args.requests)
            for run in range(args.repeat):
                for how in seen:
                    seen[how].append(job(how, run, url, work, args))
    finally:
        server.terminate()
        server.wait()
    mode = "not streamed" if args.no_stream else "streamed"
    print(f"{args.requests} requests, {mode}, 32 in flight; median of {args.repeat}")
    medians = {}
    for how, runs in seen.items():
        medians[how] = statistics.median(r["seconds"] for r in runs)
        counts = runs[-1]["collections"]
        print(f"{how:8} collector {medians[how]:.3f} s a job; collections by generation {counts}")
    print(f"entry / default: {medians['entry'] / medians['default']:.2f}")


if __name__ == "__main__":
    main()
