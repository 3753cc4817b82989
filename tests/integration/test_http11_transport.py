"""batchrun's HTTP/1.1 engine (backends/http11.py) against real servers on 127.0.0.1 (`batchrun
sim`, and raw sockets that write what a test scripts): connections kept alive and shared by
concurrent streams, bodies as they come, a body left half-read that costs nothing after,
responses llhttp must frame (no length, 1xx first, one glued to the next, a head too large, a
body larger than the reader keeps up with), and failures as the httpx exceptions the backend
expects."""

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

from batchrun.backends.http11 import MAX_HEAD_BYTES, PAUSE_BYTES, Http11Transport
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
    transport = Http11Transport(16)
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
    transport = Http11Transport(1)

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
    transport = Http11Transport(4)

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
            transport = Http11Transport(2)
            response = await transport.handle_async_request(_request(plain, 1))
            await response.aread()
            await response.aclose()
            assert transport._tls is None  # an http:// endpoint loads no roots
            with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                await transport.handle_async_request(_request(url, 2))  # certifi's roots
            await transport.aclose()
            # SSL_CERT_FILE names the roots to trust, as it does for httpx
            monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "ca.pem"))
            transport = Http11Transport(2)
            response = await transport.handle_async_request(_request(url, 3))
            assert response.status_code == 200 and await response.aread() == b"{}"
            await response.aclose()
            await transport.aclose()

    anyio.run(main)


Script = Callable[[int], bytes]  # the bytes written for the nth request (from 0), all at once


async def _raw_server(script: Script, *, close: bool = False) -> tuple[asyncio.Server, str]:
    """A server on 127.0.0.1 that reads each request whole and writes what `script` gives for
    it (then closes the connection, with `close`)."""
    served = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                length = re.search(rb"(?i)content-length: *(\d+)", head)
                await reader.readexactly(int(length.group(1)) if length else 0)
                served += 1
                writer.write(script(served - 1))
                await writer.drain()
                if close:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"


async def _ask(transport: Http11Transport, url: str, i: int = 0) -> tuple[int, bytes, Opened]:
    trace = Opened()
    response = await transport.handle_async_request(_request(url, i, trace))
    try:
        return response.status_code, await response.aread(), trace
    finally:
        await response.aclose()


def _sized(body: bytes, status: bytes = b"200 OK") -> bytes:
    return b"HTTP/1.1 %s\r\ncontent-length: %d\r\n\r\n%s" % (status, len(body), body)


def test_a_body_without_a_length_ends_with_its_connection_and_is_read_whole() -> None:
    async def main() -> None:
        server, url = await _raw_server(lambda n: b"HTTP/1.1 200 OK\r\n\r\nall of it", close=True)
        async with server:
            transport = Http11Transport(2)
            assert (await _ask(transport, url))[:2] == (200, b"all of it")
            status, body, trace = await _ask(transport, url, 1)  # that connection is not reused
            assert (status, body) == (200, b"all of it")
            assert "connection.connect_tcp.complete" in trace.events
            await transport.aclose()

    anyio.run(main)


def test_an_interim_100_is_skipped_and_the_answer_after_it_is_the_response() -> None:
    continued = b"HTTP/1.1 100 Continue\r\n\r\n" + _sized(b"{}")

    async def main() -> None:
        server, url = await _raw_server(lambda n: continued)
        async with server:
            transport = Http11Transport(1)
            for i in range(2):  # and the connection goes on serving
                status, body, trace = await _ask(transport, url, i)
                assert (status, body) == (200, b"{}")
            assert "connection.connect_tcp.complete" not in trace.events
            await transport.aclose()

    anyio.run(main)


def test_a_response_glued_to_the_answer_is_not_read_and_its_connection_not_reused() -> None:
    # The unasked second response comes in the same write as the answer: llhttp would parse it
    # on into the answer's state; the engine stops at the answer's end and drops the connection.
    async def main() -> None:
        server, url = await _raw_server(lambda n: _sized(b"n%d" % n) + _sized(b"unasked"))
        async with server:
            transport = Http11Transport(1)
            for i in range(3):
                status, body, trace = await _ask(transport, url, i)
                assert (status, body) == (200, b"n%d" % i)
                assert "connection.connect_tcp.complete" in trace.events  # a new one each time
            await transport.aclose()

    anyio.run(main)


def test_a_head_too_large_or_not_http_is_remote_protocol_error() -> None:
    huge = b"HTTP/1.1 200 OK\r\nx-pad: " + b"a" * (MAX_HEAD_BYTES + 1) + b"\r\n\r\n"
    heads = [huge, b"SSH-2.0-OpenSSH_9.6\r\n\r\n"]

    async def main() -> None:
        server, url = await _raw_server(lambda n: heads[n])
        async with server:
            transport = Http11Transport(1)
            with pytest.raises(httpx.RemoteProtocolError, match="response head too large"):
                await _ask(transport, url)
            with pytest.raises(httpx.RemoteProtocolError, match="malformed response"):
                await _ask(transport, url, 1)  # the slot came back after the failure
            await transport.aclose()

    anyio.run(main)


def test_a_body_larger_than_the_reader_keeps_up_with_comes_whole_and_in_order() -> None:
    # Past PAUSE_BYTES unread the socket stops being read; taking the bytes starts it again.
    body = bytes(range(256)) * (3 * PAUSE_BYTES // 256)

    async def main() -> None:
        server, url = await _raw_server(lambda n: _sized(body))
        async with server:
            transport = Http11Transport(1)
            response = await transport.handle_async_request(_request(url, 0))
            parts = []
            async for part in response.aiter_raw():
                parts.append(part)
                await anyio.sleep(0.01)  # a slow reader
            await response.aclose()
            assert b"".join(parts) == body
            assert (await _ask(transport, url, 1))[1] == body  # the connection was kept
            await transport.aclose()

    anyio.run(main)


def test_no_bytes_within_the_read_timeout_is_read_timeout_and_frees_the_slot() -> None:
    answers = [b"", _sized(b"{}")]  # the first request is never answered

    async def main() -> None:
        server, url = await _raw_server(lambda n: answers[n])
        async with server:
            transport = Http11Transport(1)
            request = _request(url, 0)
            request.extensions["timeout"] = {"read": 0.2}
            with pytest.raises(httpx.ReadTimeout):
                await transport.handle_async_request(request)
            with anyio.fail_after(10):
                assert (await _ask(transport, url, 1))[:2] == (200, b"{}")
            await transport.aclose()

    anyio.run(main)


def test_a_connection_closed_unanswered_or_mid_body_says_which() -> None:
    cut = b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhalf"
    scripts = [b"", cut]

    async def main() -> None:
        server, url = await _raw_server(lambda n: scripts[n], close=True)
        async with server:
            transport = Http11Transport(1)
            with pytest.raises(httpx.RemoteProtocolError, match="without sending a response"):
                await _ask(transport, url)
            with pytest.raises(httpx.RemoteProtocolError, match="mid-body"):
                await _ask(transport, url, 1)
            await transport.aclose()

    anyio.run(main)
