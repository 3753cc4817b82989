"""Several workers on one server, each with its own adaptive controller.

A job is loaded once (`submit --no-run`, a SQLite ledger shared by local processes), then N
`batchrun resume` processes run it at once against one fresh server, all under
`--concurrency auto`. Each controller sees only its own requests, but the server's queue is
shared: do N controllers together settle near the level one controller finds alone, or do they
overshoot it N times? Measured against one worker at fixed levels in the same run (the best of
them is the reference), on the server shapes named (llama.cpp's C++ `llama-server -np 8` with
the tiny model, and the continuous-batching shapes of benchmarks/shape_server.py).

Printed per shape and setting: the job's wall time (first worker started to last one exited),
its share of the best fixed level (best fixed / this, so 1.0 is as fast), and each worker's
final limit with their sum. Median of --repeat runs, run in alternating order.

    python benchmarks/shared_server.py [--shapes llama-np8,knee24] [--workers 1,2,3]
        [--fixed 4,8,16] [--items 1500] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.concurrency_matrix import SHAPES as MATRIX_SHAPES  # noqa: E402
from benchmarks.concurrency_matrix import missing, serve  # noqa: E402
from tests.integration.helpers import cli_command, write_prompts  # noqa: E402

# llama-server with its Prometheus page: each worker's controller then sees the server's own
# queue (requests waiting for a slot), which every worker's requests share.
SHAPES = {
    **MATRIX_SHAPES,
    "llama-np8-metrics": replace(
        MATRIX_SHAPES["llama-np8"], name="llama-np8-metrics", flags="--metrics"
    ),
}


def run_once(shape_name: str, workers: int, setting: str, items: int, work: Path) -> dict:
    """One job: N workers at `setting` against a fresh server; wall time and final limits."""
    shape = SHAPES[shape_name]
    home = Path(tempfile.mkdtemp(dir=work))
    inp = home / "in.jsonl"
    write_prompts(inp, items)
    env = {k: v for k, v in os.environ.items() if k not in ("BATCHRUN_HOME", "BATCHRUN_LEDGER")}
    load = cli_command(home, "submit", str(inp), "--job", "m", "--no-run", "--quiet")
    subprocess.run(load, check=True, env=env, capture_output=True)
    with serve(shape, home / "server.log") as url:
        run = cli_command(
            home,
            "resume",
            "m",
            "--backend",
            shape.backend,
            "--base-url",
            url,
            "--concurrency",
            setting,
            "--max-tokens",
            str(shape.max_tokens),
            "--quiet",
        )
        started = time.monotonic()
        procs = [subprocess.Popen(run, env=env, stderr=subprocess.PIPE) for _ in range(workers)]
        codes = [p.wait() for p in procs]
        wall = time.monotonic() - started
    events = [json.loads(line) for line in (home / "logs" / "m.log").read_text().splitlines()]
    limits = [e["limit"] for e in events if e.get("event") == "run_stopped"]
    done = subprocess.run(
        cli_command(home, "status", "m", "--json"), env=env, capture_output=True, text=True
    )
    counts = json.loads(done.stdout)["counts"]
    return {"wall_s": wall, "codes": codes, "limits": limits, "done": counts.get("done", 0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="llama-np8,knee24")
    parser.add_argument("--workers", default="1,2,3")
    parser.add_argument("--fixed", default="4,8,16", help="one worker at these levels")
    parser.add_argument(
        "--split", type=int, default=8, help="N workers at this level / N each (0: none)"
    )
    parser.add_argument("--items", type=int, default=1500)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    settings = [(1, level) for level in args.fixed.split(",")]
    counts = [int(n) for n in args.workers.split(",")]
    settings += [(n, "auto") for n in counts]
    if args.split:  # the same total in flight as one worker at --split: what N processes cost
        settings += [(n, str(max(1, round(args.split / n)))) for n in counts if n > 1]
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.shapes.split(","):
            why = missing(SHAPES[name])
            if why:
                print(f"{name}: skipped: {why}")
                continue
            runs: dict[tuple[int, str], list[dict]] = {s: [] for s in settings}
            for round_ in range(args.repeat):
                order = settings if round_ % 2 == 0 else settings[::-1]
                for n, setting in order:
                    runs[(n, setting)].append(run_once(name, n, setting, args.items, Path(tmp)))
            report(name, args.items, runs)


def report(name: str, items: int, runs: dict[tuple[int, str], list[dict]]) -> None:
    wall = {key: statistics.median(r["wall_s"] for r in rs) for key, rs in runs.items()}
    best = min(w for (n, setting), w in wall.items() if setting != "auto" and n == 1)
    print(f"\n{name}: {items} items; best fixed (1 worker) {best:.1f} s")
    print(f"{'workers':>7} {'setting':>7} {'wall':>7} {'share':>6}  final limits (sum)  done")
    for (n, setting), rs in runs.items():
        finals = [r["limits"] for r in rs]
        sums = [sum(f) for f in finals]
        done = min(r["done"] for r in rs)
        print(
            f"{n:>7} {setting:>7} {wall[(n, setting)]:>6.1f}s {best / wall[(n, setting)]:>6.2f}"
            f"  {finals} ({sums})  {done}"
        )


if __name__ == "__main__":
    main()
