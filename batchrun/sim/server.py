"""The simulator as a real HTTP/1.1 server on anyio streams (`batchrun sim`).

A small hand-written server rather than a framework: it keeps connections alive, streams SSE with
chunked encoding, and plays the model's Reply with real sleeps, which is all the OpenAI-compatible
protocol needs here. Binds 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from http import HTTPStatus

import anyio
from anyio.abc import SocketAttribute, SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream

from batchrun.sim.model import Reply, SimModel

MAX_HEAD_BYTES = 64 * 1024
HANG_LIMIT_S = 600.0  # a simulated hang ends when the client leaves, or after this
_CLOSED = (
    anyio.EndOfStream,
    anyio.IncompleteRead,
    anyio.DelimiterNotFound,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    ConnectionError,
)


def _head(status: int, headers: dict[str, str]) -> bytes:
    reason = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else "Status"
    lines = [f"HTTP/1.1 {status} {reason}", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class SimServer:
    def __init__(self, model: SimModel) -> None:
        self.model = model

    async def serve(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        on_ready: Callable[[int], None] | None = None,
    ) -> None:
        listener = await anyio.create_tcp_listener(local_host=host, local_port=port)
        if on_ready is not None:
            on_ready(listener.extra(SocketAttribute.local_port))
        await listener.serve(self._connection)

    async def _connection(self, client: SocketStream) -> None:
        async with client:
            reader = BufferedByteReceiveStream(client)
            try:
                while await self._one_request(client, reader):
                    pass
            except _CLOSED:
                return

    async def _one_request(self, client: SocketStream, reader: BufferedByteReceiveStream) -> bool:
        head = await reader.receive_until(b"\r\n\r\n", MAX_HEAD_BYTES)
        request_line, *header_lines = head.decode("latin-1").split("\r\n")
        parts = request_line.split(" ")
        if len(parts) != 3:
            await client.send(_head(400, {"content-length": "0", "connection": "close"}))
            return False
        method, target, _version = parts
        headers = {}
        for line in header_lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length") or 0)
        body = await reader.receive_exactly(length) if length else b""
        keep_alive = headers.get("connection", "").lower() != "close"
        reply = self.model.handle(method, target, headers, body)
        if reply.fault == "reset":
            return False  # close without a word
        if reply.fault == "hang":
            with anyio.move_on_after(HANG_LIMIT_S):
                await client.receive()  # returns or raises when the client gives up
            return False
        await self._send(client, reply, keep_alive)
        return keep_alive and reply.fault != "cut"

    @staticmethod
    async def _send(client: SocketStream, reply: Reply, keep_alive: bool) -> None:
        conn = "keep-alive" if keep_alive else "close"
        cut = reply.fault == "cut"
        if reply.events is None:
            if reply.delay > 0:
                await anyio.sleep(reply.delay)
            # A cut body promises twice what it sends, then the connection closes.
            length = len(reply.body) * (2 if cut else 1)
            headers = {**reply.headers, "content-length": str(length), "connection": conn}
            await client.send(_head(reply.status, headers) + reply.body)
            return
        headers = {**reply.headers, "transfer-encoding": "chunked", "connection": conn}
        await client.send(_head(reply.status, headers))
        for delay, data in reply.events:
            if delay > 0:
                await anyio.sleep(delay)
            await client.send(b"%x\r\n%s\r\n" % (len(data), data))
        if not cut:
            await client.send(b"0\r\n\r\n")
