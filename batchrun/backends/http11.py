"""batchrun's HTTP/1.1 engine under httpx's API: the default transport for real endpoints.

httpx stays the interface (requests, responses, injected transports in tests and the
simulator); only the wire work is ours: a pool of kept-alive connections, each an asyncio
protocol whose responses llhttp parses in C (httptools, the parser uvicorn runs on). It does
what a completion needs and no more (no proxies, redirects, cookies, HTTP/2 or upgrades), for
a fraction of what a general client costs per request and per streamed chunk
(benchmarks/engines.py and client_cost.py measure both; README: "What the client costs").

Its contract with the backend, beyond httpx.AsyncBaseTransport's:

- failures come back as the httpx exceptions httpcore raises for the same event (a refused
  connection: ConnectError; a connection closed before a byte of response: RemoteProtocolError
  "Server disconnected without sending a response."; a reset before one: ReadError; a head or
  body cut short, or one llhttp cannot parse: RemoteProtocolError; timeouts: ConnectTimeout,
  ReadTimeout);
- a request's `trace` extension hears httpcore's names for the two events the backend's
  stale-connection rule needs: `connection.connect_tcp.complete` when a connection was opened
  for the request, `http11.send_request_headers.started` when it goes out on one;
- a pooled connection that heard anything while idle (a response nobody asked for, a 408
  before a close, the close itself) is closed, never handed to the next request;
- response bodies are handed over as they arrive, all that has come at a time (`Body.chunks`),
  or in one piece (`Body.read`) when the caller wants all of it anyway; a closed body reads
  nothing more (httpx.StreamClosed: its connection may carry another response by now);
- HEAD is refused (NotImplementedError): its answer's head says a length it never carries.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httptools
import httpx

Trace = Callable[[str, dict[str, Any]], Awaitable[None]]
Key = tuple[str, str, int]  # scheme, host, port: the connections one pool list holds
CONNECT_S = 10.0
MAX_HEAD_BYTES = 256 * 1024  # a response head larger than this is refused, not buffered on
PAUSE_BYTES = 1 << 20  # body bytes held unread before the socket stops being read
UNANSWERED = "Server disconnected without sending a response."


class _Connection(asyncio.Protocol):
    """One connection: a request at a time written whole, its response parsed as it comes."""

    def __init__(self, key: Key) -> None:
        self.key = key
        self.parts: list[bytes] = []  # body bytes received and not yet taken
        self.on_body = self.parts.append  # llhttp's callback per body span: no Python frame
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle = False  # in the pool: anything heard now makes it unusable
        self.paused = False  # reading stopped: the body's reader is behind
        self._start()

    def _start(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.parts.clear()
        self.held = 0  # bytes received since the body's bytes were last taken
        self.head_bytes = 0  # bytes of the head that is not whole yet, in whole reads
        self.header_bytes = 0  # bytes of its header lines parsed so far
        self.heard = False  # a byte of answer came (an interim one included)
        self.head_done = False
        self.complete = False  # the whole response came
        self.interim = False  # a 1xx response, skipped
        self.error: Exception | None = None
        self.waiter: asyncio.Future[None] | None = None

    # --- the request side ----------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        error = self.error
        self._start()
        self.idle = False
        if self.closed:  # closed while the request's trace ran: not a byte of it answered
            self.error = error or httpx.RemoteProtocolError(UNANSWERED)
            return
        assert self.transport is not None
        self.transport.write(data)

    async def wait(self, read_s: float | None, *, body: bool) -> None:
        """Until the head came (`body` False) or, after it, body bytes or the body's end; a
        failure is raised once nothing that came before it is left. `read_s`: the longest
        wait for the next bytes."""
        while self.error is None and not self._ready(body):
            loop = asyncio.get_running_loop()
            waiter = self.waiter = loop.create_future()
            timer = None if read_s is None else loop.call_later(read_s, _expire, waiter)
            try:
                await waiter
            finally:
                self.waiter = None
                if timer is not None:
                    timer.cancel()
        if self.error is not None and not self._ready(body):
            raise self.error

    def _ready(self, body: bool) -> bool:
        return bool(self.parts) or self.complete if body else self.head_done

    def take(self) -> bytes:
        """The body bytes that came and were not taken yet."""
        parts = self.parts
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        parts.clear()
        self.held = 0
        if self.paused and not self.closed and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    # --- the protocol side ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.idle or self.complete or self.error is not None:
            self.close()  # bytes nobody asked for: this connection cannot be trusted again
            return
        self.heard = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(httpx.RemoteProtocolError("the server switched protocols"))
        except httptools.HttpParserError as exc:
            if not self.complete:
                self._fail(httpx.RemoteProtocolError(f"malformed response: {exc}"))
                return
            self.close()  # another response after this one's end (on_message_begin): the
            # answer came whole, its reader is woken below
        if not self.head_done:  # all of this read is head: counted after, so a body is not
            # (a head that ends in this read is counted by its header lines: on_header)
            self.head_bytes += len(data)
            if self.head_bytes > MAX_HEAD_BYTES:
                self._fail(httpx.RemoteProtocolError("response head too large"))
                return
        elif not self.complete:
            self.held += len(data)
            if self.held > PAUSE_BYTES and not self.paused and self.transport is not None:
                self.paused = True
                self.transport.pause_reading()  # the reader is behind: let TCP hold the rest
        self._wake()  # once a read, not once an event of a stream

    def on_message_begin(self) -> None:
        if self.complete:  # a response nobody asked for, in the same read: stop parsing
            raise _Stop

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))
        self.header_bytes += len(name) + len(value)
        if self.header_bytes > MAX_HEAD_BYTES:  # a head whole in one read, yet too large
            self.error = httpx.RemoteProtocolError("response head too large")
            raise _Stop

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:
            self.interim = True  # 100 Continue and the like: the answer comes after it
            return
        self.status = status
        self.head_done = True

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim, self.headers, self.head_bytes, self.header_bytes = False, [], 0, 0
            return
        self.complete = True
        if not self.parser.should_keep_alive():
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.idle or self.complete:
            return
        if self.head_done and exc is None and _to_close(self.headers):
            self.complete = True  # a body that ends with its connection: ended whole
        elif not self.heard:  # not a byte of answer
            if exc is None:
                self._fail(httpx.RemoteProtocolError(UNANSWERED))
            else:
                self._fail(httpx.ReadError(str(exc) or type(exc).__name__))
        else:
            where = "body" if self.head_done else "head"
            self._fail(httpx.RemoteProtocolError(f"peer closed connection mid-{where} ({exc})"))
        self._wake()

    def _fail(self, error: Exception) -> None:
        if self.error is None:
            self.error = error
        self.close()
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class _Stop(Exception):
    """Raised in a parser callback to stop parsing: bytes no request asked for, or a head
    too large."""


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(httpx.ReadTimeout("no bytes from the server within the timeout"))


def _to_close(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether a body is delimited by the connection's close: no length and not chunked."""
    names = {name.lower() for name, _ in headers}
    return b"content-length" not in names and b"transfer-encoding" not in names


