"""What HTTP engines cost per request, not streamed and streamed: is there a cheaper one?

The streamed/not-streamed goal of issue 12 is bounded by the engine: what reading a stream's
bytes adds to a request. This runs the same raw loop (send, read the bytes as they come, nothing
else) on each engine against the zero-latency server (fast_server.py, another process), 32 in
flight, and prints CPU per request of this process (every thread: an engine's own included),
streamed and not, and what streaming adds, medians of `--repeat` alternating runs:

- aiohttp, as in client_cost.py's raw loops (batchrun's engine until its own);
- httptools-floor: llhttp's C parser (httptools) under a bare asyncio protocol that keeps
  connections alive and does nothing else (no timeouts, errors, TLS or pool limits): not a
  client, the floor an engine on it can approach;
- http11: batchrun's own engine on llhttp (backends/http11.py), under httpx's transport seam;
- pyreqwest (Rust reqwest) and curl_cffi (libcurl), asyncio clients that de-chunk in native code.

Then batchrun's backend itself (OpenAICompatBackend.complete: request, answer read and parsed,
errors mapped) on aiohttp's engine (benchmarks/aiohttp_transport.py, the transport batchrun
shipped before its own) and on its own: what the engine leaves of streaming's cost, and the
streamed/not ratio the backend alone allows.

Engines that are not installed are left out with a line saying so; none but httptools is a
dependency of batchrun (`pip install pyreqwest curl_cffi` to run them all).

    python benchmarks/engines.py [--requests 3000] [--repeat 3] [--tokens 30]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import resource
import statistics
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import httpx
from aiohttp_transport import AiohttpTransport
from client_cost import MODEL, bodies, raw_aiohttp, raw_http11, run_workers, start_server

from batchrun.backends.base import CompletionRequest
from batchrun.backends.openai_compat import OpenAICompatBackend

CONCURRENCY = 32
Loop = Callable[[str, list[bytes], int, bool], Awaitable[None]]


class _Floor(asyncio.Protocol):
    """One kept-alive connection: a request written whole, its response parsed by llhttp."""

    def __init__(self) -> None:
        import httptools

        self.parser = httptools.HttpResponseParser(self)
        self.transport: Any = None
        self.answered: asyncio.Future[None] | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        pass  # read as it comes, nothing kept: the raw loops' rule

    def on_message_complete(self) -> None:
        assert self.answered is not None
        self.answered.set_result(None)


async def httptools_floor(url: str, items: list[bytes], concurrency: int, stream: bool) -> None:
    loop = asyncio.get_running_loop()
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    idle: list[_Floor] = []

    async def send(body: bytes) -> None:
        head = f"POST {parts.path} HTTP/1.1\r\nhost: {parts.netloc}\r\n"
        head += f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        if idle:
            connection = idle.pop()
        else:
            _, connection = await loop.create_connection(_Floor, host, port)
        connection.answered = loop.create_future()
        connection.transport.write(head.encode() + body)
        await connection.answered
        idle.append(connection)

    await run_workers(concurrency, items, send)


def on_backend(transport: Callable[[int], httpx.AsyncBaseTransport | None]) -> Loop:
    """batchrun's backend on a transport (None: its own engine), one request repeated."""
    body = {"model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": "Hi."}]}

    async def loop(url: str, items: list[bytes], concurrency: int, stream: bool) -> None:
        base = url.removesuffix("/chat/completions")
        backend = OpenAICompatBackend(
            base, stream=stream, transport=transport(concurrency), max_connections=concurrency
        )
        request = CompletionRequest(endpoint="chat", body=body)

        async def send(_item: bytes) -> None:
            await backend.complete(request)

        try:
            await run_workers(concurrency, items, send)
        finally:
            await backend.aclose()

    return loop


async def pyreqwest(url: str, items: list[bytes], concurrency: int, stream: bool) -> None:
    from pyreqwest.client import ClientBuilder

    async with ClientBuilder().max_connections(concurrency).http1_only().build() as client:

        async def send(body: bytes) -> None:
            request = client.post(url).body_bytes(body).header("content-type", "application/json")
            async with request.build_streamed() as response:
                while await response.body_reader.read_chunk() is not None:
                    pass

        await run_workers(concurrency, items, send)


async def curl_cffi(url: str, items: list[bytes], concurrency: int, stream: bool) -> None:
    from curl_cffi.requests import AsyncSession

    headers = {"content-type": "application/json"}
    async with AsyncSession(max_clients=concurrency) as session:

        async def send(body: bytes) -> None:
            response = await session.post(url, data=body, headers=headers, stream=True)
            async for _data in response.aiter_content():
                pass
            await response.aclose()

        await run_workers(concurrency, items, send)


ENGINES: dict[str, tuple[str | None, Loop]] = {  # name: (module it needs, loop)
    "aiohttp": (None, raw_aiohttp),
    "httptools-floor": ("httptools", httptools_floor),
    "pyreqwest": ("pyreqwest", pyreqwest),
    "curl_cffi": ("curl_cffi", curl_cffi),
    "http11": (None, raw_http11),
    "batchrun/aiohttp": (None, on_backend(AiohttpTransport)),
    "batchrun/http11": (None, on_backend(lambda _: None)),
}


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def us_per_request(loop: Loop, url: str, items: list[bytes], stream: bool) -> float:
    asyncio.run(loop(url, items[:100], CONCURRENCY, stream))  # code warm (not connections)
    started = cpu_s()
    asyncio.run(loop(url, items, CONCURRENCY, stream))
    return (cpu_s() - started) / len(items) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=30)
    args = parser.parse_args()
    engines = {}
    for name, (module, loop) in ENGINES.items():
        if module is None or importlib.util.find_spec(module) is not None:
            engines[name] = loop
        else:
            print(f"{name}: left out ({module} is not installed)")
    server, base = start_server(args.tokens)
    url = base + "/chat/completions"
    times: dict[tuple[str, bool], list[float]] = {}
    try:
        for _ in range(args.repeat):  # alternated, so the machine's drift falls on all
            for name, loop in engines.items():
                for stream in (False, True):
                    items = bodies(args.requests, stream)
                    times.setdefault((name, stream), []).append(
                        us_per_request(loop, url, items, stream)
                    )
    finally:
        server.terminate()
        server.wait()
    print(
        f"{args.requests} requests of {args.tokens} tokens, {CONCURRENCY} in flight; client CPU"
        f" us a request, median of {args.repeat}"
    )
    columns = f"{'not streamed':>13} {'streamed':>9} {'added':>6} {'not/streamed':>13}"
    print(f"{'engine':16} {columns} {'vs aiohttp':>11}")
    base_us = statistics.median(times["aiohttp", False])
    for name in engines:
        plain, streamed = (statistics.median(times[name, s]) for s in (False, True))
        print(
            f"{name:16} {plain:13.0f} {streamed:9.0f} {streamed - plain:6.0f}"
            f" {plain / streamed:13.2f} {plain / base_us:10.2f}x"
        )


if __name__ == "__main__":
    main()
