"""Retry policy over tenacity, and the outage watch that keeps a dead endpoint from burning items.

Transient errors are retried with exponential backoff and full jitter, or exactly as long as the
server's Retry-After says. While the endpoint looks down for everyone (connection failures,
timeouts or 5xx on at least two different items, with no success since), items keep their
attempts instead of being failed one by one; past the grace period the whole job stops with
EndpointDown. An item that keeps failing while other requests succeed (a poison prompt behind a
504 proxy) is not an outage: it runs out of attempts and is marked failed like any other.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Hashable
from typing import Protocol, TypeVar

import anyio
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type
from tenacity.wait import wait_random_exponential

from batchrun.backends.errors_http import MAX_RETRY_AFTER
from batchrun.errors import (
    ConnectionFailed,
    EmptyStream,
    EndpointDown,
    Overloaded,
    RequestError,
    RequestTimeout,
    StreamCut,
    TransientError,
)

T = TypeVar("T")
Sleep = Callable[[float], Awaitable[None]]
Clock = Callable[[], float]


class OutageWatch:
    """Tells an outage (nobody gets answers) from poison items (a few prompts always fail).

    An outage: failures of the outage kinds on at least two items, none of them a suspect, with
    no success since. A suspect is an item that had failed when another request, sent after
    that failure, succeeded: the endpoint worked, so that item's failures are its own, and they
    always count against its attempts. Any answer ends an outage, but one to a request sent
    before an item's failure proves nothing of that item (an outage may have begun while the
    answer was on its way). `grace` of 0 turns outage handling off: every failure counts.
    """

    MIN_ITEMS = 2

    def __init__(self, grace: float, clock: Clock = time.monotonic) -> None:
        self.grace = grace
        self.clock = clock
        self.down_since: float | None = None
        self.last_error = ""
        self._failing: set[Hashable] = set()  # items failing since the last answer
        self._failed: dict[Hashable, float] = {}  # item -> its first failure, until judged
        self._suspects: set[Hashable] = set()

    def success(self, key: Hashable = None, sent: float | None = None) -> None:
        """Item `key` was answered, to a request sent at `sent` (the clock's time; now if not
        said): the endpoint is not down for everyone. Items that had failed before that request
        went out are suspects (it took new work after their failure); one that failed only
        since may have met an outage that began while this answer was on its way."""
        since = self.clock() if sent is None else sent
        proven = [item for item, at in self._failed.items() if at <= since]
        self._suspects.update(proven)
        for item in proven:
            del self._failed[item]
        self._suspects.discard(key)
        self._failed.pop(key, None)
        self._failing.clear()
        self.down_since = None

    def failure(self, exc: TransientError, key: Hashable = None) -> bool:
        """Note a failed request for item `key`. True: it failed in an outage, so it should
        not count against the item's attempts."""
        if not looks_like_outage(exc):
            return False
        self.last_error = str(exc)
        if key in self._suspects:
            return False
        now = self.clock()
        self._failed.setdefault(key, now)
        self._failing.add(key)
        if self.down_since is None:
            self.down_since = now
        return self.down

    def reached(self) -> None:
        """The endpoint answered, with an error of the request's own (a 400, a 429): it was
        reachable, so an outage that follows starts at its own first failure. (Else a server
        that answered nothing but errors since one failed request, then died, was past the
        grace at once.) An outage already seen stands: a broken server that answers some
        requests with errors and the rest not at all still stops the job after the grace."""
        if not self.unreachable:
            self.down_since = None

    def suspect(self, key: Hashable) -> bool:
        """Whether `key` kept failing while other requests were answered (its own fault)."""
        return key in self._suspects

    def resend_now(self, key: Hashable) -> bool:
        """One endpoint: nowhere else to send it."""
        return False

    @property
    def unreachable(self) -> bool:
        """What an outage looks like, whether or not outages are handled: several endpoints
        drain a lane on it even with `grace` 0 (fleet.py)."""
        return self.down_since is not None and len(self._failing) >= self.MIN_ITEMS

    @property
    def down(self) -> bool:
        """An outage, handled: its failures cost no attempts, and it may stop the job."""
        return self.grace > 0 and self.unreachable

    def check(self) -> None:
        """Raise EndpointDown once the outage has lasted longer than the grace period."""
        if self.down and self.clock() - self.down_since > self.grace:  # type: ignore[operator]
            raise EndpointDown(
                f"endpoint unreachable for over {self.grace:g}s; last error: {self.last_error}"
            )


def looks_like_outage(exc: TransientError) -> bool:
    """Failures that a down or broken server gives every request alike."""
    if isinstance(exc, (ConnectionFailed, RequestTimeout)):
        return True
    # Every 5xx: behind a proxy a dead origin answers 520-524, an overloaded one 529.
    return isinstance(exc, Overloaded) and (exc.status or 0) >= 500


def endpoint_failure(exc: RequestError) -> bool:
    """Failures that an endpoint going down gives the requests it has in flight: refused or
    reset connections, timeouts, 5xx, and broken answers."""
    return isinstance(exc, TransientError) and (broken(exc) or looks_like_outage(exc))


