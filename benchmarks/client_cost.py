"""What the client costs: CPU per request and per streamed chunk, and the rate one process drives.

Every contender sends the same chat requests to one zero-latency server in another process
(benchmarks/fast_server.py: answers prepared once, so the server costs a header parse and a
write) and reads every answer whole; streamed answers come as one SSE event per token, in one
write, or with `--token-ms T` a write per token T ms apart, as an engine sends them. Runs
alternate between contenders (in reverse every other round) and repeat; medians are printed,
and the ratio of each to the bare aiohttp loop of the same run. batchrun streamed against not
streamed is taken round by round (its two runs are adjacent turns): the median of the
rounds' ratios, and their range, which says how much the machine moved it. Client CPU is
the process's own (the loops run in this process; batchrun and the cookbook's script run as
child processes, read from their rusage, interpreter start and file loading included).
Server CPU per request is printed beside it: a server near one core per wall second means the
server, not the client, set the pace.

Contenders: bare httpx and bare aiohttp loops (no ledger, retries or logging: the floor;
streamed, they read lines and parse each event, as their documentation shows), raw loops on
aiohttp and on batchrun's own engine (backends/http11.py) that read the bytes and nothing
else (what each engine itself costs, streamed and not: with batchrun's two, the run says how
close to not streamed a streamed batchrun could come on its engine), and `batchrun submit
--concurrency C` streamed and not, each run in a home of its own (a fresh ledger, as a first
run has: one grown by earlier runs slows both modes, and hides the streamed share). With
`--cookbook PATH` (a copy of the OpenAI cookbook's api_request_parallel_processor.py; this
repository holds none of its code), that script too, not streamed, with budgets too large to
bind and C requests in flight (benchmarks/cookbook_runner.py says how). Child processes load
modules from bytecode, as an installed package does.

    python benchmarks/client_cost.py [--requests 5000] [--concurrency 32] [--tokens 30]
        [--token-ms 0] [--repeat 3] [--only batchrun,bare-aiohttp,...] [--cookbook PATH]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp
import anyio
import httpx
import orjson

from batchrun.backends.http11 import Http11Transport

HERE = Path(__file__).resolve().parent
MODEL = "fast-1"


@dataclass(frozen=True)
class Measured:
    wall_s: float  # the whole command (a batchrun or cookbook process: start to exit)
    client_cpu_s: float
    run_s: float  # the sending alone (batchrun's own run_stopped elapsed; else the wall)


@dataclass(frozen=True)
class Figures:
    measured: Measured
    server_cpu_s: float


def start_server(tokens: int, token_ms: float = 0.0) -> tuple[subprocess.Popen[str], str]:
    server = [sys.executable, str(HERE / "fast_server.py"), "--tokens", str(tokens)]
    proc = subprocess.Popen(
        [*server, "--token-ms", str(token_ms)],
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


async def bare_aiohttp(
    url: str, items: list[bytes], concurrency: int, stream: bool, *, parse: bool = True
) -> None:
    """aiohttp as a minimal client uses it: streams read line by line, each event parsed.
    Without `parse` (the raw loops): the bytes read as they come and nothing else, the
    engine's own cost under any client's parsing (a stream's bytes are an HTTP chunk an event).
    """
    connector = aiohttp.TCPConnector(limit=concurrency)
    headers = {"content-type": "application/json"}
    async with aiohttp.ClientSession(connector=connector) as session:

        async def send(body: bytes) -> None:
            async with session.post(url, data=body, headers=headers) as resp:
                resp.raise_for_status()
                if not parse:
                    async for _data in resp.content.iter_any():
                        pass
                elif stream:
                    async for line in resp.content:
                        if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                            orjson.loads(line[5:])
                else:
                    orjson.loads(await resp.read())

        await run_workers(concurrency, items, send)


raw_aiohttp = functools.partial(bare_aiohttp, parse=False)


async def raw_http11(url: str, items: list[bytes], concurrency: int, stream: bool) -> None:
    """batchrun's engine (backends/http11.py) alone, under httpx's transport seam: each body's
    bytes read as they come, nothing else (the raw loop, as raw_aiohttp on aiohttp's)."""
    transport = Http11Transport(concurrency)
    headers = {"content-type": "application/json"}

    async def send(body: bytes) -> None:
        request = httpx.Request("POST", url, headers=headers, content=body)
        response = await transport.handle_async_request(request)
        async for _data in response.stream:  # type: ignore[union-attr]
            pass
        await response.aclose()

    try:
        await run_workers(concurrency, items, send)
    finally:
        await transport.aclose()


def write_requests(work: Path, n: int) -> Path:
    """`n` chat requests (`Rewrite item i.`) as a JSONL file in `work`."""
    path = work / "requests.jsonl"
    lines = (
        {
            "model": MODEL,
            "max_tokens": 64,
            "messages": [{"role": "user", "content": f"Rewrite item {i}."}],
        }
        for i in range(n)
    )
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def in_process(
    loop: Callable[..., Awaitable[None]],
    url: str,
    items: list[bytes],
    concurrency: int,
    stream: bool,
) -> Measured:
    cpu, started = time.process_time(), time.perf_counter()
    anyio.run(loop, f"{url}/chat/completions", items, concurrency, stream)
    wall = time.perf_counter() - started
    return Measured(wall, time.process_time() - cpu, wall)


# Child processes load modules from bytecode, as an installed package does (pip compiles it
# at install; a machine that sets PYTHONDONTWRITEBYTECODE would otherwise compile batchrun's
# modules at every start, a quarter second here that no user pays).
CHILD_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def child(command: list[str]) -> Measured:
    cpu, started = children_cpu(), time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=CHILD_ENV)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{command[:4]} failed ({done.returncode}): {done.stderr[-2000:]}")
    return Measured(wall, children_cpu() - cpu, wall)


def batchrun(url: str, work: Path, args: argparse.Namespace, stream: bool) -> Measured:
    job = f"cost{time.monotonic_ns()}"
    command = [
        sys.executable,
        "-m",
        "batchrun",
        "--home",
        str(work / job),  # a home of its own: a ledger grown by earlier runs slows both modes
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
    measured = child(command)
    log = (work / job / "logs" / f"{job}.log").read_text().splitlines()
    stopped = next(e for e in map(json.loads, log) if e["event"] == "run_stopped")
    return replace(measured, run_s=stopped["elapsed_s"])


def cookbook(url: str, work: Path, args: argparse.Namespace) -> Measured:
    """The cookbook's script at --concurrency in flight (see cookbook_runner.py)."""
    out = work / f"cookbook-{time.monotonic_ns()}.jsonl"
    command = [
        sys.executable,
        str(HERE / "cookbook_runner.py"),
        str(args.cookbook),
        "--concurrency",
        str(args.concurrency),
        "--requests",
        str(work / "requests.jsonl"),
        "--save",
        str(out),
        "--url",
        f"{url}/chat/completions",
    ]
    measured = child(command)
    answered = sum(1 for line in out.read_text().splitlines() if '"choices"' in line)
    if answered != args.requests:
        raise SystemExit(f"the cookbook's script answered {answered} of {args.requests}")
    return measured


def contenders(args: argparse.Namespace) -> dict[str, tuple[bool, Callable[..., Measured]]]:
    """name -> (streamed, run(url, work) -> what it measured)."""
    n, c = args.requests, args.concurrency
    plain, streamed = bodies(n, False), bodies(n, True)
    table: dict[str, tuple[bool, Callable[..., Measured]]] = {
        "bare-aiohttp": (False, lambda url, _w: in_process(bare_aiohttp, url, plain, c, False)),
        "bare-aiohttp-stream": (
            True,
            lambda url, _w: in_process(bare_aiohttp, url, streamed, c, True),
        ),
        "raw-aiohttp": (False, lambda url, _w: in_process(raw_aiohttp, url, plain, c, False)),
        "raw-aiohttp-stream": (
            True,
            lambda url, _w: in_process(raw_aiohttp, url, streamed, c, True),
        ),
        "raw-http11": (False, lambda url, _w: in_process(raw_http11, url, plain, c, False)),
        "raw-http11-stream": (
            True,
            lambda url, _w: in_process(raw_http11, url, streamed, c, True),
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
    parser.add_argument(
        "--token-ms",
        type=float,
        default=0.0,
        help="the server streams a write per token, this far apart (0: an answer in one write)",
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", help="comma-separated contenders (bare-aiohttp always runs)")
    parser.add_argument("--cookbook", type=Path, help="a copy of api_request_parallel_processor.py")
    args = parser.parse_args()
    table = contenders(args)
    server, url = start_server(args.tokens, args.token_ms)
    runs: dict[str, list[Figures]] = {name: [] for name in table}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            write_requests(work, args.requests)
            in_process(bare_aiohttp, url, bodies(200, True), args.concurrency, True)  # warm-up
            child([sys.executable, "-m", "batchrun", "--version"])  # its bytecode written
            for round_no in range(args.repeat):
                # Turns reversed every other round, so that what runs first (or just after a
                # given contender) is not always the same: batchrun's two modes are paired.
                turns = list(table.items())
                for name, (_stream, run) in turns[:: -1 if round_no % 2 else 1]:
                    server_cpu = process_cpu(server.pid)
                    measured = run(url, work)
                    runs[name].append(Figures(measured, process_cpu(server.pid) - server_cpu))
    finally:
        server.terminate()
        server.wait()
    report(runs, table, args)


def report(runs: dict[str, list[Figures]], table: dict, args: argparse.Namespace) -> None:
    n, tokens = args.requests, args.tokens
    writes = f"a write per token {args.token_ms:g} ms apart" if args.token_ms else "one write"
    where = f"zero-latency server in another process ({writes})"
    print(
        f"{n} chat requests of {tokens} tokens, {args.concurrency} in flight, {where}; median "
        f"of {args.repeat}. wall and CPU: the whole command; run req/s: the sending alone"
    )
    print(
        f"{'contender':20} {'wall':>7} {'req/s':>6} {'run req/s':>9} {'chunks/s':>8} {'CPU':>6} "
        f"{'ms/req':>6} {'us/chunk':>8} {'server ms/req':>13} {'vs aiohttp':>10}"
    )
    med = {name: _medians(figures) for name, figures in runs.items()}
    base = med["bare-aiohttp"][0]
    for name, (wall, cpu, run, server) in med.items():
        streamed = table[name][0]
        chunks = f"{n * tokens / run:8.0f}" if streamed else f"{'-':>8}"
        per_chunk = f"{cpu / (n * tokens) * 1e6:8.1f}" if streamed else f"{'-':>8}"
        print(
            f"{name:20} {wall:6.2f}s {n / wall:6.0f} {n / run:9.0f} {chunks} {cpu:5.2f}s "
            f"{cpu / n * 1e3:6.2f} {per_chunk} {server / n * 1e3:13.2f} {base / wall:9.2f}x"
        )
    goals(med, runs, n, tokens)


def paired(runs: dict[str, list[Figures]]) -> str:
    """batchrun's streamed time against its unstreamed time, round by round (the two run in
    adjacent turns, so the machine's drift between rounds falls on both): the median of the
    rounds' ratios, and their range, for the whole command and for the sending alone."""
    pairs = list(zip(runs["batchrun"], runs["batchrun-stream"], strict=True))
    shown = []
    for what, get in (("whole command", lambda m: m.wall_s), ("sending", lambda m: m.run_s)):
        ratios = [get(plain.measured) / get(streamed.measured) for plain, streamed in pairs]
        shown.append(
            f"{what}: {statistics.median(ratios):.2f} (rounds {min(ratios):.2f}-{max(ratios):.2f})"
        )
    return ", ".join(shown)


def _medians(figures: list[Figures]) -> tuple[float, float, float, float]:
    def median(get: Callable[[Figures], float]) -> float:
        return statistics.median(get(f) for f in figures)

    return (
        median(lambda f: f.measured.wall_s),
        median(lambda f: f.measured.client_cpu_s),
        median(lambda f: f.measured.run_s),
        median(lambda f: f.server_cpu_s),
    )


def goals(
    med: dict[str, tuple[float, float, float, float]],
    runs: dict[str, list[Figures]],
    n: int,
    tokens: int,
) -> None:
    """Issue 12's goals, where this run measured what they need."""
    plain, streamed, book = med.get("batchrun"), med.get("batchrun-stream"), med.get("cookbook")
    if plain and book:
        print(f"batchrun / cookbook, whole command: {book[0] / plain[0]:.2f}x (goal >= 1)")
    if plain and streamed:
        print(f"batchrun streamed / not streamed, {paired(runs)} (goal >= 0.9)")
        raw, raw_stream = med.get("raw-http11"), med.get("raw-http11-stream")
        if raw and raw_stream:
            # what streaming costs the engine alone, added to batchrun's unstreamed command
            extra = raw_stream[0] - raw[0]
            ceiling = plain[0] / (plain[0] + extra)
            print(
                f"  batchrun's engine alone adds {extra / n * 1e6:.0f} us a streamed request "
                f"(bytes read, nothing parsed): {ceiling:.2f} at best with it"
            )
    if streamed:
        print(f"batchrun streamed chunks/s (run): {n * tokens / streamed[2]:.0f} (goal >= 20,000)")
    if plain:
        print(f"batchrun requests/s not streamed (run): {n / plain[2]:.0f} (goal >= 2,000)")


if __name__ == "__main__":
    main()
