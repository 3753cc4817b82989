"""The aiohttp transport against a real `batchrun sim` on 127.0.0.1: connections kept alive and
shared by concurrent streams, bodies as they come, a body left half-read that costs nothing
after, and failures as the httpx exceptions the backend expects."""

from __future__ import annotations

import asyncio
import re
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import orjson
import pytest
import trustme

from batchrun.backends.aiohttp_transport import AiohttpTransport
from tests.integration.helpers import free_port


def _request(url: str, i: int, trace: Any = None) -> httpx.Request:
    body = {"model": "sim-1", "stream": True, "messages": [{"role": "user", "content": f"p{i}"}]}
    extensions = {"trace": trace} if trace is not None else {}
    return httpx.Request(
        "POST", url + "/chat/completions", content=orjson.dumps(body), extensions=extensions
    )


class Opened:
    """The trace extension: counts connections opened, as httpcore would name the event."""

    def __init__(self) -> None:
        self.events: list[str] = []

    async def __call__(self, name: str, info: dict[str, Any]) -> None:
        self.events.append(name)


def test_concurrent_streams_share_a_pool_of_kept_alive_connections(
    sim_server: Callable[..., str],
) -> None:
    url = sim_server("--ttft-ms", "20", "--tpot-ms", "2")
    transport = AiohttpTransport(16)
    traces = [Opened() for _ in range(96)]
    answers: list[bytes] = []

    async def main() -> None:
        async def one(i: int) -> None:
            response = await transport.handle_async_request(_request(url, i, traces[i]))
            try:
                answers.append(b"".join([part async for part in response.aiter_raw()]))
            finally:
                await response.aclose()

        async with anyio.create_task_group() as tg:
            for i in range(96):
                tg.start_soon(one, i)
        await transport.aclose()

    anyio.run(main)
    assert len(answers) == 96 and all(a.rstrip().endswith(b"data: [DONE]") for a in answers)
    opened = sum("connection.connect_tcp.complete" in t.events for t in traces)
    assert 1 <= opened <= 16  # the rest went out on kept-alive connections
    assert all("http11.send_request_headers.started" in t.events for t in traces)


def test_a_body_left_half_read_closes_its_connection_and_the_next_request_works(
    sim_server: Callable[..., str],
) -> None:
    url = sim_server("--tpot-ms", "5", "--min-output-tokens", "40")
    transport = AiohttpTransport(1)

    async def main() -> None:
        response = await transport.handle_async_request(_request(url, 1))
        async for _part in response.aiter_raw():
            break  # walk away after the first read
        await response.aclose()
        with anyio.fail_after(10):  # the only connection slot came back
            again = await transport.handle_async_request(_request(url, 2))
            body = await again.aread()
            await again.aclose()
        assert again.status_code == 200 and b"[DONE]" in body
        await transport.aclose()

    anyio.run(main)


def test_a_refused_connection_is_connect_error() -> None:
    transport = AiohttpTransport(4)

    async def main() -> None:
        request = httpx.Request("GET", f"http://127.0.0.1:{free_port()}/v1/models")
        with pytest.raises(httpx.ConnectError):
            await transport.handle_async_request(request)
        await transport.aclose()

    anyio.run(main)


async def _https_server(ca: Any, answer: bytes) -> tuple[asyncio.Server, int]:
    """One HTTPS listener on 127.0.0.1 whose certificate `ca` signed; every request gets
    `answer`."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = re.search(rb"(?i)content-length: *(\d+)", head)
        await reader.readexactly(int(length.group(1)) if length else 0)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(answer), answer))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=context)
    return server, server.sockets[0].getsockname()[1]


def test_https_trusts_httpx_roots_and_plain_http_never_loads_them(
    sim_server: Callable[..., str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    plain = sim_server()

    async def main() -> None:
        server, port = await _https_server(ca, b"{}")
        url = f"https://127.0.0.1:{port}/v1"
        async with server:
            transport = AiohttpTransport(2)
            response = await transport.handle_async_request(_request(plain, 1))
            await response.aread()
            await response.aclose()
            assert transport._tls is None  # an http:// endpoint loads no roots
            with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                await transport.handle_async_request(_request(url, 2))  # certifi's roots
            await transport.aclose()
            # SSL_CERT_FILE names the roots to trust, as it does for httpx
            monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "ca.pem"))
            transport = AiohttpTransport(2)
            response = await transport.handle_async_request(_request(url, 3))
            assert response.status_code == 200 and await response.aread() == b"{}"
            await response.aclose()
            await transport.aclose()

    anyio.run(main)
