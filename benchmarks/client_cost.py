"""What the client costs: CPU per request and per streamed chunk, and the rate one process drives.

Every contender sends the same chat requests to one zero-latency server in another process
(benchmarks/fast_server.py: answers prepared once, so the server costs a header parse and a
write) and reads every answer whole; streamed answers come as one SSE event per token. Runs
alternate between contenders and repeat; medians are printed, and the ratio of each to the
bare aiohttp loop of the same run. Client CPU is the process's own (the loops run in this
process; batchrun and the cookbook's script run as child processes, read from their rusage,
interpreter start and file loading included). Server CPU per request is printed beside it: a
server near one core per wall second means the server, not the client, set the pace.

Contenders: bare httpx and bare aiohttp loops (no ledger, retries or logging: the floor), and
`batchrun submit --concurrency C` streamed and not. With `--cookbook PATH` (a copy of the OpenAI
cookbook's api_request_parallel_processor.py; this repository holds none of its code), that
script too, not streamed, with budgets too large to bind: it keeps as many requests in flight
as aiohttp's default connector allows (100).

    python benchmarks/client_cost.py [--requests 5000] [--concurrency 32] [--tokens 30]
        [--repeat 3] [--only batchrun,bare-aiohttp,...] [--cookbook PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import anyio
import httpx
import orjson

HERE = Path(__file__).resolve().parent
MODEL = "fast-1"


@dataclass(frozen=True)
class Figures:
    wall_s: float
    client_cpu_s: float
    server_cpu_s: float


def start_server(tokens: int) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "fast_server.py"), "--tokens", str(tokens)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline().split()[-1]


def process_cpu(pid: int) -> float:
    """User + system seconds of a live process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def bodies(n: int, stream: bool) -> list[bytes]:
    extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    return [
        orjson.dumps(
            {
                "model": MODEL,
                "max_tokens": 64,
                **extra,
                "messages": [{"role": "user", "content": f"Rewrite item {i}."}],
            }
        )
        for i in range(n)
    ]


async def run_workers(
    concurrency: int, items: list[bytes], send: Callable[[bytes], Awaitable[None]]
) -> None:
    queue = iter(items)

    async def worker() -> None:
        for body in queue:
            await send(body)

    async with anyio.create_task_group() as tg:
        for _ in range(concurrency):
            tg.start_soon(worker)


def read_sse(data: bytes) -> int:
    """Events in a whole SSE body, each parsed as JSON (what a minimal client must do)."""
    events = 0
    for block in data.split(b"\n\n"):
        if block.startswith(b"data: ") and block != b"data: [DONE]":
            orjson.loads(block[6:])
            events += 1
    return events


async def bare_httpx(url: str, items: list[bytes], concurrency: int, stream: bool) -> None:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    headers = {"content-type": "application/json"}
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:

        async def send(body: bytes) -> None:
            async with client.stream("POST", url, content=body, headers=headers) as resp:
                resp.raise_for_status()
                if stream:
                    async for line in resp.aiter_lines():
                        if line.startswith("data:") and line[5:].strip() != "[DONE]":
                            orjson.loads(line[5:])
                else:
                    orjson.loads(await resp.aread())

        await run_workers(concurrency, items, send)


async def bare_aiohttp(url: str, items: list[bytes], concurrency: int, stream: bool) -> None:
    connector = aiohttp.TCPConnector(limit=concurrency)
    headers = {"content-type": "application/json"}
    async with aiohttp.ClientSession(connector=connector) as session:

        async def send(body: bytes) -> None:
            async with session.post(url, data=body, headers=headers) as resp:
                resp.raise_for_status()
                if stream:
                    async for line in resp.content:
                        if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                            orjson.loads(line[5:])
                else:
                    orjson.loads(await resp.read())

        await run_workers(concurrency, items, send)


def in_process(
    loop: Callable[..., Awaitable[None]],
    url: str,
    items: list[bytes],
    concurrency: int,
    stream: bool,
) -> tuple[float, float]:
    cpu, started = time.process_time(), time.perf_counter()
    anyio.run(loop, f"{url}/chat/completions", items, concurrency, stream)
    return time.perf_counter() - started, time.process_time() - cpu


def child(command: list[str], env: dict[str, str] | None = None) -> tuple[float, float]:
    cpu, started = children_cpu(), time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{command[:4]} failed ({done.returncode}): {done.stderr[-2000:]}")
    return wall, children_cpu() - cpu


def batchrun(url: str, work: Path, args: argparse.Namespace, stream: bool) -> tuple[float, float]:
    job = f"cost{time.monotonic_ns()}"
    command = [
        sys.executable,
        "-m",
        "batchrun",
        "--home",
        str(work / "home"),
        "submit",
        str(work / "requests.jsonl"),
        "--job",
        job,
        "--base-url",
        url,
        "--model",
        MODEL,
        "--concurrency",
        str(args.concurrency),
        "--quiet",
        *([] if stream else ["--no-stream"]),
    ]
    return child(command)


