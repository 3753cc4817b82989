"""A small misbehaving HTTP/1.1 server on 127.0.0.1, written with plain asyncio for these tests.

It answers OpenAI-style chat requests (streamed or not) on keep-alive connections, and closes
them the way cpp-httplib (under llama.cpp's llama-server) can: when its keep-alive limit or
timeout runs out just as the client sends its next request on the idle connection. Which of
the two ran out makes no difference on the wire: the connection looked reusable (no
`Connection: close`, no FIN yet) and the next request meets a closed connection. Here the race
is lost on purpose, every time: after `keep` answers on a connection the server waits for the
next request and drops it unanswered, so a test needs no luck with timing to see it.

Other switches make it drop every request on every connection unanswered (a server that is
broken, not racing), cut each answer after its head and first chunk, answer with bytes that
are not HTTP at all, or send a body the test wrote (a stream that is not whole, bytes that are
not UTF-8), then ending the body, holding the connection open without ending it, or dropping
the connection. It can also wait before each answer, add header lines (a content-encoding
its bytes do not have, a Location), name a stream's type otherwise, and send a response
nobody asked for on a connection that sits idle after an answer.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import orjson

NOT_HTTP = b"SSH-2.0-nope\r\n\r\n"  # what a port that is not an HTTP server says


@dataclass
class Behaviour:
    """What the server does; tests may change it while the server runs."""

    keep: int | None = None  # answers per connection, then the next request there is dropped
    reset: bool = False  # drop with a TCP RST (data unread), not a FIN after reading it
    drop_all: bool = False  # drop every request, on new connections too, unanswered
    cut: bool = False  # send the head and the first piece of each answer, then close
    garbage: bool = False  # answer with bytes that are not HTTP, then close
    body: bytes | None = None  # this body (SSE when streamed, else JSON) instead of an answer
    status: int = 200  # ... with this status (to every request, GET /models included)
    after: str = "end"  # after a streamed body: "end" it, "hold" the connection open, "drop" it
    delay: float = 0.0  # seconds before each answer
    head: bytes = b""  # header lines added to every answer's head (each ending in CRLF)
    stream_type: bytes = b"text/event-stream"  # a stream's content-type
    # after each answer, with the connection idle: "again" (the same answer once more, a
    # duplicate nobody asked for) or "408" (a 408 Request Timeout, the connection left open)
    unasked: str | None = None


@dataclass
class Counts:
    connections: int = 0
    answered: int = 0  # whole answers sent
    dropped: int = 0  # requests that met a closing connection, not a byte of answer sent
    cut: int = 0  # answers cut (or garbled) after some bytes
    prompts: list[str] = field(default_factory=list)  # of every request that arrived


class HostileServer:
    """`async with HostileServer(Behaviour(keep=3)) as server:` serves on `server.url`."""

    def __init__(self, behaviour: Behaviour) -> None:
        self.behaviour = behaviour
        self.counts = Counts()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        assert self._server is not None
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/v1"

    async def __aenter__(self) -> HostileServer:
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):  # wait_closed waits for them on Python 3.12+
            writer.close()
        await self._server.wait_closed()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.counts.connections += 1
        self._writers.add(writer)
        served = 0
        try:
            while (request := await _read_request(reader)) is not None:
                self.counts.prompts.append(_prompt(request))
                if not await self._reply(reader, writer, request, served):
                    return
                served += 1
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _reply(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        request: dict[str, Any],
        served: int,
    ) -> bool:
        """Answer one request, or misbehave; whether the connection stays open."""
        how = self.behaviour
        if how.drop_all or (how.keep is not None and served >= how.keep):
            self.counts.dropped += 1
            _close(writer, reset=how.reset)
            return False
        await asyncio.sleep(how.delay)
        if how.cut or how.garbage:
            self.counts.cut += 1
            writer.write(NOT_HTTP if how.garbage else _cut_answer(request))
            await writer.drain()
            return False
        if how.body is not None:
            await self._scripted(writer, request, how.body, status=how.status)
            if not request.get("stream") or how.after == "end":
                return True
            if how.after == "hold":
                await reader.read()  # until the client closes its end
            return False
        answer = self._head(_answer(request))
        writer.write(answer)
        await writer.drain()
        self.counts.answered += 1
        if how.unasked is not None:
            await asyncio.sleep(0.05)  # the client has the answer: the connection is idle
            writer.write(answer if how.unasked == "again" else _json_head(2, 408) + b"{}")
            await writer.drain()
        return True

    def _head(self, response: bytes) -> bytes:
        """The response with the behaviour's header lines and stream type in its head."""
        status, _, rest = response.partition(b"\r\n")
        rest = rest.replace(b"text/event-stream", self.behaviour.stream_type, 1)
        return status + b"\r\n" + self.behaviour.head + rest

    async def _scripted(
        self,
        writer: asyncio.StreamWriter,
        request: dict[str, Any],
        body: bytes,
        *,
        status: int,
    ) -> None:
        """The test's body, as one chunk of a chunked stream (its end sent only after "end") or
        as a sized JSON body."""
        if request.get("stream") and status == 200:
            end = b"0\r\n\r\n" if self.behaviour.after == "end" else b""
            chunk = _chunk(body) if body else b""  # an empty chunk would end the body
            writer.write(self._head(_stream_head()) + chunk + end)
        else:
            writer.write(self._head(_json_head(len(body), status)) + body)
        await writer.drain()


