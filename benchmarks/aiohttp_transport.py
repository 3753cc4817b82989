"""aiohttp's HTTP/1.1 engine under httpx's API: batchrun's transport for real endpoints until
its own engine (batchrun/backends/http11.py), kept here as the baseline benchmarks/engines.py
measures the backend against.

httpx stays the interface (requests, responses, injected transports in tests and the
simulator); only the wire work moves to aiohttp, whose parser and connection pool are in C
and cost a fraction of httpcore's per request and per streamed chunk (benchmarks/
client_cost.py measures both). One session, one connection pool of `max_connections`.

Its contract with the backend, beyond httpx.AsyncBaseTransport's:

- failures come back as the httpx exceptions httpcore would raise for the same event (a
  refused connection: ConnectError; a connection closed before a response: RemoteProtocolError
  "Server disconnected without sending a response."; a reset: ReadError; a body cut short:
  RemoteProtocolError; timeouts: ConnectTimeout / ReadTimeout);
- a request's `trace` extension hears httpcore's names for the two events the backend's
  stale-connection rule needs: `connection.connect_tcp.complete` when a connection was opened
  for the request, `http11.send_request_headers.started` when it goes out on one (told by the
  connector as it hands the connection over: aiohttp's own tracing costs a signal per event
  and per body read, a fifth of its cost per request);
- response bodies are handed over as they arrive, whole network reads at a time, or in one
  piece (`AiohttpBody.read`) when the caller wants all of it anyway.
"""

from __future__ import annotations

import asyncio
import functools
import ssl
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextvars import ContextVar
from typing import Any

import aiohttp
import httpx

from batchrun.backends.http11 import Body

Trace = Callable[[str, dict[str, Any]], Awaitable[None]]
CONNECT_S = 10.0

# The trace of the request the current task is sending (a task sends one request at a time).
_trace: ContextVar[Trace | None] = ContextVar("batchrun_trace", default=None)


class _Connector(aiohttp.TCPConnector):
    """aiohttp's pool, telling the sending request's trace whether its connection is new."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._used: weakref.WeakSet[Any] = weakref.WeakSet()  # connections already sent on

    async def connect(
        self, req: Any, traces: Any, timeout: aiohttp.ClientTimeout
    ) -> aiohttp.connector.Connection:
        connection = await super().connect(req, traces, timeout)
        while self._heard_while_idle(connection):
            connection.close()
            connection = await super().connect(req, traces, timeout)
        trace = _trace.get()
        protocol = connection.protocol
        if trace is not None and protocol is not None:
            if protocol not in self._used:
                await trace("connection.connect_tcp.complete", {})
            await trace("http11.send_request_headers.started", {})
        if protocol is not None:
            self._used.add(protocol)
        return connection

    def _heard_while_idle(self, connection: aiohttp.connector.Connection) -> bool:
        """Whether a pooled connection got bytes (or an error) while it sat idle: a response
        nobody asked for (a server's duplicate, a 408 before it closes). aiohttp's pool checks
        only that it is open, and its parser would hand that response to the next request on
        it as its answer; the connection is closed instead, and another one taken."""
        protocol = connection.protocol
        return protocol is not None and protocol in self._used and protocol.should_close


class AiohttpTransport(httpx.AsyncBaseTransport):
    def __init__(self, max_connections: int, *, keepalive: bool = True) -> None:
        self._max_connections = max_connections
        self._keepalive = keepalive
        self._session: aiohttp.ClientSession | None = None
        self._tls: ssl.SSLContext | None = None

    def _open(self) -> aiohttp.ClientSession:
        """Made on first use: a session belongs to the event loop it was made in."""
        if self._session is None:
            connector = _Connector(
                limit=self._max_connections,
                limit_per_host=0,
                force_close=not self._keepalive,
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,  # httpx decodes, as it would for httpcore
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"),
            )
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        session = self._open()
        timeouts = request.extensions.get("timeout", {})
        timeout = _client_timeout(timeouts.get("connect", CONNECT_S), timeouts.get("read"))
        token = _trace.set(request.extensions.get("trace"))
        try:
            response = await session.request(
                request.method,
                str(request.url),
                headers=request.headers.multi_items(),
                data=request.content or None,
                allow_redirects=False,
                timeout=timeout,
                ssl=self._context() if request.url.scheme == "https" else True,
            )
        except Exception as exc:
            raise _mapped(exc, before_response=True) from exc
        finally:
            _trace.reset(token)
        return httpx.Response(
            status_code=response.status,
            headers=response.raw_headers,
            stream=AiohttpBody(response),
            extensions={"http_version": b"HTTP/1.1"},
        )

    def _context(self) -> ssl.SSLContext:
        """httpx's TLS settings: certifi's roots, or SSL_CERT_FILE / SSL_CERT_DIR (aiohttp's
        own would trust only the system's, which some Pythons and containers lack). Made on
        the first https request: loading the roots takes tens of milliseconds."""
        if self._tls is None:
            self._tls = httpx.create_ssl_context()
        return self._tls

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


@functools.lru_cache(maxsize=16)
def _client_timeout(connect: float, read: float | None) -> aiohttp.ClientTimeout:
    """One per pair of values (they are the same for every request of a job), not per request."""
    return aiohttp.ClientTimeout(total=None, sock_connect=connect, sock_read=read)


class AiohttpBody(Body):
    """A response body from aiohttp: iterated as it arrives, or `read` whole. A subclass of the
    engine's body (every method overridden), so the backend reads it the ways it reads its
    own engine's (`ended`, `read`, `chunks`): the comparison is of engines alone."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response

    def ended(self) -> bool:
        """Whether the body's end has come in (its last bytes may be unread): the connection
        can go back to the pool without a read that waits."""
        return self._response.content.is_eof()

    async def read(self) -> bytes:
        try:
            return await self._response.read()
        except Exception as exc:
            raise _mapped(exc, before_response=False) from exc

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self.chunks()

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        """The body as it arrives, a whole network read at a time."""
        content = self._response.content
        try:
            while True:
                data = await content.readany()
                if not data:
                    return
                yield data
        except Exception as exc:
            raise _mapped(exc, before_response=False) from exc

    async def aclose(self) -> None:
        # Read to the end, the connection goes back to the pool; else it is closed.
        self._response.release()


def _mapped(exc: Exception, *, before_response: bool) -> Exception:
    """The httpx exception httpcore would have raised for the same event."""
    text = str(exc) or type(exc).__name__
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        if before_response:
            return httpx.RemoteProtocolError("Server disconnected without sending a response.")
        return httpx.RemoteProtocolError(f"peer closed connection mid-body ({text})")
    if isinstance(exc, aiohttp.ClientConnectorError):
        return httpx.ConnectError(text)
    if isinstance(exc, aiohttp.ClientPayloadError):
        return httpx.RemoteProtocolError(text)
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(text)
    if isinstance(exc, (aiohttp.SocketTimeoutError, asyncio.TimeoutError)):
        return httpx.ReadTimeout(text)
    if isinstance(exc, (aiohttp.ClientOSError, ConnectionError)):
        return httpx.ReadError(text)
    if isinstance(exc, aiohttp.ClientResponseError):  # a malformed response head
        return httpx.RemoteProtocolError(text)
    if isinstance(exc, aiohttp.ClientError):
        return httpx.TransportError(text)
    return exc
