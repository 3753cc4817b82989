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
    def __init__(self, events: list[tuple[float, bytes]], sleep: Sleep) -> None:
        self._events = events
        self._sleep = sleep

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for delay, data in self._events:
            if delay > 0:
                await self._sleep(delay)
            yield data


class SimTransport(httpx.AsyncBaseTransport):
    def __init__(self, model: SimModel | None = None, sleep: Sleep = anyio.sleep) -> None:
        self.model = model or SimModel()
        self._sleep = sleep

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        headers = {k.lower(): v for k, v in request.headers.items()}
        reply: Reply = self.model.handle(request.method, request.url.path, headers, body)
        if reply.events is None:
            if reply.delay > 0:
                await self._sleep(reply.delay)
            return httpx.Response(reply.status, headers=reply.headers, content=reply.body)
        return httpx.Response(
            reply.status, headers=reply.headers, stream=_EventStream(reply.events, self._sleep)
        )
