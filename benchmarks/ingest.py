"""Ingest speed and memory: `batchrun submit --no-run` on a generated file vs a plain orjson parse.

Baseline, measured in the same run: reading the same file line by line and orjson-parsing each
line (no validation, no storage). Peak RSS of the batchrun process comes from getrusage of the
child. Targets (issue 2): load time <= 5x the plain parse; peak RSS < 200 MB.

    python benchmarks/ingest.py [--lines 1000000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

WORDS = (
    "rewrite",
    "the",
    "following",
    "product",
    "description",
    "for",
    "a",
    "friendly",
    "online",
    "store",
    "page",
)


def generate(path: Path, lines: int) -> None:
    rng = random.Random(7)
    with path.open("w") as f:
        for i in range(lines):
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 20)))
            if i % 3 == 0:
                record = {"id": f"p{i}", "prompt": prompt, "max_tokens": 128, "sku": i}
            else:
                record = {
                    "id": f"p{i}",
                    "messages": [
                        {"role": "system", "content": "You are a copywriter."},
                        {"role": "user", "content": prompt},
                    ],
                }
            f.write(json.dumps(record) + "\n")


def plain_parse(path: Path) -> float:
    started = time.perf_counter()
    count = 0
    with path.open("rb") as f:
        for line in f:
            orjson.loads(line)
            count += 1
    return time.perf_counter() - started


def batchrun_load(path: Path, home: Path) -> tuple[float, float]:
    """Wall time and peak RSS (MB) of one `batchrun submit --no-run` process."""
    ledger = home / "jobs" / "ledger.db"
    for suffix in ("", "-wal", "-shm"):
        Path(f"{ledger}{suffix}").unlink(missing_ok=True)
    command = [
        sys.executable,
        "-m",
        "batchrun",
        "--home",
        str(home),
        "submit",
        str(path),
        "--backend",
        "sim",
        "--no-run",
        "--quiet",
    ]
    started = time.perf_counter()
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    _pid, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"batchrun failed: {proc.stderr.read() if proc.stderr else ''}")
    return elapsed, usage.ru_maxrss / 1024  # Linux reports KiB


def python_startup() -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "batchrun", "--version"], check=True, capture_output=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "prompts.jsonl"
        generate(path, args.lines)
        size_mb = path.stat().st_size / 1e6
        print(f"input: {args.lines:,} lines, {size_mb:.1f} MB")
        parses, loads, rss = [], [], []
        for _ in range(args.repeat):  # interleaved, so drifting machine load hits both
            parses.append(plain_parse(path))
            elapsed, peak = batchrun_load(path, Path(tmp) / "home")
            loads.append(elapsed)
            rss.append(peak)
        startup = python_startup()
        parse, load = statistics.median(parses), statistics.median(loads)
        print(f"plain orjson parse:      {parse:7.2f} s  ({args.lines / parse:,.0f} lines/s)")
        print(
            f"batchrun submit --no-run:{load:7.2f} s  ({args.lines / load:,.0f} lines/s), "
            f"includes {startup:.2f} s interpreter+import startup"
        )
        print(f"ratio (batchrun / plain): {load / parse:.2f}x   target <= 5x")
        print(f"peak RSS of batchrun:    {max(rss):7.1f} MB   target < 200 MB")
        print(
            f"runs (s): parse {[round(p, 2) for p in parses]}, load {[round(x, 2) for x in loads]}"
        )


if __name__ == "__main__":
    main()
