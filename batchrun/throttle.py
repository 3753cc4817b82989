"""The one owner of how many requests are in flight, and of when the next one may go.

The runner and the sender share one Throttle. A request takes a slot for exactly as long as it
is on the wire (never while it sleeps before a retry), and reports what happened through it:

    async with throttle.slot(estimated_tokens) as slot:
        completion = await backend.complete(request, watch=slot)
        slot.done(completion, output_tokens)        # or slot.failed(error)

Inside, the pure pieces decide (controller.py: the adaptive limit; limiter.py: rate pacing) and
the throttle applies their answers: the capacity of its slots, the shared pause, and a log line
through `on_change` for every reported move of the limit.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio

from batchrun.backends.base import Completion
from batchrun.budget import Budget, ShareSpent
from batchrun.config import Pacing
from batchrun.controller import Change, ConcurrencyController
from batchrun.errors import (
    ConnectionFailed,
    Overloaded,
    RateLimited,
    RequestError,
    RequestTimeout,
    StreamCut,
    TransientError,
)
from batchrun.evidence import Observation
from batchrun.limiter import Pacer
from batchrun.retrying import Clock, Sleep
from batchrun.server_metrics import ServerLoad

METRICS_EVERY_S = 0.5


class Throttle:
    def __init__(
        self,
        pacer: Pacer,
        *,
        controller: ConcurrencyController | None = None,
        fixed: int = 16,
        clock: Clock,
        sleep: Sleep = anyio.sleep,
        on_change: Callable[[Change], None] | None = None,
    ) -> None:
        self.pacer = pacer
        self.controller = controller
        self.in_flight = 0  # requests on the wire now
        self.streaming = 0  # ... whose answers have begun to come in
        self.budget: Budget | None = None  # the job's token or cost limit, when it has one
        # Looks at what the job spent, and the workers alive, for the budget (given the looks
        # it had when a request was refused: one look serves the requests refused before it).
        self.look: Callable[[int], Awaitable[None]] | None = None
        self.clock = clock
        self._sleep = sleep
        self._on_change = on_change
        self._slots = anyio.CapacityLimiter(controller.admitted if controller else fixed)
        pacer.in_flight = self.limit
        # Told when a slot comes free or the limit rises: a Fleet (several endpoints) wakes
        # a request waiting for any endpoint's slot.
        self.on_room: Callable[[], None] | None = None

    @classmethod
    def for_pacing(
        cls,
        pacing: Pacing,
        *,
        clock: Clock,
        sleep: Sleep = anyio.sleep,
        on_change: Callable[[Change], None] | None = None,
    ) -> Throttle:
        """A job's throttle: adaptive from 2 up to `max_concurrency`, or fixed; rpm/tpm paced."""
        controller = (
            ConcurrencyController(initial=2, maximum=pacing.max_concurrency)
            if pacing.adaptive
            else None
        )
        pacer = Pacer(rpm=pacing.rpm, tpm=pacing.tpm)
        fixed = pacing.most_in_flight
        return cls(
            pacer, controller=controller, fixed=fixed, clock=clock, sleep=sleep, on_change=on_change
        )

    @property
    def limit(self) -> int:
        """The concurrency limit (the slots open now may be fewer: controller.admitted)."""
        return self.controller.limit if self.controller else int(self._slots.total_tokens)

    def slot(
        self,
        estimated_tokens: int,
        *,
        prompt_tokens: int = 0,
        taken: bool = False,
        after: anyio.Event | None = None,
    ) -> Slot:
        """`async with throttle.slot(n) as slot`: wait for a free slot and the pacer's go
        (and the budget's, with one: BudgetReached when this request would pass it), then
        hold the slot while the request runs. `prompt_tokens`: the estimate's prompt part;
        `taken`: the slot was taken already (`take`); `after`: the slot, once had, waits for
        it first (a prefix group's first line: its prefix cached here)."""
        slot = Slot(self, estimated_tokens, prompt_tokens, taken)
        slot.after = after
        return slot

    @property
    def busy(self) -> int:
        """Slots taken: requests on the wire, and those waiting for the pacer's go."""
        return int(self._slots.borrowed_tokens)

    async def admit(self, est_in: int, est_out: int) -> None:
        """The budget's go for a request (BudgetReached: none), after a look at the job's
        spending where this worker's part of it is half spent (budget.py)."""
        assert self.budget is not None
        looks = self.budget.looks
        try:
            self.budget.admit(est_in, est_out, looked=self.look is None)
        except ShareSpent:
            assert self.look is not None
            await self.look(looks)
            self.budget.admit(est_in, est_out, looked=True)

    @property
    def free(self) -> bool:
        """Whether a slot is free now (`take` would have it)."""
        return self._slots.available_tokens >= 1

    def take(self) -> bool:
        """Take a free slot now, for a `slot(..., taken=True)` by the same task; False when
        none is free."""
        try:
            self._slots.acquire_nowait()
        except anyio.WouldBlock:
            return False
        return True

    async def watch_server(self, read: Callable[[], Awaitable[ServerLoad | None]]) -> bool:
        """Feed the server's own running/waiting counts to the controller until cancelled.

        Returns False at once if the first reads give nothing (no metrics there); once they
        have given something, three reads in a row without hand the controller back to its own
        signals until the counts come again."""
        if self.controller is None:
            return False
        found, misses = False, 0
        while True:
            load = await read()
            if load is None:
                misses += 1
                if misses >= 3:
                    if not found:
                        return False
                    self.controller.server_quiet()
            else:
                found, misses = True, 0
                change = self.controller.server_load(
                    self.clock(), load, in_flight=self.in_flight, streaming=self.streaming
                )
                self._apply(change)
            await self._sleep(METRICS_EVERY_S)

    def _apply(self, change: Change | None) -> None:
        """Bring the slots in line with the controller (it may move without reporting)."""
        assert self.controller is not None
        grown = self.controller.admitted - int(self._slots.total_tokens)
        if grown:
            self._slots.total_tokens = self.controller.admitted
        if grown > 0 and self.on_room is not None:
            for _ in range(grown):
                self.on_room()
        self.pacer.in_flight = self.controller.limit
        if self.controller.pause_until > self.pacer.pause_until:
            self.pacer.pause(self.controller.pause_until)
        if change is not None and self._on_change is not None:
            self._on_change(change)


