"""Several endpoints in one job, one killed halfway: does each take work in proportion to its
speed, and is nothing lost?

Three `batchrun sim` servers of different capacity (the same request time, 4, 8 and 16 batch
slots: speeds about 1 : 2 : 4) each run the job alone first, under the same options, for their
speed in answers/s (the baseline, measured in the same run). Then one job with all three
endpoints (`--endpoint a=URL --endpoint b=URL --endpoint c=URL`, `--concurrency auto` each)
runs, and KILL (default the fastest, c) is killed with SIGKILL when half the items are done.

Printed: every item's status (all done, none failed), each endpoint's share of the answers
beside the share its speed predicts for the time it was alive (speed x seconds alive, over the
sum), and the ratio of the two (1.00: exactly proportional). The issue's bar: within 15%.

    python benchmarks/endpoints.py [--items 3000] [--kill c] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from tests.integration.helpers import CLI, cli_command, start_sim, write_prompts  # noqa: E402

SLOTS = {"a": 4, "b": 8, "c": 16}
SIM = (
    "--ttft-ms",
    "40",
    "--tpot-ms",
    "4",
    "--min-output-tokens",
    "16",
    "--max-output-tokens",
    "32",
)


def serve(name: str) -> tuple[subprocess.Popen[str], str]:
    return start_sim("--port", "0", "--slots", str(SLOTS[name]), *SIM)


def env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("BATCHRUN_HOME", "BATCHRUN_LEDGER")}


def alone(name: str, items: int, work: Path) -> float:
    """One endpoint's speed, answers/s, on a job of its own."""
    home = Path(tempfile.mkdtemp(dir=work))
    write_prompts(home / "in.jsonl", items)
    proc, url = serve(name)
    try:
        started = time.monotonic()
        cmd = cli_command(home, "submit", str(home / "in.jsonl"), "--base-url", url, "--quiet")
        subprocess.run(cmd, check=True, env=env(), capture_output=True)
        return items / (time.monotonic() - started)
    finally:
        proc.kill()
        proc.wait()


def together(items: int, kill: str, work: Path) -> dict[str, object]:
    home = Path(tempfile.mkdtemp(dir=work))
    write_prompts(home / "in.jsonl", items)
    servers = {name: serve(name) for name in SLOTS}
    try:
        flags = [f"--endpoint={n}={url}" for n, (_p, url) in servers.items()]
        cmd = cli_command(home, "submit", str(home / "in.jsonl"), "--job", "j", *flags, "--quiet")
        started = time.monotonic()
        job = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        cli = CLI(home)
        while cli.counts("j").get("done", 0) < items // 2 and job.poll() is None:
            time.sleep(0.05)
        servers[kill][0].send_signal(signal.SIGKILL)
        killed_at = time.monotonic() - started
        out, err = job.communicate(timeout=600)
        wall = time.monotonic() - started
    finally:
        for proc, _url in servers.values():
            proc.kill()
            proc.wait()
    records = cli.output("j")
    by: dict[str, int] = {}
    for r in records:
        by[r["answered_by"]] = by.get(r["answered_by"], 0) + 1
    statuses = {r["status"] for r in records}
    return {
        "rc": job.returncode,
        "wall": wall,
        "killed_at": killed_at,
        "by": by,
        "statuses": statuses,
        "n": len(records),
        "summary": err.decode().strip().splitlines()[-1:] or out.decode()[-300:],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=3000)
    parser.add_argument("--kill", default="c", choices=sorted(SLOTS))
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for round_ in range(args.repeat):
            speeds = {name: alone(name, args.items // 3, work) for name in SLOTS}
            got = together(args.items, args.kill, work)
            alive = {n: got["wall"] for n in SLOTS} | {args.kill: got["killed_at"]}
            weight = {n: speeds[n] * alive[n] for n in SLOTS}
            print(
                f"round {round_ + 1}: speeds alone (answers/s) "
                + ", ".join(f"{n} {v:.1f}" for n, v in speeds.items())
                + f"; together {got['wall']:.1f} s, {args.kill} killed at {got['killed_at']:.1f} s"
            )
            print(f"  exit {got['rc']}, {got['n']} results, statuses {sorted(got['statuses'])}")
            print(f"  {'endpoint':8} {'answers':>8} {'share':>6} {'predicted':>9} {'ratio':>6}")
            for n in SLOTS:
                share = got["by"].get(n, 0) / max(1, got["n"])
                predicted = weight[n] / sum(weight.values())
                print(
                    f"  {n:8} {got['by'].get(n, 0):8} {share:6.3f} {predicted:9.3f} "
                    f"{share / predicted:6.2f}"
                )
            print(f"  {json.dumps(got['summary'])}")


if __name__ == "__main__":
    main()
