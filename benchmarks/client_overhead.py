"""Client overhead: `batchrun submit` vs a bare httpx loop against a zero-latency simulator.

Both clients send the same streamed chat requests (with stream_options.include_usage) at the same
concurrency and read every SSE chunk. The bare loop has no ledger, no retries, no logging. Runs
are interleaved (bare, batchrun, bare, ...) so drifting machine load hits both; medians are
reported. Target (issue 2): batchrun >= 0.8x the bare loop.

Two set-ups:
- http: both clients against one `batchrun sim` process on 127.0.0.1. On a 2-core machine the
  single-process simulator saturates first, so this mostly shows that batchrun keeps up with it.
- in-process: both clients over the simulator's httpx transport (no sockets), so the client's own
  CPU cost is all that is measured; this is where overhead would show.

Two batchrun figures each: the whole command (interpreter start, ingest, run, results file) and
the run alone (the `run_stopped` elapsed time from the job log).

    python benchmarks/client_overhead.py [--requests 3000] [--concurrency 32] [--repeat 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
import httpx
import orjson

from batchrun.sim import SimConfig, SimModel, SimTransport

ZERO_LATENCY = SimConfig(ttft_ms=0.0, tpot_ms=0.0, min_output_tokens=16, max_output_tokens=16)


def start_sim() -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchrun", "sim", "--port", "0", "--ttft-ms", "0",
         "--tpot-ms", "0", "--min-output-tokens", "16", "--max-output-tokens", "16"],
        stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None
    return proc, proc.stdout.readline().split()[3]


def prompts(n: int) -> list[str]:
    return [f"Rewrite product description number {i} for the web shop." for i in range(n)]


async def bare_loop(url: str, texts: list[str], concurrency: int, in_process: bool) -> float:
    """Requests per second of the simplest correct streaming client."""
    send, receive = anyio.create_memory_object_stream[str](len(texts))
    for text in texts:
        send.send_nowait(text)
    send.close()
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def worker(client: httpx.AsyncClient) -> None:
        async for text in receive.clone():
            body = {"model": "sim-1", "messages": [{"role": "user", "content": text}],
                    "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
            async with client.stream("POST", f"{url}/chat/completions",
                                     content=orjson.dumps(body)) as resp:  # fmt: skip
                resp.raise_for_status()
                async for line in resp.aiter_lines():
                    if line.startswith("data:") and line[5:].strip() != "[DONE]":
                        orjson.loads(line[5:])

    started = time.perf_counter()
    transport = SimTransport(SimModel(ZERO_LATENCY)) if in_process else None
    client = httpx.AsyncClient(limits=limits, timeout=60, transport=transport)
    async with client, anyio.create_task_group() as tg:
        for _ in range(concurrency):
            tg.start_soon(worker, client)
    return len(texts) / (time.perf_counter() - started)


def batchrun_run(
    url: str, texts: list[str], concurrency: int, home: Path, in_process: bool
) -> tuple[float, float]:
    """(requests/s over the whole command, requests/s over the run alone)."""
    inp = home / "prompts.jsonl"
    inp.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    spec = home / "sim.toml"
    spec.write_text(
        "backend = 'sim'\n[sim_options]\n"
        + "".join(
            f"{k} = {v!r}\n"
            for k, v in dataclasses.asdict(ZERO_LATENCY).items()
            if k in ("ttft_ms", "tpot_ms", "min_output_tokens", "max_output_tokens")
        )
    )
    job = f"bench{time.monotonic_ns()}"
    where = ["--spec", str(spec)] if in_process else ["--base-url", url]
    command = [sys.executable, "-m", "batchrun", "--home", str(home), "submit", str(inp),
               "--job", job, *where, "--model", "sim-1",
               "--concurrency", str(concurrency), "--quiet"]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    whole = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"batchrun failed ({done.returncode}): {done.stderr}")
    log = [json.loads(x) for x in (home / "logs" / f"{job}.log").read_text().splitlines()]
    run = next(e for e in log if e["event"] == "run_stopped")["elapsed_s"]
    return len(texts) / whole, len(texts) / run


def measure(url: str, texts: list[str], args: argparse.Namespace, in_process: bool) -> None:
    bare, whole, run = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        anyio.run(bare_loop, url, texts[:200], args.concurrency, in_process)  # warm-up
        for _ in range(args.repeat):
            bare.append(anyio.run(bare_loop, url, texts, args.concurrency, in_process))
            w, r = batchrun_run(url, texts, args.concurrency, Path(tmp), in_process)
            whole.append(w)
            run.append(r)
    b, w, r = statistics.median(bare), statistics.median(whole), statistics.median(run)
    where = "in-process sim transport" if in_process else f"batchrun sim over HTTP ({url})"
    print(f"\n{where}: {args.requests} streamed requests, concurrency {args.concurrency}, "
          f"median of {args.repeat}")  # fmt: skip
    print(f"  bare httpx loop:            {b:8.0f} req/s")
    print(f"  batchrun submit (command):  {w:8.0f} req/s   ratio {w / b:.2f}x")
    print(f"  batchrun submit (run only): {r:8.0f} req/s   ratio {r / b:.2f}x   target >= 0.8x")
    print(f"  runs req/s: bare {[round(x) for x in bare]}, command {[round(x) for x in whole]}, "
          f"run {[round(x) for x in run]}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--setup", choices=["http", "in-process", "both"], default="both")
    args = parser.parse_args()
    texts = prompts(args.requests)
    if args.setup in ("http", "both"):
        sim, url = start_sim()
        try:
            measure(url, texts, args, in_process=False)
        finally:
            sim.terminate()
            sim.wait()
    if args.setup in ("in-process", "both"):
        measure("http://sim.batchrun.invalid/v1", texts, args, in_process=True)


if __name__ == "__main__":
    main()