async def _read_request(reader: asyncio.StreamReader) -> dict[str, Any] | None:
    """The next request's JSON body, or None when the client closed the connection."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    length = 0
    for line in head.decode("latin-1").split("\r\n")[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    body: dict[str, Any] = orjson.loads(await reader.readexactly(length)) if length else {}
    return body  # a GET's: {}


def _close(writer: asyncio.StreamWriter, *, reset: bool) -> None:
    """Close without a byte of answer: a FIN, or with `reset` an RST (SO_LINGER 0), which is what
    a server that closes with the request still unread in its socket buffer sends."""
    if reset:
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()
    else:
        writer.close()


def _events(request: dict[str, Any]) -> list[dict[str, Any]]:
    prompt = _prompt(request)
    return [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "echo: "}}]},
        {"choices": [{"index": 0, "delta": {"content": prompt}, "finish_reason": "stop"}]},
        {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}},
    ]


def _answer(request: dict[str, Any]) -> bytes:
    """A whole answer, keeping the connection alive: no `Connection: close`, whatever comes next."""
    if request.get("stream"):
        pieces = [b"data: " + orjson.dumps(e) + b"\n\n" for e in _events(request)]
        pieces.append(b"data: [DONE]\n\n")
        return _stream_head() + b"".join(_chunk(p) for p in pieces) + b"0\r\n\r\n"
    body = orjson.dumps(
        {
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "echo: " + _prompt(request)},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 2},
        }
    )
    return _json_head(len(body)) + body


def _cut_answer(request: dict[str, Any]) -> bytes:
    """The head and the first piece of an answer; the connection closes after it."""
    if request.get("stream"):
        first = b"data: " + orjson.dumps(_events(request)[0]) + b"\n\n"
        return _stream_head() + _chunk(first)
    return _json_head(100) + b'{"choices": ['  # promises 100 bytes, sends 13


def _prompt(request: dict[str, Any]) -> str:
    content: str = request["messages"][-1]["content"] if request else ""
    return content


def _stream_head() -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )


def _json_head(length: int, status: int = 200) -> bytes:
    return b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % (
        status,
        length,
    )


@contextmanager
def serving(behaviour: Behaviour) -> Iterator[str]:
    """The server on a thread of its own, for tests that run the CLI in another process:
    `with serving(Behaviour(...)) as url:`."""
    loop = asyncio.new_event_loop()
    started: Future[str] = Future()
    stop = asyncio.Event()

    async def serve() -> None:
        async with HostileServer(behaviour) as server:
            started.set_result(server.url)
            await stop.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    try:
        yield started.result(timeout=10)
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=10)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)
