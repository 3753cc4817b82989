"""Streamed or not against a real engine: who pays for streaming, the client or the engine?

Runs `batchrun submit` against a server already running (a real engine's /v1 URL), streamed
and not, in turns, and prints for each mode the whole command's wall time, the client's CPU
(the batchrun process: its rusage) and the server's CPU (read from /proc for `--server-pid`),
and the output tokens the answers report. Where the server's CPU is near its wall time it set
the pace; where the client's is well below the wall, the client waited on it.

Give the client and the server a core each, so that neither takes the other's: on a 2-core
machine, llama.cpp's server with one thread on core 0 and this script on core 1:

    taskset -c 0 llama-server -m stories260K.gguf -np 8 -c 4096 -t 1 --port 18080 &
    taskset -c 1 python benchmarks/engine_streaming.py --url http://127.0.0.1:18080/v1 \\
        --server-pid $(pgrep -f llama-server) [--requests 500] [--rounds 2] [--concurrency 8]

Requests ask for at most 64 tokens.
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

from client_cost import CHILD_ENV, MODEL, process_cpu, write_requests

MODES = ("no-stream", "stream")


def one_job(url: str, work: Path, mode: str, args: argparse.Namespace) -> tuple[float, ...]:
    """(wall, client CPU, server CPU, output tokens) of one `batchrun submit` run."""
    job = f"es{time.monotonic_ns()}"
    command = [sys.executable, "-m", "batchrun", "--home", str(work / job), "submit"]
    command += [str(work / "requests.jsonl"), "--job", job, "--base-url", url]
    command += ["--model", MODEL, "--concurrency", str(args.concurrency), "--quiet", f"--{mode}"]
    server = process_cpu(args.server_pid)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run(command, env=CHILD_ENV, check=True, capture_output=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    server = process_cpu(args.server_pid) - server
    client = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    lines = (work / job / "outputs" / f"{job}.jsonl").read_text().splitlines()
    tokens = sum(
        (json.loads(line).get("usage") or {}).get("completion_tokens", 0) for line in lines
    )
    return wall, client, server, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="a running engine's /v1 URL")
    parser.add_argument("--server-pid", type=int, required=True, help="the engine's process")
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    runs: dict[str, list[tuple[float, ...]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_requests(work, args.requests)
        version = [sys.executable, "-m", "batchrun", "--version"]  # its bytecode written
        subprocess.run(version, env=CHILD_ENV, check=True, capture_output=True)
        for r in range(args.rounds):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                runs[mode].append(one_job(args.url, work, mode, args))
    print(f"{args.requests} chat requests, {args.concurrency} in flight, {args.url}; ", end="")
    print(f"medians of {args.rounds} rounds")
    print(f"{'mode':10} {'wall':>7} {'client CPU':>11} {'server CPU':>11} {'tokens':>7}")
    med = {
        mode: [statistics.median(run[k] for run in runs[mode]) for k in range(4)] for mode in MODES
    }
    for mode, (wall, client, server, tokens) in med.items():
        print(f"{mode:10} {wall:6.2f}s {client:10.2f}s {server:10.2f}s {tokens:7.0f}")
    plain, streamed = med["no-stream"], med["stream"]
    print(f"streamed / not streamed, wall: {plain[0] / streamed[0]:.2f}")
    extra_server, extra_client = streamed[2] - plain[2], streamed[1] - plain[1]
    per_token = 1e6 / max(streamed[3], 1)
    print(
        f"streaming adds {extra_server * per_token:.0f} us of server CPU and "
        f"{extra_client * per_token:.0f} us of client CPU a token; the client was busy "
        f"{streamed[1] / streamed[0]:.0%} of the streamed run's wall time"
    )


if __name__ == "__main__":
    main()
