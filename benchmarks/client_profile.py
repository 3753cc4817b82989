"""Where a batchrun job's CPU goes: a sampling profile of `batchrun submit`, in categories.

Runs one job against the zero-latency server (fast_server.py, another process) under py-spy
(`pip install py-spy`: a sampling profiler, so async code is not slowed the way cProfile
slows it), streamed and not, and attributes every sample of the main thread to the first of
these that its stack shows, innermost first:

  startup      imports and interpreter start
  ledger       SQLAlchemy and sqlite3 (claims, group commits, the results file)
  answers      SSE framing, JSON parsing, assembling the answer (backends/sse.py, answers.py,
               frames.py)
  http engine  batchrun's own (backends/http11.py and llhttp under it: request writing,
               response parsing, connection pool)
  httpx        httpx's Request/Response objects at the transport seam
  log+progress the job log and progress (progress.py)
  pacing       throttle, controller, limiter, retry policy, tenacity
  event loop   asyncio and anyio: task switches, streams, cancel scopes, sockets
  batchrun     the rest of batchrun's own code (sender, runner, backend glue)

    python benchmarks/client_profile.py [--requests 5000] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from client_cost import CHILD_ENV, start_server, write_requests

CATEGORIES = [  # (name, pattern on a frame's file), first match from the innermost frame
    ("startup", r"<frozen importlib|_find_and_load"),
    ("ledger", r"sqlalchemy/|sqlite3/|batchrun/ledger/|batchrun/outputs\.py"),
    ("answers", r"batchrun/backends/(sse|answers|frames)\.py"),
    ("http engine", r"batchrun/backends/http11\.py|httptools/"),
    ("httpx", r"httpx/"),
    ("log+progress", r"batchrun/progress\.py|tqdm/"),
    ("pacing", r"batchrun/(throttle|controller|evidence|limiter|retrying)\.py|tenacity/"),
    ("event loop", r"asyncio/|anyio/|selectors\.py|sniffio/"),
    ("batchrun", r"batchrun/"),
]


def category(frames: list[str]) -> str:
    for frame in reversed(frames):
        for name, pattern in CATEGORIES:
            if re.search(pattern, frame):
                return name
    return "other"


def profile(url: str, work: Path, args: argparse.Namespace, stream: bool) -> Counter[str]:
    raw = work / f"profile-{stream}.txt"
    command = [
        shutil.which("py-spy") or "py-spy",
        "record",
        "--rate",
        "250",
        "--format",
        "raw",
        "--output",
        str(raw),
        "--",
        sys.executable,
        "-m",
        "batchrun",
        "--home",
        str(work / f"home-{stream}"),
        "submit",
        str(work / "requests.jsonl"),
        "--base-url",
        url,
        "--model",
        "fast-1",
        "--concurrency",
        str(args.concurrency),
        "--quiet",
        *([] if stream else ["--no-stream"]),
    ]
    subprocess.run(command, check=True, capture_output=True, env=CHILD_ENV)
    counts: Counter[str] = Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        if "runpy" in frames[0]:  # the main thread (the ledger's own thread is idle waits)
            counts[category(frames)] += int(n)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--keep", type=Path, help="a folder to keep py-spy's raw profiles in")
    args = parser.parse_args()
    if shutil.which("py-spy") is None:
        raise SystemExit("needs py-spy on PATH: pip install py-spy")
    server, url = start_server(30)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            write_requests(work, args.requests)
            results = {stream: profile(url, work, args, stream) for stream in (False, True)}
            if args.keep:
                args.keep.mkdir(parents=True, exist_ok=True)
                for raw in work.glob("profile-*.txt"):
                    shutil.copy(raw, args.keep / raw.name)
    finally:
        server.terminate()
        server.wait()
    print(f"{args.requests} requests of 30 tokens, {args.concurrency} in flight; share of samples")
    print(f"{'':14} {'not streamed':>13} {'streamed':>9}")
    names = [name for name, _ in CATEGORIES] + ["other"]
    totals = {stream: sum(counts.values()) for stream, counts in results.items()}
    for name in names:
        shares = [results[s][name] / totals[s] * 100 for s in (False, True)]
        print(f"{name:14} {shares[0]:12.1f}% {shares[1]:8.1f}%")
    print(f"{'samples':14} {totals[False]:13d} {totals[True]:9d}")


if __name__ == "__main__":
    main()
