"""batchrun's HTTP/1.1 engine (backends/http11.py) against hostile servers: raw asyncio servers
on 127.0.0.1 that write scripted bytes, each test bounded by anyio.fail_after so a hang fails.

The tests under "Defects found" failed against the engine's first version (a hostile review)
and hold the fixes; those after them pin what it got right from the start (stale connections,
framing, cancellation, flow control)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import httpx
import pytest

from batchrun.backends.http11 import MAX_HEAD_BYTES, PAUSE_BYTES, UNANSWERED, Http11Transport

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
LIMIT = 5.0  # seconds any test may take: past it, the engine hung


async def _serve(handler: Handler) -> tuple[asyncio.Server, str]:
    """A server on 127.0.0.1 running `handler` per connection (errors from a client that went
    away are swallowed); returns it and its base URL."""

    async def guarded(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handler(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass  # a cancelled handler (the loop ending) would log an error otherwise
        finally:
            writer.close()

    server = await asyncio.start_server(guarded, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"


@contextlib.asynccontextmanager
async def _engine(
    handler: Handler, connections: int = 1, *, limit: float = LIMIT
) -> AsyncIterator[tuple[Http11Transport, str]]:
    """A server running `handler` and an engine of `connections` slots to ask it, closed after,
    all within `limit` seconds."""
    with anyio.fail_after(limit):
        server, url = await _serve(handler)
        async with server:
            transport = Http11Transport(connections)
            try:
                yield transport, url
            finally:
                await transport.aclose()


async def _request_in(reader: asyncio.StreamReader) -> bytes:
    """One request's head, its body read past."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = re.search(rb"(?i)content-length: *(\d+)", head)
    await reader.readexactly(int(length.group(1)) if length else 0)
    return head


