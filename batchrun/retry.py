"""Retry policy over tenacity, and the outage watch that keeps a dead endpoint from burning items.

Transient errors are retried with exponential backoff and full jitter, or exactly as long as the
server's Retry-After says. While the endpoint looks down for everyone (connection failures or
502/503/504 on at least two different items, with no success since), items keep their attempts
instead of being failed one by one; past the grace period the whole job stops with EndpointDown.
One item that always fails the same way (a poison prompt behind a 504 proxy) is not an outage:
it runs out of attempts and is marked failed like any other.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Hashable
from typing import TypeVar

import anyio
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type
from tenacity.wait import wait_random_exponential

from batchrun.errors import ConnectionFailed, EndpointDown, Overloaded, TransientError

T = TypeVar("T")
Sleep = Callable[[float], Awaitable[None]]
Clock = Callable[[], float]

MAX_RETRY_AFTER = 300.0
OUTAGE_STATUSES = (502, 503, 504)


class OutageWatch:
    """Tracks whether the endpoint has answered anyone since the first sign of an outage."""

    MIN_ITEMS = 2  # distinct failing items before it counts as an outage, not a poison item

    def __init__(self, grace: float, clock: Clock = time.monotonic) -> None:
        self.grace = grace
        self.clock = clock
        self.down_since: float | None = None
        self.last_error = ""
        self._failing: set[Hashable] = set()

    def success(self) -> None:
        self.down_since = None
        self._failing.clear()

    def failure(self, exc: TransientError, key: Hashable = None) -> None:
        """Note a failed request; `key` names the item it was for."""
        looks_down = isinstance(exc, ConnectionFailed) or (
            isinstance(exc, Overloaded) and exc.status in OUTAGE_STATUSES
        )
        if looks_down:
            self.last_error = str(exc)
            self._failing.add(key)
            if self.down_since is None:
                self.down_since = self.clock()

    @property
    def down(self) -> bool:
        return self.down_since is not None and len(self._failing) >= self.MIN_ITEMS

    def check(self) -> None:
        """Raise EndpointDown once the outage has lasted longer than the grace period."""
        if self.down and self.clock() - self.down_since > self.grace:  # type: ignore[operator]
            raise EndpointDown(
                f"endpoint unreachable for over {self.grace:g}s; last error: {self.last_error}"
            )


class RetryPolicy:
    def __init__(
        self,
        max_attempts: int,
        outage: OutageWatch,
        *,
        sleep: Sleep = anyio.sleep,
        base_wait: float = 0.5,
        max_wait: float = 30.0,
    ) -> None:
        self.max_attempts = max_attempts
        self.outage = outage
        self.sleep = sleep
        self._backoff = wait_random_exponential(multiplier=base_wait, max=max_wait)
        self._outage_wait = min(max_wait, max(0.05, outage.grace / 4))

    def _wait(self, state: RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome else None
        hinted = getattr(exc, "retry_after", None)
        if hinted is not None:
            return float(min(hinted, MAX_RETRY_AFTER))
        wait = float(self._backoff(state))
        return min(wait, self._outage_wait) if self.outage.down else wait

    def _stop(self, state: RetryCallState) -> bool:
        # During an outage nobody's attempts count: the watch decides when to give up.
        return state.attempt_number >= self.max_attempts and not self.outage.down

    async def call(self, fn: Callable[[], Awaitable[T]], key: Hashable = None) -> T:
        """Run fn until it succeeds, fails permanently, or runs out of attempts.

        `key` names the item, so the outage watch can tell one failing item from many."""
        retrying = AsyncRetrying(
            retry=retry_if_exception_type(TransientError),
            stop=self._stop,
            wait=self._wait,
            sleep=self.sleep,
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                self.outage.check()
                try:
                    result = await fn()
                except TransientError as exc:
                    self.outage.failure(exc, key)
                    raise
                self.outage.success()
                return result
        raise AssertionError("unreachable: tenacity either returns or reraises")

    async def call_within(self, fn: Callable[[], Awaitable[T]], seconds: float) -> T:
        """Retry transient errors for up to `seconds` (e.g. waiting for a server that is still
        starting), then re-raise the last one."""
        clock = self.outage.clock
        started = clock()
        retrying = AsyncRetrying(
            retry=retry_if_exception_type(TransientError),
            stop=lambda _state: clock() - started >= seconds,
            wait=self._wait,
            sleep=self.sleep,
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                return await fn()
        raise AssertionError("unreachable: tenacity either returns or reraises")