class Slot:
    """One request on the wire: what it saw, reported once (a backends.base.Watch)."""

    def __init__(
        self, throttle: Throttle, estimated_tokens: int, prompt_tokens: int, taken: bool
    ) -> None:
        self._throttle = throttle
        self._taken = taken
        self._estimate = estimated_tokens
        self._split = (prompt_tokens, max(0, estimated_tokens - prompt_tokens))
        self._held = False  # its estimate held by the budget
        self._used: tuple[int, int] | None = None  # what the answer says it cost
        self.sent_in_flight = 0  # set when it takes its slot
        self.sent_at_limit = 0
        self.warm: anyio.Event | None = None  # set at the first token, or when it ends
        self.after: anyio.Event | None = None  # waited for once the slot is had
        self._streaming = False  # its first token has come

    async def __aenter__(self) -> Slot:
        t = self._throttle
        if not self._taken and not t.take():  # a free one without a trip through the loop
            await t._slots.acquire()
        try:
            if self.after is not None:
                await self.after.wait()
            wait = t.pacer.wait(t.clock(), self._estimate)
            if wait > 0:
                await t._sleep(wait)
            if t.budget is not None:
                await t.admit(*self._split)
                self._held = True
        except BaseException:
            t._slots.release()
            if t.on_room is not None:
                t.on_room()
            raise
        t.in_flight += 1
        self.sent_in_flight = t.in_flight
        self.sent_at_limit = t.limit
        return self

    async def __aexit__(self, *_exc: object) -> None:
        if self.warm is not None:
            self.warm.set()
        t = self._throttle
        t.in_flight -= 1
        t.streaming -= self._streaming
        t._slots.release()
        if self._held and t.budget is not None:
            t.budget.settle(*self._split, self._used)
        if t.on_room is not None:
            t.on_room()

    def accepted(self) -> None:
        t = self._throttle
        if t.controller is not None:
            t.controller.accepted(self.sent_in_flight)
            t._apply(None)

    def first_token(self, ttft: float) -> None:
        if self.warm is not None:
            self.warm.set()
        t = self._throttle
        if not self._streaming:
            self._streaming = True
            t.streaming += 1
        if t.controller is None:
            return
        sent, limit = self.sent_in_flight, self.sent_at_limit
        change = t.controller.first_token(
            t.clock(), ttft=ttft, sent_in_flight=sent, sent_at_limit=limit
        )
        t._apply(change)

    def done(self, completion: Completion, output_tokens: int) -> None:
        t = self._throttle
        now = t.clock()
        used = None
        self._used = (self._split[0], output_tokens)  # estimated, unless the server says
        if completion.completion_tokens is not None:
            used = (completion.prompt_tokens or 0) + completion.completion_tokens
            self._used = (completion.prompt_tokens or 0, completion.completion_tokens)
        t.pacer.succeeded(
            now, estimated_tokens=self._estimate, used_tokens=used, rate=completion.rate
        )
        seen = self._seen(
            tokens=output_tokens, latency=completion.latency_s, ttft=completion.ttft_s
        )
        self._finish(now, seen)

    def failed(self, error: RequestError) -> None:
        t = self._throttle
        now = t.clock()
        t.pacer.failed(now, error)
        kind = failure_kind(error)
        if kind is not None:
            self._finish(now, self._seen(failure=kind, retry_after=error_retry_after(error)))

    def _seen(
        self,
        *,
        tokens: int = 0,
        latency: float = 0.0,
        ttft: float | None = None,
        failure: str | None = None,
        retry_after: float | None = None,
    ) -> Observation:
        return Observation(
            sent_in_flight=self.sent_in_flight,
            ended_in_flight=self._throttle.in_flight,
            sent_at_limit=self.sent_at_limit,
            tokens=tokens,
            latency=latency,
            ttft=ttft,
            failure=failure,
            retry_after=retry_after,
        )

    def _finish(self, now: float, seen: Observation) -> None:
        t = self._throttle
        if t.controller is not None:
            t._apply(t.controller.finished(now, seen))


def failure_kind(error: RequestError) -> str | None:
    """What a failed request says about the server's capacity; None: nothing (a bad request,
    a wrong key: the request's or the configuration's fault)."""
    if not isinstance(error, TransientError):
        return None
    if isinstance(error, RateLimited) or (isinstance(error, Overloaded) and error.status == 503):
        return "refused"
    if isinstance(error, RequestTimeout):
        return "timeout"
    if isinstance(error, StreamCut):
        return "cut"
    if isinstance(error, ConnectionFailed):
        return "reset"
    return "error"


def error_retry_after(error: RequestError) -> float | None:
    return error.retry_after if isinstance(error, TransientError) else None
