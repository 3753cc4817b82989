"""Mapping of HTTP answers to batchrun's error types, at the boundary where they arrive."""

from __future__ import annotations

import email.utils
import time
from collections.abc import Mapping

import orjson

from batchrun.errors import (
    AuthFailed,
    BadRequest,
    NotFound,
    Overloaded,
    RateLimited,
    RequestError,
)

MAX_MESSAGE = 500


def server_message(body: bytes) -> str:
    """The human part of an error body, whatever shape the server chose."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body.decode("utf-8", "replace").strip()[:MAX_MESSAGE]
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            for key in ("message", "detail", "msg"):
                if isinstance(err.get(key), str):
                    return str(err[key])[:MAX_MESSAGE]
        elif isinstance(err, str):
            return err[:MAX_MESSAGE]
        if isinstance(data.get("detail"), str):
            return str(data["detail"])[:MAX_MESSAGE]
    return body.decode("utf-8", "replace").strip()[:MAX_MESSAGE]


def retry_after(headers: Mapping[str, str], now: float | None = None) -> float | None:
    """Seconds to wait, from `retry-after-ms` or `retry-after` (seconds or an HTTP date)."""
    ms = headers.get("retry-after-ms")
    if ms:
        try:
            return max(0.0, float(ms) / 1000)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (now if now is not None else time.time()))


def error_for_status(
    status: int, headers: Mapping[str, str], body: bytes, url: str
) -> RequestError:
    message = f"HTTP {status}: {server_message(body) or 'no message'}"
    if status in (401, 403):
        return AuthFailed(f"{message} (check the API key variable)", status=status)
    if status == 404:
        return NotFound(f"{message} (unknown model or path: {url})", status=status)
    if status == 429:
        return RateLimited(message, status=status, retry_after=retry_after(headers))
    if status in (408, 409) or status >= 500:
        return Overloaded(message, status=status, retry_after=retry_after(headers))
    return BadRequest(message, status=status)