class Http11Transport(httpx.AsyncBaseTransport):
    """At most `max_connections` requests in flight, on kept-alive connections (opened as
    needed, reused last-in first-out) unless `keepalive` is off: then one per request."""

    def __init__(self, max_connections: int, *, keepalive: bool = True) -> None:
        self._keepalive = keepalive
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: dict[Key, list[_Connection]] = {}
        self._tls: ssl.SSLContext | None = None
        self._closed = False  # aclose() ran: no connection goes back to the pool

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "HEAD":  # its answer's head says a length that never comes
            raise NotImplementedError("batchrun's HTTP engine does not send HEAD requests")
        timeouts = request.extensions.get("timeout", {})
        trace: Trace | None = request.extensions.get("trace")
        await self._slots.acquire()
        connection: _Connection | None = None
        try:
            connection, opened = await self._connection(request.url, timeouts.get("connect"))
            if trace is not None:
                if opened:
                    await trace("connection.connect_tcp.complete", {})
                await trace("http11.send_request_headers.started", {})
            connection.send(_written(request))
            await connection.wait(timeouts.get("read"), body=False)
        except BaseException:
            if connection is not None:
                connection.close()
            self._slots.release()
            raise
        body = Body(self, connection, read_s=timeouts.get("read"))
        return httpx.Response(
            status_code=connection.status,
            headers=connection.headers,
            stream=body,
            extensions={"http_version": b"HTTP/1.1"},
        )

    async def _connection(
        self, url: httpx.URL, connect_s: float | None
    ) -> tuple[_Connection, bool]:
        """A kept-alive connection to the URL's host that heard nothing while idle, or a new
        one (then True)."""
        key = (url.scheme, url.host, url.port or (443 if url.scheme == "https" else 80))
        idle = self._idle.get(key)
        while idle:
            connection = idle.pop()
            if not connection.closed:
                return connection, False
        return await self._open(key, CONNECT_S if connect_s is None else connect_s), True

    async def _open(self, key: Key, connect_s: float) -> _Connection:
        scheme, host, port = key
        tls = self._context() if scheme == "https" else None
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(connect_s):
                _, connection = await loop.create_connection(
                    lambda: _Connection(key),
                    host,
                    port,
                    ssl=tls,
                    server_hostname=host if tls else None,
                )
        except TimeoutError:
            raise httpx.ConnectTimeout(
                f"no connection to {host}:{port} within {connect_s:g}s"
            ) from None
        except (OSError, ssl.SSLError) as exc:
            raise httpx.ConnectError(str(exc) or type(exc).__name__) from None
        return connection

    def _context(self) -> ssl.SSLContext:
        """httpx's TLS settings: certifi's roots, or SSL_CERT_FILE / SSL_CERT_DIR. Made on the
        first https request: loading the roots takes tens of milliseconds."""
        if self._tls is None:
            self._tls = httpx.create_ssl_context()
        return self._tls

    def _done(self, connection: _Connection) -> None:
        """A response was closed: its connection goes back to the pool if its response ended
        whole and the server keeps it alive; else it is closed."""
        self._slots.release()
        if self._closed or not (self._keepalive and connection.complete and not connection.closed):
            connection.close()
            return
        connection.idle = True
        self._idle.setdefault(connection.key, []).append(connection)

    async def aclose(self) -> None:
        self._closed = True
        for connections in self._idle.values():
            for connection in connections:
                connection.close()
        self._idle.clear()


