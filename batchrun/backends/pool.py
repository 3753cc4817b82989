"""A connection pool split into small shards, so hundreds of streams cost what a few dozen do.

httpcore's pool walks every one of its connections each time a request is queued or released
(`_assign_requests_to_connections`, `is_idle` per connection), so its cost per request grows
with the pool: at 256 streams most of the client's CPU went to that bookkeeping and the client,
not the server, capped throughput (benchmarks/connection_pool.py measures it). Here each
request goes to the least busy of several small pools; with at most `shard_size` connections
each, every walk stays short. A shard never has to queue a request for a connection while the
caller keeps no more requests in flight than the pools' total: the least busy one is below
its share.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable

import httpx

SHARD_SIZE = 32


class ShardedTransport(httpx.AsyncBaseTransport):
    def __init__(self, max_connections: int, *, shard_size: int = SHARD_SIZE) -> None:
        count = max(1, math.ceil(max_connections / shard_size))
        per_shard = math.ceil(max_connections / count)
        limits = httpx.Limits(max_connections=per_shard, max_keepalive_connections=per_shard)
        self._shards = [httpx.AsyncHTTPTransport(limits=limits) for _ in range(count)]
        self._busy = [0] * count  # requests whose response is not yet closed, per shard

    @property
    def shards(self) -> int:
        return len(self._shards)

    @property
    def busy(self) -> tuple[int, ...]:
        """Open responses per shard."""
        return tuple(self._busy)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        index = min(range(len(self._busy)), key=self._busy.__getitem__)
        self._busy[index] += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._busy[index] -= 1

        try:
            response = await self._shards[index].handle_async_request(request)
        except BaseException:
            release()
            raise
        assert isinstance(response.stream, httpx.AsyncByteStream)
        return httpx.Response(
            status_code=response.status_code,
            headers=response.headers,
            stream=_ReleasingStream(response.stream, release),
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        for shard in self._shards:
            await shard.aclose()


class _ReleasingStream(httpx.AsyncByteStream):
    """The shard's response body; closing it (read to the end or not) frees the shard's slot."""

    def __init__(self, inner: httpx.AsyncByteStream, release: Callable[[], None]) -> None:
        self._inner = inner
        self._release = release

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._inner:
            yield chunk

    async def aclose(self) -> None:
        try:
            await self._inner.aclose()
        finally:
            self._release()