def broken(exc: RequestError) -> bool:
    """An answer cut off mid-stream, or not JSON: the endpoint's fault, not the line's (an
    empty stream is llama-cpp-python's answer to a prompt too long)."""
    return isinstance(exc, StreamCut) and not isinstance(exc, EmptyStream)


class Outages(Protocol):
    """What the policy asks of its outage rules: an OutageWatch for one endpoint, a Fleet
    (fleet.py) for several."""

    grace: float
    clock: Clock

    @property
    def down(self) -> bool: ...

    def check(self) -> None: ...

    def success(self, key: Hashable = None, sent: float | None = None) -> None: ...

    def failure(self, exc: TransientError, key: Hashable = None) -> bool: ...

    def resend_now(self, key: Hashable) -> bool: ...


def until_set(event: anyio.Event, sleep: Sleep) -> Sleep:
    """`sleep`, ending early once `event` is set (a run's stop: a retry waits for no backoff)."""

    async def sleep_until_set(seconds: float) -> None:
        async with anyio.create_task_group() as waits:

            async def stop() -> None:
                await event.wait()
                waits.cancel_scope.cancel()

            waits.start_soon(stop)
            await sleep(seconds)
            waits.cancel_scope.cancel()

    return sleep_until_set


class Tally:
    """Attempts charged against --max-attempts for one request (failures in an outage are not).
    It starts where an earlier run of the item stopped, and is read when this one stops."""

    __slots__ = ("charged",)

    def __init__(self, charged: int = 0) -> None:
        self.charged = charged


class RetryPolicy:
    def __init__(
        self,
        max_attempts: int,
        outage: Outages,
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

    def _wait(self, state: RetryCallState, key: Hashable = None) -> float:
        if self.outage.resend_now(key):  # another endpoint takes it now
            return 0.0
        exc = state.outcome.exception() if state.outcome else None
        hinted = getattr(exc, "retry_after", None)
        if hinted is not None:
            wait = float(min(hinted, MAX_RETRY_AFTER))
        else:
            wait = float(self._backoff(state))
        # in an outage, a maintenance page's long Retry-After too: the outage's own look
        # comes at its pace, so --outage-timeout stops the job when it says
        return min(wait, self._outage_wait) if self.outage.down else wait

    async def call(
        self, fn: Callable[[], Awaitable[T]], key: Hashable = None, tally: Tally | None = None
    ) -> T:
        """Run fn until it succeeds, fails permanently, or runs out of attempts.

        `key` names the item. Failures during an outage do not count against its attempts;
        the outage watch decides when the whole job gives up instead. `tally` counts them, from
        what an earlier run charged (the first attempt is sent whatever it holds: a run given a
        lower --max-attempts than the last sends one).

        The first attempt runs on its own: most succeed, and a tenacity loop costs more per
        call than the rest of the bookkeeping. Its failure hands over to the loop, which waits
        first, as it would have after the same failure."""
        self.outage.check()
        sent = self.outage.clock()
        try:
            result = await fn()
        except TransientError as exc:
            tally = tally or Tally()
            if not self.outage.failure(exc, key):
                tally.charged += 1
            if tally.charged >= self.max_attempts:
                raise
            await self.sleep(self._first_wait(exc, key))
            return await self._retrying(fn, key, tally)
        self.outage.success(key, sent)
        return result

    def _first_wait(self, exc: TransientError, key: Hashable) -> float:
        state = RetryCallState(AsyncRetrying(), None, (), {})
        state.set_exception((type(exc), exc, exc.__traceback__))
        return self._wait(state, key)

    async def _retrying(self, fn: Callable[[], Awaitable[T]], key: Hashable, tally: Tally) -> T:
        """The attempts after the first (tenacity numbers them from 2 on, for the backoff)."""

        def out_of_attempts(_state: RetryCallState) -> bool:
            return tally.charged >= self.max_attempts

        retrying = AsyncRetrying(
            retry=retry_if_exception_type(TransientError),
            stop=out_of_attempts,
            wait=lambda state: self._wait(state, key),
            sleep=self.sleep,
            reraise=True,
        )
        first = True
        async for attempt in retrying:
            if first:  # the first attempt ran before the loop
                attempt.retry_state.attempt_number += 1
                first = False
            with attempt:
                self.outage.check()
                sent = self.outage.clock()
                try:
                    result = await fn()
                except TransientError as exc:
                    if not self.outage.failure(exc, key):
                        tally.charged += 1
                    raise
                self.outage.success(key, sent)
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
            # a long Retry-After (a maintenance page) waits no longer than the grace left (and
            # a millisecond: a wait of what is left may end a hair short of it, for ever)
            wait=lambda state: min(self._wait(state), max(0.0, started + seconds - clock()) + 1e-3),
            sleep=self.sleep,
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                return await fn()
        raise AssertionError("unreachable: tenacity either returns or reraises")
