"""httpx's single connection pool vs batchrun's sharded one, at many streams in flight.

The same bare streaming loop (no ledger, no retries) sends the same requests to one
`batchrun sim` process on 127.0.0.1, once through a plain `httpx.AsyncClient` (one pool of C
connections) and once through `batchrun.backends.pool.ShardedTransport` (pools of 32). Runs are
interleaved and repeated; medians are printed. The figure that matters is the client's CPU time
per request (process time of this process, which runs only the client): the simulator runs in
another process and shares the 2 cores, so requests per second also move with its load.

    python benchmarks/connection_pool.py [--requests 3000] [--concurrency 64,256,512] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import anyio
import httpx
import orjson

from batchrun.backends.pool import ShardedTransport

# Streams that last ~0.5 s, so C of them really are open at once.
SIM = ["--ttft-ms", "100", "--tpot-ms", "50", "--min-output-tokens", "8",
       "--max-output-tokens", "8"]  # fmt: skip


def start_sim() -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchrun", "sim", "--port", "0", *SIM],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline().split()[3]


async def loop(url: str, requests: int, concurrency: int, sharded: bool) -> tuple[float, float]:
    """(requests per second, client CPU milliseconds per request)."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    transport = ShardedTransport(concurrency) if sharded else None
    async with httpx.AsyncClient(limits=limits, transport=transport, timeout=120) as client:
        todo = iter(range(requests))

        async def worker() -> None:
            for i in todo:
                body = {"model": "sim-1", "stream": True,
                        "messages": [{"role": "user", "content": f"prompt {i}"}]}  # fmt: skip
                async with client.stream("POST", url + "/chat/completions",
                                         content=orjson.dumps(body)) as resp:  # fmt: skip
                    async for line in resp.aiter_lines():
                        if line.startswith("data:") and line[5:].strip() != "[DONE]":
                            orjson.loads(line[5:])

        cpu, wall = time.process_time(), time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(concurrency):
                tg.start_soon(worker)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return requests / wall, cpu * 1000 / requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", default="64,256,512")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    proc, url = start_sim()
    try:
        print(f"batchrun sim at {url}; {args.requests} streamed requests of 8 tokens, "
              f"median of {args.repeat}")  # fmt: skip
        print(f"  {'streams':>7} {'pool':>8} {'req/s':>7} {'CPU ms/req':>10}   ratio (CPU/req)")
        for c in (int(x) for x in args.concurrency.split(",")):
            runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
            for _ in range(args.repeat):
                for sharded in (False, True):
                    runs[sharded].append(anyio.run(loop, url, args.requests, c, sharded))
            med = {k: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v))
                   for k, v in runs.items()}  # fmt: skip
            for sharded, name in ((False, "single"), (True, "sharded")):
                rate, cpu = med[sharded]
                ratio = f"   {med[True][1] / med[False][1]:.2f}x" if sharded else ""
                print(f"  {c:>7} {name:>8} {rate:7.0f} {cpu:10.2f}{ratio}", flush=True)
    finally:
        proc.kill()


if __name__ == "__main__":
    main()