def cookbook(url: str, work: Path, args: argparse.Namespace) -> tuple[float, float]:
    out = work / f"cookbook-{time.monotonic_ns()}.jsonl"
    command = [
        sys.executable,
        str(args.cookbook),
        "--requests_filepath",
        str(work / "requests.jsonl"),
        "--save_filepath",
        str(out),
        "--request_url",
        f"{url}/chat/completions",
        "--max_requests_per_minute",
        "100000000",
        "--max_tokens_per_minute",
        "10000000000",
        "--token_encoding_name",
        "cl100k_base",
        "--max_attempts",
        "3",
        "--logging_level",
        "40",
    ]
    return child(command, env={**os.environ, "OPENAI_API_KEY": "sk-not-needed"})


def contenders(
    args: argparse.Namespace,
) -> dict[str, tuple[bool, Callable[..., tuple[float, float]]]]:
    """name -> (streamed, run(url, work) -> (wall s, client CPU s))."""
    n, c = args.requests, args.concurrency
    plain, streamed = bodies(n, False), bodies(n, True)
    table: dict[str, tuple[bool, Callable[..., tuple[float, float]]]] = {
        "bare-aiohttp": (False, lambda url, _w: in_process(bare_aiohttp, url, plain, c, False)),
        "bare-aiohttp-stream": (
            True,
            lambda url, _w: in_process(bare_aiohttp, url, streamed, c, True),
        ),
        "bare-httpx": (False, lambda url, _w: in_process(bare_httpx, url, plain, c, False)),
        "bare-httpx-stream": (True, lambda url, _w: in_process(bare_httpx, url, streamed, c, True)),
        "batchrun": (False, lambda url, w: batchrun(url, w, args, False)),
        "batchrun-stream": (True, lambda url, w: batchrun(url, w, args, True)),
    }
    if args.cookbook:
        table["cookbook"] = (False, lambda url, w: cookbook(url, w, args))
    if args.only:
        wanted = set(args.only.split(",")) | {"bare-aiohttp"}
        table = {k: v for k, v in table.items() if k in wanted}
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=30, help="tokens (SSE events) per answer")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", help="comma-separated contenders (bare-aiohttp always runs)")
    parser.add_argument("--cookbook", type=Path, help="a copy of api_request_parallel_processor.py")
    args = parser.parse_args()
    table = contenders(args)
    server, url = start_server(args.tokens)
    runs: dict[str, list[Figures]] = {name: [] for name in table}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            lines = [
                {
                    "model": MODEL,
                    "max_tokens": 64,
                    "messages": [{"role": "user", "content": f"Rewrite item {i}."}],
                }
                for i in range(args.requests)
            ]
            (work / "requests.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
            in_process(bare_aiohttp, url, bodies(200, True), args.concurrency, True)  # warm-up
            for _ in range(args.repeat):
                for name, (_stream, run) in table.items():
                    server_cpu = process_cpu(server.pid)
                    wall, cpu = run(url, work)
                    runs[name].append(Figures(wall, cpu, process_cpu(server.pid) - server_cpu))
    finally:
        server.terminate()
        server.wait()
    report(runs, table, args)


def report(runs: dict[str, list[Figures]], table: dict, args: argparse.Namespace) -> None:
    n, tokens = args.requests, args.tokens
    print(
        f"{n} chat requests of {tokens} tokens, {args.concurrency} in flight, zero-latency server "
        f"in another process; median of {args.repeat}"
    )
    print(
        f"{'contender':22} {'wall':>7} {'req/s':>7} {'chunks/s':>9} {'CPU':>7} "
        f"{'ms/req':>7} {'us/chunk':>8} {'server ms/req':>13} {'vs aiohttp':>10}"
    )
    base = statistics.median(f.wall_s for f in runs["bare-aiohttp"])
    for name, figures in runs.items():
        wall = statistics.median(f.wall_s for f in figures)
        cpu = statistics.median(f.client_cpu_s for f in figures)
        server = statistics.median(f.server_cpu_s for f in figures)
        streamed = table[name][0]
        chunks = f"{n * tokens / wall:9.0f}" if streamed else f"{'-':>9}"
        per_chunk = f"{cpu / (n * tokens) * 1e6:8.1f}" if streamed else f"{'-':>8}"
        print(
            f"{name:22} {wall:6.2f}s {n / wall:7.0f} {chunks} {cpu:6.2f}s "
            f"{cpu / n * 1e3:7.2f} {per_chunk} {server / n * 1e3:13.2f} {base / wall:9.2f}x"
        )


if __name__ == "__main__":
    main()
