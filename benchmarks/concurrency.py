"""--concurrency auto against fixed settings, on three simulated server shapes.

Each run sends the same job through the real CLI to `batchrun sim` on 127.0.0.1 for a fixed
time, then stops it with Ctrl-C. Measured from the ledger and the job log, after a warm-up:
output tokens per second, p50/p95 time to first token, and the share of attempts answered 429.
Targets (issue 4), per shape: auto >= 90% of the best fixed throughput, auto's p50 TTFT within
3x the unloaded value, and under 1% of auto's requests answered 429.

    python benchmarks/concurrency.py [--seconds 40] [--warmup 10] [--shapes a,b,c]
"""

from __future__ import annotations

import argparse
import json
import signal
import sqlite3
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' CLI helpers

from tests.integration.helpers import CLI, start_sim

FAST = [
    "--ttft-ms",
    "50",
    "--tpot-ms",
    "20",
    "--min-output-tokens",
    "16",
    "--max-output-tokens",
    "32",
]
# 256 streams at 20 ms per token are ~13,000 SSE chunks a second, more than a 2-core machine
# running both the simulator and the client can move; at 200 ms per token the same 256 streams
# are ~1,300 chunks a second, so the simulated server, not the machine, is what saturates.
SLOW = [
    "--ttft-ms",
    "200",
    "--tpot-ms",
    "200",
    "--min-output-tokens",
    "8",
    "--max-output-tokens",
    "16",
]
SHAPES = {
    "a": ("64 slots, unbounded queue", [*FAST, "--slots", "64", "--tpot-slope", "0.5"]),
    "b": (
        "256 slots, unbounded queue, 200 ms/token",
        [*SLOW, "--slots", "256", "--tpot-slope", "0.5"],
    ),
    "c": (
        "hosted: 429 gate at 100 in flight, 3000 requests/min",
        [*FAST, "--slots", "100", "--queue-limit", "0", "--rpm", "3000", "--tpot-slope", "0.5"],
    ),
}
SETTINGS = ["auto", "1", "4", "16", "64", "256", "1024"]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def one_run(home: Path, url: str, setting: str, seconds: float, warmup: float) -> dict[str, Any]:
    cli = CLI(home)
    inp = home / "job.jsonl"
    if not inp.exists():
        inp.write_text(
            "".join(
                json.dumps({"prompt": f"Describe product {i} in one line."}) + "\n"
                for i in range(60_000)
            )
        )
    job = f"run{time.monotonic_ns()}"
    proc = cli.start(
        "submit",
        str(inp),
        "--job",
        job,
        "--base-url",
        url,
        "--model",
        "sim-1",
        "--concurrency",
        setting,
        "--max-concurrency",
        "1024",
        "--max-attempts",
        "50",
        "--quiet",
    )
    time.sleep(seconds)
    stopped_at = time.time()
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=120)
    log = [json.loads(x) for x in (home / "logs" / f"{job}.log").read_text().splitlines()]
    started = next(e for e in log if e["event"] == "run_started")
    t0 = datetime.fromisoformat(started["time"]).timestamp() + warmup
    attempts = [
        e
        for e in log
        if e["event"] == "attempt"
        and t0 <= datetime.fromisoformat(e["time"]).timestamp() <= stopped_at
    ]
    conn = sqlite3.connect(home / "jobs" / "ledger.db")
    rows = conn.execute(
        "SELECT completion_tokens, ttft_ms FROM items WHERE job = ? AND status = 'done' "
        "AND updated_at BETWEEN ? AND ?",
        (job, t0, stopped_at),
    ).fetchall()
    conn.close()
    limits = [e["limit"] for e in log if e["event"] == "concurrency"]
    ttfts = [r[1] for r in rows if r[1] is not None]
    return {
        "tok_s": sum(r[0] or 0 for r in rows) / (stopped_at - t0),
        "p50": percentile(ttfts, 0.5),
        "p95": percentile(ttfts, 0.95),
        "share_429": sum(1 for a in attempts if a.get("http_status") == 429)
        / max(1, len(attempts)),
        "final_limit": limits[-1] if limits else None,
    }


def unloaded_ttft(url: str, home: Path) -> float:
    """p50 TTFT at concurrency 1: the server's unloaded value."""
    cli = CLI(home)
    inp = home / "probe.jsonl"
    inp.write_text("".join(json.dumps({"prompt": f"probe {i}"}) + "\n" for i in range(20)))
    cli.run(
        "submit", str(inp), "--base-url", url, "--model", "sim-1", "--concurrency", "1", "--quiet"
    )
    conn = sqlite3.connect(home / "jobs" / "ledger.db")
    ttfts = [r[0] for r in conn.execute("SELECT ttft_ms FROM items WHERE job='probe'")]
    conn.close()
    return percentile(ttfts, 0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=40)
    parser.add_argument("--warmup", type=float, default=10)
    parser.add_argument("--shapes", default="a,b,c")
    parser.add_argument(
        "--settings",
        default=",".join(SETTINGS),
        help="which to run; the summary needs auto and at least one number",
    )
    args = parser.parse_args()
    for key in args.shapes.split(","):
        title, flags = SHAPES[key]
        print(f"\n({key}) {title}; {args.seconds:g}s runs, first {args.warmup:g}s not counted")
        print(
            f"  {'setting':>8} {'out tok/s':>10} {'p50 TTFT':>9} {'p95 TTFT':>9} "
            f"{'429s':>6} {'final limit':>11}"
        )
        results: dict[str, dict[str, Any]] = {}
        for setting in args.settings.split(","):
            server, url = start_sim("--port", "0", *flags)
            try:
                with tempfile.TemporaryDirectory() as tmp:
                    if not results:
                        unloaded = unloaded_ttft(url, Path(tmp))
                    results[setting] = r = one_run(
                        Path(tmp), url, setting, args.seconds, args.warmup
                    )
            finally:
                server.kill()
            print(
                f"  {setting:>8} {r['tok_s']:10.0f} {r['p50']:7.0f}ms {r['p95']:7.0f}ms "
                f"{r['share_429']:6.1%} {r['final_limit'] or '':>11}",
                flush=True,
            )
        fixed = [v["tok_s"] for k, v in results.items() if k != "auto"]
        if "auto" not in results or not fixed:
            continue
        best = max(fixed)
        auto = results["auto"]
        print(
            f"  auto: {auto['tok_s'] / best:.0%} of the best fixed throughput (target >= 90%), "
            f"p50 TTFT {auto['p50'] / unloaded:.1f}x unloaded {unloaded:.0f}ms (target <= 3x), "
            f"429s {auto['share_429']:.2%} (target < 1%)"
        )


if __name__ == "__main__":
    main()
