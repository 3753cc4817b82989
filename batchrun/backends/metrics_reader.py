"""Reads a server's Prometheus /metrics page (or llama-server's /slots): its own count of running
and waiting requests.

Best effort by design: the concurrency controller polls it about once a second and falls back to
its own signals on None, so whatever the server does wrong (no /metrics, an error status, a hang,
a huge or garbled page) is None here, never an exception. It lives in backends/ because only
backends/ talk HTTP; the parsing is batchrun.server_metrics.
"""

from __future__ import annotations

from collections.abc import Mapping

import anyio
import httpx

from batchrun.server_metrics import ServerLoad, parse_load

DEFAULT_TIMEOUT_S = 1.0  # a poll that takes longer is stale by the time it lands
MAX_BODY_BYTES = 4 * 1024 * 1024  # a page is tens of KiB, a few hundred with many engines


class MetricsReader:
    """GETs one metrics URL with its own client (closed by `aclose`, with any injected transport).

    `fallback`: a second page read when `url` gives nothing (llama-server's /slots when it was
    started without --metrics); whichever page first gives a load is the only one read after.

    `headers` may carry the endpoint's Authorization header (llama-server wants the key on
    /metrics); it is sent, never logged: `last_error` says why a read gave None in words that hold
    no header, body or exception text."""

    def __init__(
        self,
        url: str,
        *,
        headers: Mapping[str, str] | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        transport: httpx.AsyncBaseTransport | None = None,
        max_bytes: int = MAX_BODY_BYTES,
        fallback: str | None = None,
    ) -> None:
        self.url = url
        self._urls = [url] if fallback is None else [url, fallback]
        self.timeout = timeout
        self.max_bytes = max_bytes
        self.last_error: str | None = None
        self._client = httpx.AsyncClient(
            transport=transport, headers=dict(headers or {}), timeout=timeout
        )

    async def read(self) -> ServerLoad | None:
        """The server's load now, or None when it does not say (`last_error` says why)."""
        errors: list[str] = []
        for url in self._urls:
            load = await self._read(url)
            if load is not None:
                self._urls = [url]
                self.last_error = None
                return load
            errors.append(self.last_error or "")
        self.last_error = "; ".join(errors)
        return None

    async def _read(self, url: str) -> ServerLoad | None:
        self.last_error = None
        body: bytes | None = None
        with anyio.move_on_after(self.timeout):  # all of it, not each read as httpx times it
            body = await self._fetch(url)
        if body is None:
            self.last_error = self.last_error or f"no whole page within {self.timeout:g}s"
            return None
        load = parse_load(body.decode("utf-8", "replace"))
        if load is None:
            self.last_error = "no running and waiting counts of a known engine on the page"
        return load

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _fetch(self, url: str) -> bytes | None:
        try:
            async with self._client.stream("GET", url) as response:
                if response.status_code != 200:
                    self.last_error = f"HTTP {response.status_code}"
                    return None
                return await self._capped(response)
        except (httpx.HTTPError, httpx.InvalidURL) as exc:  # InvalidURL: not an HTTPError
            self.last_error = type(exc).__name__
            return None

    async def _capped(self, response: httpx.Response) -> bytes | None:
        """The body, or None past `max_bytes`: counted as it arrives (decompressed), so neither a
        runaway page nor a gzip bomb is held in memory."""
        chunks: list[bytes] = []
        size = 0
        async for chunk in response.aiter_bytes():
            size += len(chunk)
            if size > self.max_bytes:
                self.last_error = f"page larger than {self.max_bytes} bytes"
                return None
            chunks.append(chunk)
        return b"".join(chunks)
