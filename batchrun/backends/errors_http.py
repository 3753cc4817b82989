"""Mapping of HTTP answers to batchrun's error types, at the boundary where they arrive."""

from __future__ import annotations

import email.utils
import math
import re
import time
from collections.abc import Mapping
from typing import Any, TypeVar

import orjson

from batchrun.backends.base import RateInfo
from batchrun.errors import (
    AuthFailed,
    BadRequest,
    FatalError,
    NotFound,
    Overloaded,
    RateLimited,
    RequestError,
)

E = TypeVar("E", bound=Exception)
SECRET_RUN = 8  # this many characters of the key in a row are a leak (see hide_secret)
MAX_MESSAGE = 500


def server_message(body: bytes) -> str:
    """The human part of an error body, whatever shape the server chose."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        data = None
    return message_of(data, body.decode("utf-8", "replace"))


def message_of(data: Any, fallback: str) -> str:
    """The human part of a parsed error (`{"error": {"message": ...}}`, `{"detail": ...}`,
    ...), else `fallback`; on one line (a server's line breaks could otherwise forge lines of
    our own output) and at most MAX_MESSAGE characters."""
    found: Any = None
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            found = next(
                (err[k] for k in ("message", "detail", "msg") if isinstance(err.get(k), str)), None
            )
        elif isinstance(err, str):
            found = err
        if found is None and isinstance(data.get("detail"), str):
            found = data["detail"]
    text = found if isinstance(found, str) else fallback
    return " ".join(text[: 4 * MAX_MESSAGE].split())[:MAX_MESSAGE]


# The longest a server's Retry-After is waited: a longer one (a day, `inf`) from one
# answer would hold every request of the job, silently.
MAX_RETRY_AFTER = 300.0
# A rate limit's reset longer than this is no window of its own (a daily budget's is a day).
MAX_RESET_S = 86_400.0
EPOCH_S = 1e9  # a "seconds" value past this (2001) is a Unix time, as X-RateLimit-Reset gives


def retry_after(headers: Mapping[str, str], now: float | None = None) -> float | None:
    """Seconds to wait, from `retry-after-ms` or `retry-after` (seconds or an HTTP date), at
    most MAX_RETRY_AFTER; None where it is missing or unreadable (`inf`, `NaN`)."""
    ms = headers.get("retry-after-ms")
    if ms:
        try:
            waited = _within(float(ms) / 1000, MAX_RETRY_AFTER)
        except ValueError:
            waited = None
        if waited is not None:  # else `retry-after` may still say
            return waited
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return _within(float(value), MAX_RETRY_AFTER)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return _within(when.timestamp() - (now if now is not None else time.time()), MAX_RETRY_AFTER)


def _within(seconds: float, most: float) -> float | None:
    return min(max(0.0, seconds), most) if math.isfinite(seconds) else None


_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str, now: float | None = None) -> float | None:
    """OpenAI/Groq style reset durations: "1s", "0.5s", "120ms", "6m0s", "1h2m3.5s"; a bare
    number of seconds, or a Unix time (many APIs' X-RateLimit-Reset), read as the seconds to
    it. At most a day; None where it is unreadable."""
    text = text.strip()
    try:
        seconds = float(text)
    except ValueError:
        parts = _DURATION.findall(text)
        if not parts or "".join(n + u for n, u in parts) != text:
            return None
        seconds = sum(float(n) * _UNIT_S[u] for n, u in parts)
    if seconds > EPOCH_S and math.isfinite(seconds):
        seconds -= now if now is not None else time.time()
    return _within(seconds, MAX_RESET_S)


def rate_info(headers: Mapping[str, str]) -> RateInfo | None:
    """The `x-ratelimit-*` headers, if the server sent any."""
    if not any(k.startswith("x-ratelimit-") for k in headers):
        return None

    def number(name: str) -> int | None:
        value = headers.get(name)
        try:
            return int(float(value)) if value is not None else None
        except (ValueError, OverflowError):  # not a number, or `inf`
            return None

    def duration(name: str) -> float | None:
        value = headers.get(name)
        return parse_duration(value) if value is not None else None

    return RateInfo(
        remaining_requests=number("x-ratelimit-remaining-requests"),
        reset_requests_s=duration("x-ratelimit-reset-requests"),
        remaining_tokens=number("x-ratelimit-remaining-tokens"),
        reset_tokens_s=duration("x-ratelimit-reset-tokens"),
        limit_requests=number("x-ratelimit-limit-requests"),
        limit_tokens=number("x-ratelimit-limit-tokens"),
    )


def _until_reset(rate: RateInfo) -> float | None:
    """Seconds until the spent budgets (requests, tokens) refill, at most MAX_RETRY_AFTER."""
    budgets = (
        (rate.remaining_requests, rate.reset_requests_s),
        (rate.remaining_tokens, rate.reset_tokens_s),
    )
    resets = [reset for left, reset in budgets if left is not None and left <= 0 and reset]
    return min(max(resets), MAX_RETRY_AFTER) if resets else None


def error_for_status(
    status: int, headers: Mapping[str, str], body: bytes, url: str
) -> RequestError:
    if status < 400:  # a redirect: a POST sent on would not go as sent, so none is followed
        to = (headers.get("location") or "where it does not say")[:200]
        return FatalError(f"HTTP {status}: {url} redirects to {to}; point the base URL there")
    message = f"HTTP {status}: {server_message(body) or 'no message'}"
    if status in (401, 403):
        return AuthFailed(f"{message} (check the API key variable)", status=status)
    if status == 402:  # out of credit: every other line would be refused the same way
        return FatalError(
            f"{message} (the account is out of credit; top it up, then resume)", status=status
        )
    if status == 404:
        return NotFound(f"{message} (unknown model or path: {url})", status=status)
    if status == 429:
        rate = rate_info(headers)
        left = (rate.remaining_requests, rate.remaining_tokens) if rate is not None else ()
        spent = any(n is not None and n <= 0 for n in left)  # overdrawn (< 0) is spent too
        wait = retry_after(headers)
        if spent and wait is None and rate is not None:  # no Retry-After: until its reset
            wait = _until_reset(rate)
        return RateLimited(message, status=status, retry_after=wait, budget_spent=spent)
    if status in (408, 409) or status >= 500:
        return Overloaded(message, status=status, retry_after=retry_after(headers))
    return BadRequest(message, status=status)


def scrubbed(error: E, *secrets: str | None) -> E:
    """`error` with every secret given (a key, a URL's user:password) hidden in its text."""
    for secret in secrets:
        if secret:
            error.args = (hide_secret(str(error), secret),)
    return error


def hide_secret(text: str, secret: str) -> str:
    """`text` with every run of SECRET_RUN or more characters of `secret` in it replaced by
    `***`: the whole key, and any part a server echoed (its first 20 characters, a message cut
    at its length limit in the middle of it)."""
    if len(secret) < SECRET_RUN:
        return text.replace(secret, "***") if secret else text
    parts = {secret[i : i + SECRET_RUN] for i in range(len(secret) - SECRET_RUN + 1)}
    hidden = bytearray(len(text))  # 1 where a character is part of the secret
    for i in range(len(text) - SECRET_RUN + 1):
        if text[i : i + SECRET_RUN] in parts:
            hidden[i : i + SECRET_RUN] = b"\x01" * SECRET_RUN
    if not any(hidden):
        return text
    out: list[str] = []
    for i, char in enumerate(text):
        if not hidden[i]:
            out.append(char)
        elif i == 0 or not hidden[i - 1]:
            out.append("***")
    return "".join(out)