def _sized(body: bytes, status: bytes = b"200 OK", extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 %s\r\ncontent-length: %d\r\n%s\r\n%s" % (status, len(body), extra, body)


def _scripted(answers: Callable[[int], bytes]) -> Handler:
    """Every request on a connection gets answers(n), n counted over all connections."""
    served = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        while True:
            await _request_in(reader)
            served += 1
            writer.write(answers(served - 1))
            await writer.drain()

    return handler


def _get(url: str, method: str = "POST", trace: Any = None, read_s: float | None = None):
    extensions: dict[str, Any] = {"timeout": {"connect": 2.0, "read": read_s}}
    if trace is not None:
        extensions["trace"] = trace
    content = b"{}" if method == "POST" else b""
    return httpx.Request(method, url + "/chat/completions", content=content, extensions=extensions)


class Trace:
    """The trace extension, which may await (as httpcore allows) on a named event."""

    def __init__(self, slow: str | None = None, wait_s: float = 0.0) -> None:
        self.events: list[str] = []
        self.slow, self.wait_s = slow, wait_s

    async def __call__(self, name: str, info: dict[str, Any]) -> None:
        self.events.append(name)
        if name == self.slow:
            await asyncio.sleep(self.wait_s)

    @property
    def opened(self) -> bool:
        return "connection.connect_tcp.complete" in self.events


async def _ask(
    transport: Http11Transport, url: str, *, trace: Any = None, read_s: float | None = None
) -> tuple[int, bytes]:
    response = await transport.handle_async_request(_get(url, trace=trace, read_s=read_s))
    try:
        return response.status_code, await response.aread()
    finally:
        await response.aclose()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with an RST (SO_LINGER 0)."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def _slot_free(transport: Http11Transport) -> bool:
    return not transport._slots.locked()


# ================================================================================================
# Defects found (each docstring says what the first version did)
# ================================================================================================


def test_a_pooled_connection_closed_while_the_trace_awaits_fails_rather_than_hangs() -> None:
    """The server closes an idle kept-alive connection after the pool handed it out but before
    the request is written (while the `http11.send_request_headers.started` trace awaits).
    Contract: a connection closed before a byte of response is RemoteProtocolError "Server
    disconnected without sending a response." (the backend's stale-connection re-send).
    Actual: send() writes into a closed transport (silently dropped); connection_lost had
    already run while the connection was idle, so no error is ever set: wait() hangs forever
    (read timeout None, as the backend sends it)."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request_in(reader)
        writer.write(_sized(b"ok"))
        await writer.drain()
        await asyncio.sleep(0.1)  # an idle keep-alive timeout: close the idle connection

    async def main() -> None:
        async with _engine(handler) as (transport, url):
            assert await _ask(transport, url) == (200, b"ok")
            trace = Trace("http11.send_request_headers.started", 0.4)
            with pytest.raises(httpx.RemoteProtocolError, match=UNANSWERED):
                await _ask(transport, url, trace=trace)

    anyio.run(main)


def test_a_new_connection_closed_while_the_trace_awaits_fails_rather_than_hangs() -> None:
    """The server accepts and closes at once; the `connection.connect_tcp.complete` trace
    awaits meanwhile. connection_lost sets UNANSWERED, then send() calls _start(), which
    clears `error`; the write is dropped and wait() hangs forever."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pass  # accept, then close

    async def main() -> None:
        async with _engine(handler) as (transport, url):
            trace = Trace("connection.connect_tcp.complete", 0.3)
            with pytest.raises(httpx.RemoteProtocolError, match=UNANSWERED):
                await _ask(transport, url, trace=trace)

    anyio.run(main)


def test_a_head_split_from_a_large_body_is_not_refused_as_too_large() -> None:
    """A 17-byte status line in one read, then the rest of a 60-byte head with the body in the
    next. data_received adds the *whole* read to head_bytes before parsing, so once a read
    carries 256 KiB (asyncio's read size; a kept-alive connection whose receive buffer grew on
    an earlier large body, the loop busy for a moment) 17 + 262144 > MAX_HEAD_BYTES and the
    valid answer is refused: RemoteProtocolError("response head too large")."""
    big, body = b"y" * (8 << 20), b"x" * (2 * MAX_HEAD_BYTES)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1"

    def serve() -> None:  # a thread: it writes while the client's loop is busy
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(_sized(big))  # grows the client's receive buffer
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\n")
            time.sleep(0.1)
            conn.sendall(b"content-length: %d\r\n\r\n" % len(body) + body)
            time.sleep(3)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()

    async def busy() -> None:
        await asyncio.sleep(0.05)
        time.sleep(0.5)  # the loop does other work while the rest of the answer comes in

    async def main() -> None:
        with anyio.fail_after(LIMIT):
            transport = Http11Transport(1)
            assert await _ask(transport, url) == (200, big)
            async with anyio.create_task_group() as tg:
                tg.start_soon(busy)
                status, got = await _ask(transport, url)
            assert (status, len(got)) == (200, len(body))
            await transport.aclose()

    try:
        anyio.run(main)
    finally:
        listener.close()


def test_a_response_in_flight_when_the_transport_closes_does_not_leave_an_open_connection() -> None:
    """transport.aclose() closes only the idle connections; a response still open then goes
    back to `_idle` when it is closed, after the transport was closed: that socket stays open
    for good (nothing will close it again), and the transport keeps serving new requests."""
    closed = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await _request_in(reader)
                writer.write(_sized(b"ok"))
                await writer.drain()
        except asyncio.IncompleteReadError:
            closed.set()  # the client closed its end

    async def main() -> None:
        with anyio.fail_after(LIMIT):
            server, url = await _serve(handler)
            async with server:
                transport = Http11Transport(1)
                response = await transport.handle_async_request(_get(url))
                await transport.aclose()  # while the response is open
                assert await response.aread() == b"ok"
                await response.aclose()
                assert transport._idle == {}, "a connection went back into a closed pool"
                with anyio.fail_after(1):
                    await closed.wait()

    anyio.run(main)


def test_a_body_read_after_its_response_closed_does_not_read_the_next_response() -> None:
    """Body.read / Body.chunks do not check that the body was closed: once its connection went
    back to the pool and carries the next request, the old Body reads the *next* response's
    bytes (and Body.ended() reports the next response's state). Expected: httpx.StreamClosed
    (or at least nothing of another response)."""

    async def main() -> None:
        async with _engine(_scripted(lambda n: _sized(b"answer %d" % n))) as (transport, url):
            first = await transport.handle_async_request(_get(url))
            assert await first.stream.read() == b"answer 0"
            await first.aclose()
            second = await transport.handle_async_request(_get(url))
            leaked = None
            with contextlib.suppress(httpx.StreamClosed):
                leaked = await first.stream.read()
            assert leaked is None, f"a closed body read another response: {leaked!r}"
            await second.aclose()

    anyio.run(main)


def test_a_head_request_is_refused_before_a_slot_or_a_connection_is_taken() -> None:
    """A HEAD response says a length its body never carries; llhttp would wait for it. A
    completion never sends one, so the engine refuses it at once rather than hang."""

    async def main() -> None:
        with anyio.fail_after(LIMIT):
            transport = Http11Transport(1)
            with pytest.raises(NotImplementedError, match="HEAD"):
                await transport.handle_async_request(_get("http://127.0.0.1:9/v1", "HEAD"))
            assert transport._slots._value == 1
            await transport.aclose()

    anyio.run(main)


def test_a_request_cancelled_while_the_connect_trace_awaits_closes_its_new_connection() -> None:
    """Cancelled in the `connection.connect_tcp.complete` trace, the request releases its slot
    but its freshly opened connection is neither closed nor pooled: `connection` is still None
    in handle_async_request's except, so the socket stays open until the process ends."""
    closed = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if await reader.read(1) == b"":
            closed.set()

    async def main() -> None:
        async with _engine(handler) as (transport, url):
            trace = Trace("connection.connect_tcp.complete", 10)
            with anyio.move_on_after(0.2):
                await _ask(transport, url, trace=trace)
            assert _slot_free(transport)
            with anyio.fail_after(1):
                await closed.wait()  # the client closed the connection it opened

    anyio.run(main)


def test_an_interim_then_part_of_the_answer_then_a_close_is_not_unanswered() -> None:
    """A kept-alive connection; the server answers the next POST with 100 Continue and the
    start of its final head, in one write, then closes. Bytes of answer came, so this is a head
    cut short ("mid-head"), and the backend must not re-send the POST. The engine resets
    head_bytes to 0 at the interim's end, in the middle of the read that also carries the cut
    head, so connection_lost says "Server disconnected without sending a response." and the
    backend's stale-connection rule (_unanswered + reused) re-sends a request the server had
    started to answer. (httpcore/h11: "peer unexpectedly closed connection".)"""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request_in(reader)
        writer.write(_sized(b"ok"))
        await writer.drain()
        await _request_in(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-le")
        await writer.drain()

    async def main() -> None:
        async with _engine(handler) as (transport, url):
            assert await _ask(transport, url) == (200, b"ok")
            with pytest.raises(httpx.RemoteProtocolError) as caught:
                await _ask(transport, url)
            assert str(caught.value) != UNANSWERED

    anyio.run(main)


# ================================================================================================
# Fine: what the engine gets right
# ================================================================================================


@pytest.mark.parametrize(
    "idle_bytes",
    [
        b"",
        b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
        b"\x00garbage",
        b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\n\r\n",
    ],
    ids=["fin", "408-close", "garbage", "408-kept"],
)
def test_a_pooled_connection_that_heard_anything_while_idle_is_not_reused(
    idle_bytes: bytes,
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request_in(reader)
        writer.write(_sized(b"ok"))
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(idle_bytes)
        await writer.drain()
        if idle_bytes and idle_bytes.endswith(b"\r\n\r\n") and b"close" not in idle_bytes:
            await _request_in(reader)  # keep it open: only what was heard may close it
            writer.write(_sized(b"wrongly reused"))
            await writer.drain()
            await asyncio.sleep(5)

    async def main() -> None:
        async with _engine(handler) as (transport, url):
            assert await _ask(transport, url) == (200, b"ok")
            await asyncio.sleep(0.2)
            trace = Trace()
            assert await _ask(transport, url, trace=trace) == (200, b"ok")
            assert trace.opened

    anyio.run(main)


def test_a_server_closing_right_after_an_answer_without_saying_so_costs_no_request() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request_in(reader)
        writer.write(_sized(b"ok"))  # then close, no "connection: close"

    async def main() -> None:
        async with _engine(handler) as (transport, url):
            for _ in range(3):
                await asyncio.sleep(0.05)
                assert await _ask(transport, url) == (200, b"ok")

    anyio.run(main)


@pytest.mark.parametrize("reset", [False, True], ids=["fin", "rst"])
def test_a_stale_pooled_connection_met_by_a_request_fails_as_the_backend_expects(
    reset: bool,
) -> None:
    """The request goes out on a kept-alive connection the server drops without answering."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request_in(reader)
        writer.write(_sized(b"ok"))
        await writer.drain()
        await _request_in(reader)
        if reset:
            _reset(writer)

    async def main() -> None:
        async with _engine(handler) as (transport, url):
            assert await _ask(transport, url) == (200, b"ok")
            trace = Trace()
            expected = httpx.ReadError if reset else httpx.RemoteProtocolError
            with pytest.raises(expected) as caught:
                await _ask(transport, url, trace=trace)
            assert reset or str(caught.value) == UNANSWERED
            assert not trace.opened  # the backend re-sends: it went out on a pooled one
            assert await _ask(transport, url) == (200, b"ok")

    anyio.run(main)


def test_a_reset_after_the_head_is_remote_protocol_error_mid_body() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request_in(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nabc")
        await writer.drain()
        await asyncio.sleep(0.1)
        _reset(writer)

    async def main() -> None:
        async with _engine(handler) as (transport, url):
            with pytest.raises(httpx.RemoteProtocolError, match="mid-body"):
                await _ask(transport, url)
            assert _slot_free(transport)

    anyio.run(main)


CHUNKED = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"


@pytest.mark.parametrize(
    ("answer", "body"),
    [
        (CHUNKED + b'5;ext=1;q="x"\r\nhello\r\n6\r\n world\r\n0\r\n\r\n', b"hello world"),
        (CHUNKED + b"5\r\nhello\r\n0\r\nx-trailer: 1\r\nx-other: 2\r\n\r\n", b"hello"),
        (CHUNKED + b"0\r\n\r\n", b""),
        (
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n"
            b"HTTP/1.1 102 Processing\r\n\r\n" + _sized(b"after three"),
            b"after three",
        ),
        (b"HTTP/1.1 204 No Content\r\n\r\n", b""),
        (b"HTTP/1.1 304 Not Modified\r\ncontent-length: 0\r\n\r\n", b""),
        (_sized(b""), b""),
    ],
    ids=["extensions", "trailers", "empty-chunked", "1xx-x3", "204", "304", "length-0"],
)
@pytest.mark.parametrize("bytewise", [False, True], ids=["whole", "byte-by-byte"])
def test_framing_edge_cases_come_whole_and_keep_the_connection(
    answer: bytes, body: bytes, bytewise: bool
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await _request_in(reader)
            if bytewise:
                for i in range(len(answer)):
                    writer.write(answer[i : i + 1])
                    await writer.drain()
                    await asyncio.sleep(0.001)
            else:
                writer.write(answer)
                await writer.drain()

    async def main() -> None:
        async with _engine(handler, limit=LIMIT * 2) as (transport, url):
            for i in range(2):
                trace = Trace()
                response = await transport.handle_async_request(_get(url, trace=trace))
                got = b"".join([part async for part in response.stream])
                await response.aclose()
                assert got == body
                assert trace.opened == (i == 0)

    anyio.run(main)


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (CHUNKED + b"zz\r\nhello\r\n0\r\n\r\n", "malformed"),
        (CHUNKED + b"a\r\nhel", "mid-body"),  # cut mid-chunk
        (CHUNKED + b"5\r\nhello\r\n0\r\n", "mid-body"),  # cut before the last CRLF
        (b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort", "mid-body"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\nabc", "malformed"),
        (
            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ntransfer-encoding: chunked\r\n\r\n"
            b"2\r\nab\r\n0\r\n\r\n",
            "malformed",
        ),
        (
            b"HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\nconnection: upgrade\r\n\r\n",
            "switched protocols",
        ),
        (b"HTTP/1.1 200 OK\r\ncontent-le", "mid-head"),
    ],
    ids=[
        "bad-size",
        "cut-mid-chunk",
        "cut-before-end",
        "short-length",
        "two-lengths",
        "length-and-chunked",
        "101",
        "cut-head",
    ],
)
def test_bad_framing_is_remote_protocol_error_and_frees_the_slot(answer: bytes, error: str) -> None:
    async def main() -> None:
        with anyio.fail_after(LIMIT):
            served = 0

            async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                nonlocal served
                await _request_in(reader)
                served += 1
                writer.write(answer if served == 1 else _sized(b"ok"))
                await writer.drain()
                if served == 1:
                    await asyncio.sleep(0.05)
                    return  # close
                await asyncio.sleep(5)

            server, url = await _serve(handler)
            async with server:
                transport = Http11Transport(1)
                with pytest.raises(httpx.RemoteProtocolError, match=error):
                    await _ask(transport, url)
                assert await _ask(transport, url) == (200, b"ok")
                await transport.aclose()

    anyio.run(main)


@pytest.mark.parametrize("when", ["completing-read", "before-close"])
def test_bytes_after_a_sized_body_end_it_and_drop_the_connection(when: str) -> None:
    """Unasked bytes glued to the read that completes the body, or coming after the body's end
    while the response is still open: the body is the sized one, the connection not pooled."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await _request_in(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\nabc")
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(b"defEXTRA BYTES" if when == "completing-read" else b"def")
            await writer.drain()
            if when == "before-close":
                await asyncio.sleep(0.05)
                writer.write(_sized(b"unasked"))

    async def main() -> None:
        async with _engine(handler) as (transport, url):
            for _ in range(2):
                trace = Trace()
                response = await transport.handle_async_request(_get(url, trace=trace))
                assert await response.aread() == b"abcdef"
                await asyncio.sleep(0.2)  # the unasked bytes come before the close
                await response.aclose()
                assert trace.opened

    anyio.run(main)


def test_a_close_delimited_body_with_keep_alive_ends_with_the_connection() -> None:
    answer = b"HTTP/1.1 200 OK\r\nconnection: keep-alive\r\n\r\nall of it"

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request_in(reader)
        writer.write(answer)

    async def main() -> None:
        async with _engine(handler) as (transport, url):
            for _ in range(2):
                trace = Trace()
                assert await _ask(transport, url, trace=trace) == (200, b"all of it")
                assert trace.opened

    anyio.run(main)


@pytest.mark.parametrize("where", ["head", "body", "slot", "wait_for"])
def test_cancellations_release_the_slot_once_and_never_pool_the_connection(where: str) -> None:
    served = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        while True:
            await _request_in(reader)
            served += 1
            if where == "body" and served <= 5:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")
            else:
                await asyncio.sleep(0.3)
                writer.write(_sized(b"ok"))
            await writer.drain()

    async def main() -> None:
        async with _engine(handler, limit=LIMIT * 2) as (transport, url):
            for _ in range(5):
                if where == "slot":  # cancelled waiting for the one slot
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(_ask, transport, url)
                        await asyncio.sleep(0.01)
                        with anyio.move_on_after(0.05):
                            await _ask(transport, url)
                elif where == "wait_for":
                    with pytest.raises(TimeoutError):
                        await asyncio.wait_for(_ask(transport, url), 0.05)
                elif where == "head":
                    with anyio.move_on_after(0.05):
                        await _ask(transport, url)
                else:
                    response = await transport.handle_async_request(_get(url))
                    try:
                        with anyio.move_on_after(0.05):
                            await response.aread()
                    finally:
                        await response.aclose()
                assert _slot_free(transport)
                assert transport._slots._value == 1
            status, _ = await _ask(transport, url)
            assert status == 200
            assert transport._slots._value == 1

    anyio.run(main)


def test_cancelled_while_connecting_frees_the_slot_and_timeout_is_connect_timeout() -> None:
    """A listener whose backlog is full: the SYN is dropped and connect() hangs."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(4):
        s = socket.socket()
        s.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            s.connect(("127.0.0.1", port))
        fillers.append(s)

    async def main() -> None:
        with anyio.fail_after(LIMIT):
            transport = Http11Transport(1)
            url = f"http://127.0.0.1:{port}/v1"
            with anyio.move_on_after(0.2) as scope:
                await _ask(transport, url)
            assert scope.cancelled_caught and _slot_free(transport)
            request = _get(url)
            request.extensions["timeout"] = {"connect": 0.2}
            with pytest.raises(httpx.ConnectTimeout):
                await transport.handle_async_request(request)
            assert _slot_free(transport)
            await transport.aclose()

    try:
        anyio.run(main)
    finally:
        for s in fillers:
            s.close()
        listener.close()


def test_read_timeout_between_chunks_and_a_timer_racing_data() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await _request_in(reader)
            writer.write(CHUNKED + b"1\r\na\r\n")
            await writer.drain()
            for _ in range(5):  # each gap under the read timeout
                await asyncio.sleep(0.1)
                writer.write(b"1\r\nb\r\n")
                await writer.drain()
            await asyncio.sleep(0.6)  # a gap past it
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    async def main() -> None:
        async with _engine(handler) as (transport, url):
            response = await transport.handle_async_request(_get(url, read_s=0.3))
            parts = []
            with pytest.raises(httpx.ReadTimeout):
                async for part in response.stream:
                    parts.append(part)
            await response.aclose()
            assert b"".join(parts) == b"abbbbb" and _slot_free(transport)
            trace = Trace()
            assert await _ask(transport, url, trace=trace, read_s=2) == (200, b"abbbbb")
            assert trace.opened  # the timed-out one was not pooled

    anyio.run(main)


def test_a_large_body_never_read_then_closed_frees_everything() -> None:
    body = b"z" * (4 * PAUSE_BYTES)

    async def main() -> None:
        async with _engine(_scripted(lambda n: _sized(body))) as (transport, url):
            response = await transport.handle_async_request(_get(url))
            await asyncio.sleep(0.3)  # the socket pauses past PAUSE_BYTES unread
            assert response.stream._connection.paused
            await response.aclose()
            status, got = await _ask(transport, url)
            assert status == 200 and got == body

    anyio.run(main)


def test_two_hosts_in_one_transport_keep_their_own_connections() -> None:
    async def main() -> None:
        with anyio.fail_after(LIMIT):
            a, url_a = await _serve(_scripted(lambda n: _sized(b"A")))
            b, url_b = await _serve(_scripted(lambda n: _sized(b"B")))
            async with a, b:
                transport = Http11Transport(2)
                for _ in range(3):
                    assert await _ask(transport, url_a) == (200, b"A")
                    assert await _ask(transport, url_b) == (200, b"B")
                assert sorted(len(v) for v in transport._idle.values()) == [1, 1]
                await transport.aclose()

    anyio.run(main)


def test_a_reset_before_any_answer_is_read_error_on_a_new_connection() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request_in(reader)
        _reset(writer)

    async def main() -> None:
        async with _engine(handler) as (transport, url):
            with pytest.raises(httpx.ReadError):
                await _ask(transport, url)
            assert _slot_free(transport)

    anyio.run(main)
