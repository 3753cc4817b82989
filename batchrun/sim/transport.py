"""The simulator as an httpx transport: the real client code path with no sockets.

Used by `--backend sim` and by unit tests. Delays are played with an injectable sleep, so a
zero-latency model never sleeps at all.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
import httpx

from batchrun.sim.model import Reply, SimModel

Sleep = Callable[[float], Awaitable[None]]


class _EventStream(httpx.AsyncByteStream):
    """Plays a reply's parts; `cut` drops the 'connection' after them, as a server would."""

    def __init__(self, events: list[tuple[float, bytes]], sleep: Sleep, cut: bool) -> None:
        self._events = events
        self._sleep = sleep
        self._cut = cut

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for delay, data in self._events:
            if delay > 0:
                await self._sleep(delay)
            yield data
        if self._cut:
            raise httpx.RemoteProtocolError("peer closed connection mid-body (simulated cut)")


class SimTransport(httpx.AsyncBaseTransport):
    def __init__(self, model: SimModel | None = None, sleep: Sleep = anyio.sleep) -> None:
        self.model = model or SimModel()
        self._sleep = sleep

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        headers = {k.lower(): v for k, v in request.headers.items()}
        target = request.url.raw_path.decode("ascii")  # with its query (?limit=, ?after=)
        reply: Reply = self.model.handle(request.method, target, headers, body)
        if reply.fault == "reset":
            raise httpx.RemoteProtocolError("server disconnected without a response (simulated)")
        if reply.fault == "hang":
            await anyio.sleep_forever()  # the client's timeout ends this
        cut = reply.fault == "cut"
        if reply.events is None:
            if reply.delay > 0:
                await self._sleep(reply.delay)
            if not cut:
                return httpx.Response(reply.status, headers=reply.headers, content=reply.body)
            events = [(0.0, reply.body)]
        else:
            events = reply.events
        stream = _EventStream(events, self._sleep, cut)
        return httpx.Response(reply.status, headers=reply.headers, stream=stream)
