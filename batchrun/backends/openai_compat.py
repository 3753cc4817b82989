"""The OpenAI-compatible client: chat and completions, streamed (default) or not.

Streaming gives time to first token and catches a stream cut short; `stream_options.include_usage`
asks for token counts at the end, and is dropped for the rest of the run if a server refuses it.
Every HTTP or transport failure leaves this module as a batchrun error type.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import anyio
import httpx
import orjson

from batchrun import __version__
from batchrun.backends.answers import StreamedAnswer, read_json
from batchrun.backends.base import Completion, CompletionRequest, Watch, auth_headers
from batchrun.backends.errors_http import error_for_status, rate_info, scrubbed
from batchrun.backends.http11 import Body, Http11Transport
from batchrun.errors import (
    BadRequest,
    ConnectionFailed,
    EmptyStream,
    RequestError,
    RequestTimeout,
    StreamCut,
)

ENDPOINT_PATHS = {"chat": "/chat/completions", "completions": "/completions"}
DONE_GRACE_S = 1.0  # how long the body may take to end after `[DONE]` (see _body_end)


class OpenAICompatBackend:
    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        auth: str = "bearer",
        timeout: float = 120.0,
        stream: bool = True,
        stream_options: bool = True,
        max_connections: int = 64,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.stream = stream
        self.stream_options = stream_options
        self._api_key = api_key
        self._max_connections = max_connections
        # batchrun's own engine under httpx (see http11.py): its cost per request and per
        # streamed chunk is a fraction of httpcore's. Requests go straight to the transport:
        # httpx.AsyncClient's cookies, redirects, auth and URL merging cost more per request
        # than the wire itself, and a completion needs none of them.
        self._transport = transport or Http11Transport(max_connections)
        self._owns_transport = transport is None
        self._fresh_transport: httpx.AsyncBaseTransport | None = None  # see _fresh
        headers = {"content-type": "application/json", "user-agent": f"batchrun/{__version__}"}
        headers.update(auth_headers(auth, api_key))
        self._raw_headers = httpx.Headers(headers).raw
        # No read timeout: every request runs under one deadline (timeout), which a per-read
        # timer (restarted on each network read, one timer a streamed token) cannot beat.
        self._timeouts = httpx.Timeout(timeout, connect=min(timeout, 10.0), read=None).as_dict()
        self._urls = {
            kind: httpx.URL(self.base_url + path) for kind, path in ENDPOINT_PATHS.items()
        }
        self._host = httpx.URL(self.base_url).netloc  # every request's: httpcore's pool needs it
        self._userinfo = httpx.URL(self.base_url).userinfo.decode()  # user:password: a secret
        # Requests sent again because their pooled connection was found closed (see
        # _complete_once): not attempts, so nothing else counts them.
        self.stale_resends = 0

    async def _send(
        self,
        transport: httpx.AsyncBaseTransport,
        method: str,
        url: httpx.URL,
        content: bytes | None = None,
        trace: _ConnectionTrace | None = None,
    ) -> httpx.Response:
        """One request through the transport (its response must be closed by the caller)."""
        extensions: dict[str, Any] = {"timeout": self._timeouts}
        if trace is not None:
            extensions["trace"] = trace
        # The body as a stream with its length given: httpx then skips guessing the body's
        # kind and merging default headers (a request costs 5 µs to build, not 18).
        headers = [*self._raw_headers, (b"host", self._host)]
        if content is not None:
            headers.append((b"content-length", b"%d" % len(content)))
        stream = httpx.ByteStream(content or b"")
        request = httpx.Request(method, url, headers=headers, stream=stream, extensions=extensions)
        request.read()  # `request.content` for transports that read it (the simulator's)
        return await transport.handle_async_request(request)

    def _fresh(self) -> httpx.AsyncBaseTransport:
        """The transport for sending again after a stale pooled connection: it keeps no
        connection alive, so each request opens its own.

        Sending again through the pool would not do: the pool hands out its first idle
        connection, and idle connections go stale together (one keep-alive timeout after a lull
        ages them all), so the re-send could meet another stale one; bounding that by the idle
        ones would allow as many re-sends as the pool holds connections. A connection opened
        for the request cannot have timed out or run out of requests, so one re-send is enough
        and a failure on it is the server's own. Made on first need: most runs never need it.
        An injected transport (the simulator, tests) owns its connections, so the re-send goes
        through it, still once.
        """
        if not self._owns_transport:
            return self._transport
        if self._fresh_transport is None:
            self._fresh_transport = Http11Transport(self._max_connections, keepalive=False)
        return self._fresh_transport

    async def aclose(self) -> None:
        await self._transport.aclose()
        if self._fresh_transport is not None:
            await self._fresh_transport.aclose()

    async def list_models(self) -> list[str]:
        try:
            return await self._list_models()
        except RequestError as exc:
            raise self._scrub(exc) from None

    async def _list_models(self) -> list[str]:
        url = f"{self.base_url}/models"
        try:
            with anyio.fail_after(self.timeout):
                response = await self._send(self._transport, "GET", httpx.URL(url))
                try:
                    content = await _readable_body(response)
                finally:
                    await response.aclose()
        except httpx.ConnectTimeout:
            raise self._no_connection(url) from None
        except (TimeoutError, httpx.TimeoutException):
            raise RequestTimeout(f"no answer from {url} within {self.timeout:g}s") from None
        except httpx.TransportError as exc:
            raise ConnectionFailed(self._describe(exc, url)) from None
        if response.status_code >= 300:
            raise error_for_status(response.status_code, response.headers, content, url)
        try:
            data = orjson.loads(content)
            return [str(m["id"]) for m in data.get("data", [])]
        except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError):
            raise StreamCut(f"{url} did not return a model list") from None

    async def complete(
        self, request: CompletionRequest, *, watch: Watch | None = None
    ) -> Completion:
        """One attempt, as the retry policy and the concurrency controller count them, under one
        deadline (`timeout`) for all of it: the asks again below included, or a server that
        answered each slowly could hold it for several.

        A bare cancel scope, not fail_after: the same deadline at half the cost per request
        (fail_after wraps it in a generator-based context manager). The raise after the block
        runs only when the deadline cancelled it (or a transport timed out itself).

        An ask again is a request of its own: the answer or error says why the first did not
        count (`asked_again`), so that it is counted and logged as one."""
        again: list[str] = []
        try:
            with anyio.CancelScope(deadline=anyio.current_time() + self.timeout):
                try:
                    completion = await self._complete(request, watch, again)
                    return replace(completion, asked_again=tuple(again)) if again else completion
                except TimeoutError:  # a transport's own (an injected one)
                    pass
            raise RequestTimeout(f"no complete answer within {self.timeout:g}s")
        except RequestError as exc:
            exc.asked_again = tuple(again)
            raise self._scrub(exc) from None

    async def _complete(
        self, request: CompletionRequest, watch: Watch | None, again: list[str]
    ) -> Completion:
        try:
            return await self._complete_once(request, watch=watch)
        except BadRequest as exc:
            if self.stream and self.stream_options and "stream_options" in str(exc):
                self.stream_options = False  # this server refuses it; ask without it
                again.append("the server refused stream_options; asked again without it")
                return await self._complete_once(request, watch=watch)
            raise
        except EmptyStream:
            # Ask once more without streaming: a server that says nothing in a stream
            # says why in a plain answer (a 400 naming the context limit, say).
            again.append("the event stream closed without a single event; asked again unstreamed")
            try:
                return await self._complete_once(request, stream=False)
            except ConnectionFailed:  # it closed the connection the stream came on
                again.append("the connection closed before the plain ask was answered; asked again")
                return await self._complete_once(request, stream=False)

    async def _complete_once(
        self,
        request: CompletionRequest,
        *,
        stream: bool | None = None,
        watch: Watch | None = None,
    ) -> Completion:
        """One request (and its re-send, if it met a stale connection).

        A keep-alive connection the server closed just as we reused it (cpp-httplib's
        keep-alive timeout or request limit, racing our next request) fails before a byte of
        answer comes back: that request goes again at once on a new connection (see _fresh),
        inside the same attempt, so it is neither a retry nor a sign of overload. Everything
        else is the server's failure, raised as before: a new connection closed unanswered
        (the re-send's included), a refused one, an answer cut or garbled after its first
        bytes. Go's net/http re-sends a reused connection's failed request likewise, but a POST
        only if none of it was written or it carries an idempotency key: a completion has no
        side effect that a second send would repeat, beyond its cost when a server that took
        it closed the connection without a word (then one attempt sends it twice).
        """
        out = self._outgoing(request, stream, watch)
        try:
            return await self._post(self._transport, out, watch_reuse=True)
        except _StaleConnection:
            self.stale_resends += 1
            return await self._post(self._fresh(), out, watch_reuse=False)

    def _outgoing(
        self, request: CompletionRequest, stream: bool | None, watch: Watch | None
    ) -> _Outgoing:
        body = dict(request.body)
        if self.stream if stream is None else stream:
            body["stream"] = True
            if self.stream_options:
                body["stream_options"] = {"include_usage": True}
        url = self._urls[request.endpoint]
        return _Outgoing(url, orjson.dumps(body), request.endpoint, time.perf_counter(), watch)

    async def _post(
        self, transport: httpx.AsyncBaseTransport, out: _Outgoing, *, watch_reuse: bool
    ) -> Completion:
        """Send once. With `watch_reuse`, a pooled connection found closed before a byte of
        answer came back raises _StaleConnection rather than ConnectionFailed."""
        trace = _ConnectionTrace() if watch_reuse else None
        answered = receiving = False
        try:
            resp = await self._send(transport, "POST", out.url, out.content, trace)
            answered = True
            try:
                if resp.status_code >= 300:  # a redirect too: not followed (error_for_status)
                    content = await _readable_body(resp)
                    raise error_for_status(resp.status_code, resp.headers, content, str(out.url))
                receiving = True
                if out.watch is not None:
                    out.watch.accepted()
                completion = await self._read_answer(resp, out)
            finally:
                await resp.aclose()
            if resp.status_code != 200:  # a 2xx of another number: logged as it was
                completion = replace(completion, http_status=resp.status_code)
            rate = rate_info(resp.headers)
            return replace(completion, rate=rate) if rate else completion
        except httpx.ConnectTimeout:
            raise self._no_connection(str(out.url)) from None
        except httpx.TimeoutException:
            raise RequestTimeout(f"no complete answer within {self.timeout:g}s") from None
        except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
            if receiving:
                raise StreamCut(f"connection dropped mid-answer: {self._describe(exc)}") from None
            if not answered and trace is not None and trace.reused and _unanswered(exc):
                raise _StaleConnection(self._describe(exc, str(out.url))) from None
            raise ConnectionFailed(self._describe(exc, str(out.url))) from None
        except httpx.TransportError as exc:
            raise ConnectionFailed(self._describe(exc, str(out.url))) from None
        except httpx.DecodingError as exc:  # not a TransportError: a body, not a connection
            problem = f"the answer does not decode as its content-encoding says: {exc}"
            raise StreamCut(problem) from None

    async def _read_answer(self, resp: httpx.Response, out: _Outgoing) -> Completion:
        if "text/event-stream" in resp.headers.get("content-type", "").lower():
            return await self._read_stream(resp, out)
        return read_json(await _whole_body(resp), out.endpoint, out.started)

    async def _read_stream(self, resp: httpx.Response, out: _Outgoing) -> Completion:
        answer = StreamedAnswer(out.endpoint, out.started, out.watch)
        body = _body(resp)
        async for data in body:
            answer.feed(data)
            if answer.done:
                completion = answer.completion()  # whole (or not) now: its latency ends here
                if not (isinstance(resp.stream, Body) and resp.stream.ended()):
                    left = anyio.current_effective_deadline() - anyio.current_time()
                    await _body_end(body, min(DONE_GRACE_S, left / 2))
                return completion
        answer.close()
        if not answer.events:
            raise EmptyStream("the event stream closed without a single event")
        return answer.completion()

    def _no_connection(self, url: str) -> RequestTimeout:
        """A connection not made within the connect timeout (10 s at most, not --timeout)."""
        return RequestTimeout(f"no connection within {self._timeouts['connect']:g}s ({url})")

    @staticmethod
    def _describe(exc: Exception, url: str | None = None) -> str:
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return f"{text} ({url})" if url else text

    def _scrub(self, error: RequestError) -> RequestError:
        """Make sure the key (or a user:password in the URL) cannot leak through our messages,
        echoed by a server or in a URL: applied once, where errors leave this class."""
        return scrubbed(error, self._api_key, self._userinfo)


@dataclass(frozen=True, slots=True)
class _Outgoing:
    """One request as sent, and sent again unchanged if its connection was stale."""

    url: httpx.URL
    content: bytes
    endpoint: str
    started: float  # a re-send's latency and TTFT count from the first send
    watch: Watch | None


class _StaleConnection(ConnectionFailed):
    """A pooled connection the server had closed before answering; never leaves this module."""


class _ConnectionTrace:
    """httpcore's `trace` extension, watched to learn whether a request went out on a
    connection the pool already held (keep-alive) or on one opened for it.

    httpcore names its events `connection.connect_tcp.*` when it opens a connection and
    `http11.send_request_headers.*` when it sends on one. Transports without sockets (the
    simulator, httpx.MockTransport) send no events: their failures are never stale.
    """

    def __init__(self) -> None:
        self.opened = False
        self.sent = False

    async def __call__(self, name: str, info: dict[str, Any]) -> None:
        if name.startswith("connection.connect_"):
            self.opened = True
        elif name.endswith(".send_request_headers.started"):
            self.sent = True

    @property
    def reused(self) -> bool:
        return self.sent and not self.opened


def _body(resp: httpx.Response) -> AsyncIterator[bytes]:
    """The body as it arrives. We ask for no compression, so it comes as sent: read it as the
    transport hands it over (the engine's straight from its reads, one iterator rather than
    three generators a network read), unless a server compressed it all the same."""
    if resp.is_stream_consumed:  # a response made whole (an injected test transport)
        return _once(resp.content)
    if resp.headers.get("content-encoding", "identity") != "identity":
        return _passed(resp.aiter_bytes())
    if isinstance(resp.stream, Body):
        return resp.stream.chunks()
    return _passed(resp.aiter_raw())


async def _once(content: bytes) -> AsyncGenerator[bytes, None]:
    yield content


async def _passed(parts: AsyncIterator[bytes]) -> AsyncGenerator[bytes, None]:
    async for part in parts:
        yield part


async def _whole_body(resp: httpx.Response) -> bytes:
    """The whole body: in one read where the engine carries it uncompressed (no async
    iteration per network read), else as it arrives."""
    encoding = resp.headers.get("content-encoding", "identity")
    if encoding == "identity" and isinstance(resp.stream, Body):
        return await resp.stream.read()
    return b"".join([part async for part in _body(resp)])


async def _readable_body(resp: httpx.Response) -> bytes:
    """The whole body, or nothing where it does not decode as its content-encoding says: read
    for an error's message (its status says enough) or a model list (then there is none)."""
    try:
        return await resp.aread()
    except httpx.DecodingError:
        return b""


async def _body_end(body: AsyncIterator[bytes], grace: float) -> None:
    """After `[DONE]` the answer is whole. Servers end the body right after it, and a body read
    to its end leaves the connection for the next request, so read on, but only briefly, and
    never at the answer's cost: a server that holds the connection open past `[DONE]`, or
    drops it there, loses that connection. `grace` keeps clear of the request's own deadline
    (asked for only here: most bodies have ended with `[DONE]`)."""
    with anyio.CancelScope(deadline=anyio.current_time() + grace):
        try:
            async for _ in body:
                pass
        except (httpx.TransportError, httpx.DecodingError):
            pass  # the body ended badly after the answer (a cut, a bad gzip trailer): not it


def _unanswered(exc: httpx.TransportError) -> bool:
    """Whether the connection ended with nothing read back: a reset, or httpcore's "Server
    disconnected without sending a response." A malformed answer (bytes came back) is not."""
    return isinstance(exc, httpx.ReadError) or str(exc).startswith("Server disconnected")
