"""RetryPolicy and OutageWatch with a fake clock and a fake sleep: no real waiting."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import anyio
import pytest

from batchrun.errors import (
    AuthFailed,
    BadRequest,
    ConnectionFailed,
    EndpointDown,
    NotFound,
    Overloaded,
    RateLimited,
    RequestError,
    RequestTimeout,
    StreamCut,
    TransientError,
)
from batchrun.retrying import MAX_RETRY_AFTER, OutageWatch, RetryPolicy, Tally
from tests.fakes import FakeTime


class Script:
    """An async callable that raises the scripted errors in turn, then returns "ok"."""

    def __init__(
        self, errors: Sequence[Exception], *, forever: Callable[[], Exception] | None = None
    ) -> None:
        self.errors = list(errors)
        self.forever = forever
        self.calls = 0
        self.raised: list[Exception] = []

    async def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            exc = self.errors.pop(0)
        elif self.forever is not None:
            exc = self.forever()
        else:
            return "ok"
        self.raised.append(exc)
        raise exc


def make_policy(
    max_attempts: int = 5, grace: float = 60.0, **kwargs: float
) -> tuple[RetryPolicy, OutageWatch, FakeTime]:
    clock = FakeTime()
    watch = OutageWatch(grace, clock=clock)
    return RetryPolicy(max_attempts, watch, sleep=clock.sleep, **kwargs), watch, clock


# --- RetryPolicy ----------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize(
    "error",
    [
        Overloaded("HTTP 500", status=500),
        RequestTimeout("slow"),
        StreamCut("cut"),
        RateLimited("429"),
        Overloaded("HTTP 408", status=408),
    ],
    ids=lambda e: type(e).__name__,
)
async def test_transient_errors_retried_until_success(error: TransientError) -> None:
    policy, _watch, clock = make_policy(max_attempts=5)
    fn = Script([error, error, error])
    assert await policy.call(fn) == "ok"
    assert fn.calls == 4
    assert len(clock.sleeps) == 3


@pytest.mark.anyio
@pytest.mark.parametrize(("charged", "sent"), [(0, 3), (2, 1), (3, 1), (7, 1)])
async def test_an_earlier_runs_charged_attempts_count_and_the_first_is_always_sent(
    charged: int, sent: int
) -> None:
    # A stopped run's attempts go on at resume; a line that used them all (a lower
    # --max-attempts given at resume) is sent once more, not never.
    policy, _watch, _clock = make_policy(max_attempts=3)
    fn = Script([], forever=lambda: Overloaded("HTTP 500", status=500))
    tally = Tally(charged)
    with pytest.raises(Overloaded):
        await policy.call(fn, tally=tally)
    assert fn.calls == sent
    assert tally.charged == charged + sent


@pytest.mark.anyio
async def test_success_first_time_does_not_sleep() -> None:
    policy, watch, clock = make_policy()
    fn = Script([])
    assert await policy.call(fn) == "ok"
    assert fn.calls == 1
    assert clock.sleeps == []
    assert not watch.down


@pytest.mark.anyio
async def test_stops_at_max_attempts_and_reraises_last_error() -> None:
    policy, watch, clock = make_policy(max_attempts=4)
    fn = Script([], forever=lambda: Overloaded("HTTP 500: boom", status=500))
    with pytest.raises(Overloaded) as info:
        await policy.call(fn)
    assert fn.calls == 4
    assert len(clock.sleeps) == 3
    assert info.value is fn.raised[-1]
    assert not watch.down


@pytest.mark.anyio
async def test_single_attempt_never_retries() -> None:
    policy, _watch, clock = make_policy(max_attempts=1)
    fn = Script([StreamCut("cut")])
    with pytest.raises(StreamCut):
        await policy.call(fn)
    assert fn.calls == 1
    assert clock.sleeps == []


@pytest.mark.anyio
@pytest.mark.parametrize(
    "error",
    [
        BadRequest("HTTP 400: too long", status=400),
        AuthFailed("HTTP 401", status=401),
        NotFound("HTTP 404", status=404),
    ],
    ids=lambda e: type(e).__name__,
)
async def test_permanent_and_fatal_errors_not_retried(error: RequestError) -> None:
    policy, watch, clock = make_policy(max_attempts=5)
    fn = Script([error])
    with pytest.raises(type(error)) as info:
        await policy.call(fn)
    assert info.value is error
    assert fn.calls == 1
    assert clock.sleeps == []
    assert not watch.down


@pytest.mark.anyio
async def test_unexpected_exceptions_pass_through() -> None:
    policy, _watch, clock = make_policy()
    fn = Script([ValueError("bug")])
    with pytest.raises(ValueError, match="bug"):
        await policy.call(fn)
    assert fn.calls == 1
    assert clock.sleeps == []


@pytest.mark.anyio
async def test_retry_after_is_honoured_exactly() -> None:
    policy, _watch, clock = make_policy()
    fn = Script([RateLimited("429", retry_after=7)])
    assert await policy.call(fn) == "ok"
    assert clock.sleeps == [7.0]


@pytest.mark.anyio
async def test_retry_after_on_overloaded_is_honoured() -> None:
    policy, _watch, clock = make_policy()
    fn = Script([Overloaded("503", status=500, retry_after=2.5), RateLimited("x", retry_after=0)])
    assert await policy.call(fn) == "ok"
    assert clock.sleeps == [2.5, 0.0]


@pytest.mark.anyio
async def test_huge_retry_after_is_capped() -> None:
    policy, _watch, clock = make_policy()
    fn = Script([RateLimited("429", retry_after=86_400.0)])
    assert await policy.call(fn) == "ok"
    assert clock.sleeps == [MAX_RETRY_AFTER]


@pytest.mark.anyio
async def test_backoff_within_exponential_jitter_bounds() -> None:
    base, cap = 0.5, 30.0
    attempts = 10
    for _ in range(20):
        policy, _watch, clock = make_policy(max_attempts=attempts, base_wait=base, max_wait=cap)
        fn = Script([], forever=lambda: Overloaded("HTTP 500", status=500))
        with pytest.raises(Overloaded):
            await policy.call(fn)
        assert len(clock.sleeps) == attempts - 1
        for i, wait in enumerate(clock.sleeps):
            assert 0.0 <= wait <= min(cap, base * 2**i)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("pick", "wanted"),
    [
        (lambda low, high: high, [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]),
        (lambda low, high: low, [0.0] * 8),
    ],
    ids=["upper", "lower"],
)
async def test_backoff_bounds_are_exactly_the_jitter_window(
    monkeypatch: pytest.MonkeyPatch,
    pick: Callable[[float, float], float],
    wanted: list[float],
) -> None:
    monkeypatch.setattr(random, "uniform", pick)
    policy, _watch, clock = make_policy(max_attempts=9, base_wait=0.5, max_wait=30.0)
    fn = Script([], forever=lambda: Overloaded("HTTP 500", status=500))
    with pytest.raises(Overloaded):
        await policy.call(fn)
    assert clock.sleeps == pytest.approx(wanted)


@pytest.mark.anyio
async def test_backoff_is_jittered() -> None:
    firsts = set()
    for _ in range(30):
        policy, _watch, clock = make_policy(max_attempts=2)
        await policy.call(Script([StreamCut("cut")]))
        firsts.add(clock.sleeps[0])
    assert len(firsts) > 1


# --- OutageWatch ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "error",
    [
        ConnectionFailed("refused"),
        RequestTimeout("no answer"),
        Overloaded("HTTP 500", status=500),
        Overloaded("HTTP 502", status=502),
        Overloaded("HTTP 503", status=503),
        Overloaded("HTTP 504", status=504),
    ],
    ids=["connect", "timeout", "500", "502", "503", "504"],
)
def test_outage_signs_mark_endpoint_down(error: TransientError) -> None:
    clock = FakeTime()
    watch = OutageWatch(30.0, clock=clock)
    assert not watch.down
    watch.failure(error, key=1)
    assert not watch.down  # one item failing may be that item's problem
    watch.failure(error, key=2)
    assert watch.down
    assert watch.down_since == clock.now
    assert watch.last_error == str(error)


@pytest.mark.parametrize(
    "error",
    [
        Overloaded("HTTP 408", status=408),
        RateLimited("HTTP 429", retry_after=5),
        StreamCut("cut"),
    ],
    ids=["408", "429", "streamcut"],
)
def test_other_transient_errors_do_not_mark_down(error: TransientError) -> None:
    watch = OutageWatch(30.0, clock=FakeTime())
    watch.failure(error, key=1)
    watch.failure(error, key=2)
    assert not watch.down
    watch.check()  # does not raise


@pytest.mark.parametrize("status", [500, 520, 524, 529])
def test_any_5xx_on_two_items_marks_the_endpoint_down(status: int) -> None:
    # A proxy's 520-524 (its origin dead) and 529 (overloaded) failed lines one by one.
    watch = OutageWatch(30.0, clock=FakeTime())
    watch.failure(Overloaded(f"HTTP {status}", status=status), key=1)
    watch.failure(Overloaded(f"HTTP {status}", status=status), key=2)
    assert watch.down


def test_success_clears_outage() -> None:
    watch = OutageWatch(30.0, clock=FakeTime())
    watch.failure(ConnectionFailed("refused"), key=1)
    watch.failure(ConnectionFailed("refused"), key=2)
    assert watch.down
    watch.success()
    assert not watch.down
    assert watch.down_since is None


def test_outage_start_is_first_failure_and_check_uses_grace() -> None:
    clock = FakeTime(start=0.0)
    watch = OutageWatch(60.0, clock=clock)
    watch.failure(ConnectionFailed("first"), key=1)
    clock.now = 40.0
    watch.failure(ConnectionFailed("second"), key=2)
    assert watch.down_since == 0.0
    assert watch.last_error == "second"
    clock.now = 60.0
    watch.check()  # exactly at the grace period: not yet
    clock.now = 60.5
    with pytest.raises(EndpointDown, match="second"):
        watch.check()


def test_success_restarts_clock() -> None:
    clock = FakeTime(start=0.0)
    watch = OutageWatch(60.0, clock=clock)
    watch.failure(ConnectionFailed("down"), key=1)
    clock.now = 50.0
    watch.success(key=1)  # item 1 itself got through: it is not a suspect
    clock.now = 70.0
    watch.failure(Overloaded("HTTP 503", status=503), key=1)
    watch.failure(Overloaded("HTTP 503", status=503), key=2)
    assert watch.down_since == 70.0
    clock.now = 125.0
    watch.check()  # 55s into the new outage
    clock.now = 131.0
    with pytest.raises(EndpointDown):
        watch.check()


def test_an_error_answer_moves_the_start_of_an_outage_that_follows() -> None:
    clock = FakeTime(start=0.0)
    watch = OutageWatch(60.0, clock=clock)
    watch.failure(ConnectionFailed("blip"), key=1)
    clock.now = 90.0
    watch.reached()  # a 400 answered: the server was there at 90 s
    clock.now = 100.0
    watch.failure(ConnectionFailed("restarting"), key=2)
    assert watch.down and watch.down_since == 100.0
    clock.now = 150.0
    watch.check()  # 50 s into the outage, not 150
    watch.reached()  # an error answer in an outage already seen: it stands
    assert watch.down_since == 100.0


# --- RetryPolicy during an outage --------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize(
    "error",
    [ConnectionFailed("connection refused"), Overloaded("HTTP 503", status=503)],
    ids=["connect", "503"],
)
async def test_outage_keeps_retrying_then_raises_endpoint_down(error: TransientError) -> None:
    grace = 60.0
    policy, watch, clock = make_policy(max_attempts=3, grace=grace)
    start = clock.now
    watch.failure(error, key="another item")  # the endpoint fails other items too
    fn = Script([], forever=lambda: error)
    with pytest.raises(EndpointDown) as info:
        await policy.call(fn)
    assert fn.calls > policy.max_attempts
    assert watch.down
    assert watch.down_since == start
    assert clock.now - start > grace
    # the last wait is the one that carried the clock past the grace period
    assert clock.now - clock.sleeps[-1] - start <= grace
    assert str(error) in str(info.value)
    assert f"{grace:g}s" in str(info.value)
    # waits during an outage are capped so the watch notices the end promptly
    assert all(w <= min(30.0, grace / 4) for w in clock.sleeps)


@pytest.mark.anyio
async def test_endpoint_down_raised_before_calling_when_outage_is_old() -> None:
    policy, watch, clock = make_policy(grace=10.0)
    watch.failure(ConnectionFailed("refused"), key=1)
    watch.failure(ConnectionFailed("refused"), key=2)
    clock.now += 11.0
    fn = Script([])
    with pytest.raises(EndpointDown):
        await policy.call(fn)
    assert fn.calls == 0


@pytest.mark.anyio
async def test_success_during_outage_resets_it() -> None:
    policy, watch, clock = make_policy(max_attempts=2, grace=600.0)
    watch.failure(ConnectionFailed("refused"), key="another item")
    fn = Script([ConnectionFailed("refused")] * 5)
    assert await policy.call(fn) == "ok"
    assert fn.calls == 6  # past max_attempts, because the endpoint was down
    assert len(clock.sleeps) == 5
    assert not watch.down
    assert watch.down_since is None
    # after the reset the normal attempt limit applies again
    second = Script([], forever=lambda: Overloaded("HTTP 500", status=500))
    with pytest.raises(Overloaded):
        await policy.call(second)
    assert second.calls == 2


@pytest.mark.anyio
async def test_success_elsewhere_during_outage_restarts_grace() -> None:
    grace = 60.0
    policy, watch, clock = make_policy(max_attempts=2, grace=grace)

    class Flaky:
        """Down; one other request gets through; then down again for good. The others that
        fail are fresh items each time, so the outage is everyone's, not this item's."""

        def __init__(self) -> None:
            self.calls = 0

        async def __call__(self) -> str:
            self.calls += 1
            watch.failure(ConnectionFailed("refused"), key=f"other-{self.calls}")
            if self.calls == 4:
                watch.success(key="lucky")  # someone got through; "mine" was failing: suspect
            raise ConnectionFailed("refused")

    first_down = clock.now
    fn = Flaky()
    with pytest.raises(ConnectionFailed):
        await policy.call(fn, key="mine")
    # Three outage failures did not count; at the fourth another request succeeded, so this item
    # became a suspect: that failure and the next count, and it runs out of its two attempts.
    assert fn.calls == 5
    assert watch.down_since is not None and watch.down_since > first_down


@pytest.mark.anyio
@pytest.mark.parametrize(
    "error",
    [ConnectionFailed("connection reset"), Overloaded("HTTP 504", status=504)],
    ids=["reset", "504"],
)
async def test_one_poison_item_is_failed_not_taken_for_an_outage(error: TransientError) -> None:
    policy, watch, _clock = make_policy(max_attempts=3, grace=60.0)
    fn = Script([], forever=lambda: error)
    with pytest.raises(type(error)):
        await policy.call(fn, key="poison")
    assert fn.calls == 3
    assert not watch.down


@pytest.mark.anyio
async def test_call_within_waits_for_a_starting_server_then_gives_up() -> None:
    policy, _watch, clock = make_policy(grace=20.0)
    starting = Script([ConnectionFailed("refused")] * 4)
    assert await policy.call_within(starting, 20.0) == "ok"
    assert starting.calls == 5
    never = Script([], forever=lambda: ConnectionFailed("refused"))
    before = clock.now
    with pytest.raises(ConnectionFailed):
        await policy.call_within(never, 20.0)
    assert clock.now - before >= 20.0


@pytest.mark.anyio
async def test_call_within_ends_at_its_grace_whatever_the_clock_reads() -> None:
    """Each wait is cut to the grace left; a wait of exactly what is left could end a hair
    short of it in floating point (a clock past 1004: start + 20 crosses 1024 and rounds, and
    (start + 20) - start < 20), and then every wait was 0 and the loop never ended (it hung
    CI once). Starts spread over that range, seeded."""
    random.seed(7)
    for _ in range(300):
        policy, _watch, clock = make_policy(grace=20.0)
        clock.now = 1004 + 20 * random.random()
        never = Script([], forever=lambda: ConnectionFailed("refused"))
        with anyio.fail_after(5), pytest.raises(ConnectionFailed):
            await policy.call_within(never, 20.0)
        assert never.calls < 100


@pytest.mark.anyio
async def test_poison_items_are_failed_even_when_nothing_else_is_left() -> None:
    """Two prompts that always get 504 while the endpoint answers everyone else: once another
    request has succeeded during their failures they are suspects, and their attempts count,
    even at the end of the job when they are the only requests left."""
    policy, watch, _clock = make_policy(max_attempts=3, grace=60.0)
    poison = Overloaded("HTTP 504", status=504)
    watch.failure(poison, key="p1")
    watch.failure(poison, key="p2")
    watch.success(key="healthy")  # another item got through: p1 and p2 are suspects now
    for key in ("p1", "p2"):
        fn = Script([], forever=lambda: poison)
        with pytest.raises(Overloaded):
            await policy.call(fn, key=key)
        assert fn.calls == 3
    assert not watch.down


@pytest.mark.anyio
async def test_an_answer_to_a_request_sent_before_an_outage_makes_no_suspects() -> None:
    # Before: the answer to a request already at the server when the outage began made every
    # item failing by then a suspect, so their failures counted: a clean outage failed items.
    policy, watch, clock = make_policy(max_attempts=2, grace=60.0)
    down = Overloaded("HTTP 500", status=500)

    async def at_the_server() -> str:
        clock.now += 1.0  # the outage begins while this request is being answered
        watch.failure(down, key="a")
        watch.failure(down, key="b")
        return "ok"

    assert await policy.call(at_the_server, key="early") == "ok"
    assert not watch.suspect("a") and not watch.suspect("b")
    watch.failure(down, key="a")
    assert watch.failure(down, key="b")  # an outage again: their failures cost no attempt
    watch.success(key="later")  # sent after their failures: the endpoint works, theirs are own
    assert watch.suspect("a") and watch.suspect("b") and not watch.down


def fail_in_step(watch: OutageWatch, clock: FakeTime, keys: tuple[str, ...], rounds: int) -> None:
    """Each round a request goes out, `keys` fail a moment later, then it is answered."""
    down = Overloaded("HTTP 500", status=500)
    for _ in range(rounds):
        sent = clock.now
        clock.now += 0.1
        for key in keys:
            watch.failure(down, key=key)
        clock.now += 0.9
        watch.success(key="answered", sent=sent)
        watch.check()  # the endpoint answers: never EndpointDown


def test_answers_keep_an_endpoint_up_while_items_fail_faster_than_answers_come() -> None:
    # A review of the fix above: items failing again before an answer to a request sent
    # after their failure came kept the outage's clock running, so a working endpoint was
    # declared down (EndpointDown) once the grace had passed.
    clock = FakeTime()
    fail_in_step(OutageWatch(2.0, clock=clock), clock, ("a", "b"), rounds=10)


def test_an_item_that_fails_in_step_with_the_answers_is_found_out() -> None:
    # Each answer was sent just before the item's latest failure; its first failure is kept
    # across answers, so the next one (sent after it) still proves the failures its own.
    # Before: two such items retried for free until the job ran dry, then stopped it.
    clock = FakeTime()
    watch = OutageWatch(60.0, clock=clock)
    fail_in_step(watch, clock, ("p",), rounds=2)
    assert watch.suspect("p")


@pytest.mark.anyio
async def test_a_suspect_that_succeeds_is_cleared() -> None:
    policy, watch, _clock = make_policy(max_attempts=3, grace=60.0)
    watch.failure(ConnectionFailed("x"), key="a")
    watch.success(key="b")
    assert await policy.call(Script([]), key="a") == "ok"
    watch.failure(ConnectionFailed("x"), key="a")
    watch.failure(ConnectionFailed("x"), key="c")
    assert watch.down  # "a" counts towards an outage again


@pytest.mark.anyio
async def test_zero_outage_timeout_turns_outage_handling_off() -> None:
    policy, watch, _clock = make_policy(max_attempts=2, grace=0.0)
    watch.failure(ConnectionFailed("refused"), key="other")
    fn = Script([], forever=lambda: ConnectionFailed("refused"))
    with pytest.raises(ConnectionFailed):
        await policy.call(fn, key="mine")
    assert fn.calls == 2 and not watch.down
