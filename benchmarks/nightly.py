"""Two nights of one catalogue: what the second night sends, and what looking up costs.

Night 1 sends a job of --items prompts through the CLI (`batchrun submit`, not streamed, 32 in
flight) to the zero-latency server (fast_server.py). Night 2 is the same file with --changed
(2%) of its lines rewritten and --duplicates (1%) more lines that repeat other lines (half of
them repeating a changed line, so dedup of new requests is exercised too), as its own job in
the same ledger. Printed: requests each night sent (counted from each job's log, one `attempt`
line per request; the goal for night 2 is the distinct changed requests, exactly), wall times
and their ratio, and the reuse lookup's own time (the `reuse` log event) per 1,000 items.

    python benchmarks/nightly.py [--items 100000] [--changed 0.02] [--duplicates 0.01]
        [--server fast|llama-server]

`--server llama-server`: llama.cpp's C++ server (-np 8, the tiny model; see
concurrency_matrix.py) instead of the zero-latency one, answers of at most 32 tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.concurrency_matrix import SHAPES, serve  # noqa: E402
from tests.integration.helpers import cli_command  # noqa: E402


def start_server() -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "fast_server.py"), "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    return proc, line.split()[-1]


@contextlib.contextmanager
def serving(server: str, work: Path) -> Iterator[str]:
    if server == "llama-server":
        with serve(SHAPES["llama-np8"], work / "server.log") as url:
            yield url
        return
    proc, url = start_server()
    try:
        yield url
    finally:
        proc.kill()


def write(path: Path, prompts: list[str]) -> None:
    with path.open("w") as f:
        for i, prompt in enumerate(prompts):
            f.write(json.dumps({"id": f"sku-{i}", "prompt": prompt}) + "\n")


def run_night(home: Path, job: str, path: Path, url: str) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("BATCHRUN_HOME", "BATCHRUN_LEDGER")}
    flags = ["--job", job, "--base-url", url, "--model", "m", "--concurrency", "32"]
    flags += ["--max-tokens", "32"]
    command = cli_command(home, "submit", str(path), *flags, "--no-stream", "--quiet")
    started = time.monotonic()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"{job}: exit {done.returncode}: {done.stderr[-500:]}")
    events = [json.loads(line) for line in (home / "logs" / f"{job}.log").open()]
    reuse = next((e for e in events if e.get("event") == "reuse"), {})
    return {
        "wall_s": wall,
        "requests": sum(e.get("event") == "attempt" for e in events),
        "reused": reuse.get("reused", 0),
        "duplicates": reuse.get("duplicates", 0),
        "lookup_s": reuse.get("seconds", 0.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--changed", type=float, default=0.02)
    parser.add_argument("--duplicates", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--server", choices=["fast", "llama-server"], default="fast")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    first = [f"Rewrite the description of product {i}." for i in range(args.items)]
    second = list(first)
    changed = rng.sample(range(args.items), int(args.items * args.changed))
    for i in changed:
        second[i] = f"Rewrite the description of product {i} (new price)."
    repeats = int(args.items * args.duplicates)
    unchanged = sorted(set(range(args.items)) - set(changed))
    sources = rng.sample(changed, repeats // 2) + rng.sample(unchanged, repeats - repeats // 2)
    second += [second[i] for i in sources]
    expected = len(set(second) - set(first))  # distinct requests night 1 never sent
    with tempfile.TemporaryDirectory() as tmp, serving(args.server, Path(tmp)) as url:
        home = Path(tmp)
        write(home / "night1.jsonl", first)
        write(home / "night2.jsonl", second)
        one = run_night(home, "night1", home / "night1.jsonl", url)
        two = run_night(home, "night2", home / "night2.jsonl", url)
    header = ("night", "items", "requests", "reused", "repeats", "wall", "lookup", "per 1,000")
    print("{:6} {:>8} {:>9} {:>8} {:>8} {:>8} {:>8} {:>10}".format(*header))
    for name, night, items in (("1", one, len(first)), ("2", two, len(second))):
        per = night["lookup_s"] / items * 1000
        print(
            f"{name:6} {items:>8,} {night['requests']:>9,} {night['reused']:>8,} "
            f"{night['duplicates']:>8,} {night['wall_s']:>7.1f}s {night['lookup_s']:>7.2f}s "
            f"{per * 1000:>8.1f}ms"
        )
    print(f"night 2 sent {two['requests']:,} requests; goal: the {expected:,} changed, exactly")
    print(f"night 2 / night 1 wall time: {two['wall_s'] / one['wall_s']:.2f}")


if __name__ == "__main__":
    main()