def _written(request: httpx.Request) -> bytes:
    """The request as it goes on the wire: its line, its headers, its body with its length."""
    content = request.read()
    lines = [b"%s %s HTTP/1.1" % (request.method.encode(), request.url.raw_path)]
    for name, value in request.headers.raw:
        if name.lower() not in (b"content-length", b"transfer-encoding"):
            lines.append(b"%s: %s" % (name, value))
    if content or request.method not in ("GET", "HEAD"):
        lines.append(b"content-length: %d" % len(content))
    lines.append(b"\r\n")
    return b"\r\n".join(lines) + content


class Body(httpx.AsyncByteStream):
    """A response body from the engine: iterated as it arrives, or `read` whole."""

    def __init__(
        self, transport: Http11Transport, connection: _Connection, *, read_s: float | None
    ) -> None:
        self._transport = transport
        self._connection = connection
        self._read_s = read_s
        self._open = True

    def ended(self) -> bool:
        """Whether the body's end has come in (its last bytes may be unread): the connection
        can go back to the pool without a read that waits."""
        return self._open and self._connection.complete

    async def read(self) -> bytes:
        connection, parts = self._connection, []
        while True:
            self._check_open()
            await connection.wait(self._read_s, body=True)
            if connection.parts:
                parts.append(connection.take())
            if connection.complete:
                return parts[0] if len(parts) == 1 else b"".join(parts)

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self.chunks()

    def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives: all that came since the last read, at a time."""
        return _Chunks(self)

    async def next_chunk(self) -> bytes | None:
        """All that came since the last read (waiting for some), or None at the body's end."""
        connection = self._connection
        while True:
            self._check_open()
            await connection.wait(self._read_s, body=True)
            if connection.parts:
                return connection.take()
            if connection.complete:
                return None

    def _check_open(self) -> None:
        """A closed body's connection may be carrying another response by now."""
        if not self._open:
            raise httpx.StreamClosed()

    async def aclose(self) -> None:
        # Whole, the connection goes back to the pool; else it is closed.
        if self._open:
            self._open = False
            self._transport._done(self._connection)


class _Chunks:
    """Body.chunks: an iterator object, not an async generator, which the event loop would
    track from its first step and the reader close at the end of every streamed answer."""

    __slots__ = ("_body",)

    def __init__(self, body: Body) -> None:
        self._body = body

    def __aiter__(self) -> _Chunks:
        return self

    async def __anext__(self) -> bytes:
        chunk = await self._body.next_chunk()
        if chunk is None:
            raise StopAsyncIteration
        return chunk
