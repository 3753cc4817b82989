"""The concurrency controller against synthetic servers, and the token buckets. No I/O, no clock."""

from __future__ import annotations

import pytest

from batchrun.backends import RateInfo
from batchrun.limiter import ConcurrencyController, Pacer, TokenBucket, estimate_request_tokens


class Server:
    """A continuous-batching server in closed form: `slots` sequences decode at once, each
    token slower as the batch fills; requests beyond the slots queue for the next free slot."""

    def __init__(self, slots: int, ttft: float = 0.1, tpot: float = 0.02, slope: float = 0.5,
                 tokens: int = 40) -> None:  # fmt: skip
        self.slots, self.ttft, self.tpot, self.slope, self.tokens = slots, ttft, tpot, slope, tokens

    def service(self, limit: int) -> float:
        active = min(limit, self.slots)
        factor = 1 + self.slope * (active - 1) / self.slots
        return self.ttft + self.tpot * factor * (self.tokens - 1)

    def requests_per_s(self, limit: int) -> float:
        return min(limit, self.slots) / self.service(limit)

    def ttft_at(self, limit: int) -> float:
        queued = max(0, limit - self.slots)
        return self.ttft + queued / self.requests_per_s(limit)


def drive(ctl: ConcurrencyController, server: Server, windows: int, now: float = 0.0) -> float:
    """Feed `windows` windows of completions at the controller's current limit."""
    for _ in range(windows):
        limit = ctl.limit
        n = max(8, limit)
        gap = 1 / server.requests_per_s(limit)
        for _ in range(n):
            now += gap
            ctl.completed(now, tokens=server.tokens, ttft=server.ttft_at(limit))
    return now


@pytest.mark.parametrize("slots", [8, 64, 256])
def test_ramps_from_low_and_settles_at_the_knee(slots: int) -> None:
    ctl = ConcurrencyController(initial=2, maximum=1024)
    drive(ctl, Server(slots), windows=60)
    reasons = [c.reason for _, c in ctl.history]
    assert reasons[0] == "ramp" and "knee" in reasons
    assert slots <= ctl.limit <= slots * 1.25  # the documented band: the knee, or one probe over
    ramp_limits = [c.limit for _, c in ctl.history if c.reason == "ramp"]
    assert ramp_limits == sorted(ramp_limits) and ramp_limits[0] == 4  # doubling from 2


def test_throughput_at_the_settled_limit_is_near_the_best_possible() -> None:
    server = Server(64)
    ctl = ConcurrencyController(initial=1, maximum=1024)
    drive(ctl, server, windows=60)
    best = max(server.requests_per_s(n) for n in range(1, 1025))
    assert server.requests_per_s(ctl.limit) >= 0.9 * best
    assert server.ttft_at(ctl.limit) <= 3 * server.ttft  # not queueing


def test_maximum_caps_the_ramp() -> None:
    ctl = ConcurrencyController(initial=2, maximum=16)
    drive(ctl, Server(256), windows=40)
    assert ctl.limit == 16
    assert max(c.limit for _, c in ctl.history) == 16


def test_429_cuts_at_once_and_pauses_until_retry_after() -> None:
    ctl = ConcurrencyController(initial=2, maximum=1024)
    now = drive(ctl, Server(64), windows=30)
    settled = ctl.limit
    change = ctl.overloaded(now, retry_after=7.0)
    assert change is not None and change.reason == "back-off"
    assert ctl.limit == settled // 2
    assert ctl.pause_until == pytest.approx(now + 7.0)


def test_a_burst_of_429s_floors_at_the_minimum_and_keeps_the_longest_pause() -> None:
    ctl = ConcurrencyController(initial=64, minimum=1, maximum=1024)
    for i in range(20):
        ctl.overloaded(100.0 + i * 0.01, retry_after=5.0 if i != 3 else 30.0)
    assert ctl.limit == 1
    assert ctl.pause_until == pytest.approx(100.03 + 30.0)


def test_recovers_after_overload_by_probing_back_up() -> None:
    server = Server(64)
    ctl = ConcurrencyController(initial=2, maximum=1024)
    now = drive(ctl, server, windows=30)
    for _ in range(3):
        ctl.overloaded(now, retry_after=1.0)  # a short storm: limit 64 -> 8
    assert ctl.limit <= 8
    drive(ctl, server, windows=200, now=now + 1)
    assert ctl.limit >= 48  # probes that buy throughput are kept
    assert any(c.reason == "probe kept" for _, c in ctl.history)


def test_backs_off_when_the_server_gets_busier() -> None:
    ctl = ConcurrencyController(initial=2, maximum=1024)
    server = Server(64)
    now = drive(ctl, server, windows=30)
    settled = ctl.limit
    busier = Server(16)  # other tenants took most of the slots: TTFT climbs
    drive(ctl, busier, windows=20, now=now)
    assert ctl.limit < settled
    assert any(c.reason == "latency" for _, c in ctl.history)


def test_probes_that_do_not_help_are_reverted() -> None:
    ctl = ConcurrencyController(initial=2, maximum=1024)
    drive(ctl, Server(64), windows=120)
    reasons = [c.reason for _, c in ctl.history]
    assert reasons.count("probe") >= 2 and "probe reverted" in reasons


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError):
        ConcurrencyController(minimum=0)
    with pytest.raises(ValueError):
        ConcurrencyController(minimum=8, maximum=4)


# --- token buckets ------------------------------------------------------------------------


def test_bucket_allows_a_burst_then_paces_at_the_rate() -> None:
    bucket = TokenBucket(60, burst=3)  # one a second, three at once
    waits = [bucket.take(0.0) for _ in range(6)]
    assert waits == pytest.approx([0, 0, 0, 1, 2, 3])


def test_bucket_refills_over_time_up_to_its_burst() -> None:
    bucket = TokenBucket(120, burst=2)  # two a second
    assert bucket.take(0.0, 2) == 0
    assert bucket.take(0.5) == 0  # one came back in half a second
    assert bucket.take(100.0, 2) == 0  # full again, but never more than the burst
    assert bucket.take(100.0) == pytest.approx(0.5)


def test_token_estimates_are_corrected_by_actual_usage() -> None:
    bucket = TokenBucket(600, burst=100)  # ten tokens a second
    assert bucket.take(0.0, 100) == 0  # estimated: prompt + max_tokens
    assert bucket.take(0.0, 50) == pytest.approx(5.0)
    bucket.correct(0.0, estimated=100, actual=40)  # the first used 40: 60 come back
    assert bucket.take(0.0, 10) == 0


def test_bucket_rejects_a_zero_rate() -> None:
    with pytest.raises(ValueError):
        TokenBucket(0)


# --- the pacer: pauses, buckets and server headers ------------------------------------------


def test_pacer_pauses_everyone_after_a_429_with_retry_after() -> None:
    from batchrun.errors import RateLimited

    pacer = Pacer(None)
    assert pacer.failed(10.0, RateLimited("429", retry_after=4.0)) is None  # fixed: no change
    assert pacer.wait(11.0, 100) == pytest.approx(3.0)
    assert pacer.wait(14.5, 100) == 0


def test_pacer_cuts_the_adaptive_limit_on_overload_only() -> None:
    from batchrun.errors import Overloaded, RequestTimeout

    pacer = Pacer(ConcurrencyController(initial=32, maximum=64))
    assert pacer.failed(1.0, Overloaded("HTTP 500", status=500)) is None
    change = pacer.failed(1.0, Overloaded("HTTP 503", status=503))
    assert change is not None and change.limit == 16 and change.reason == "back-off"
    assert pacer.failed(1.0, RequestTimeout("slow")) is not None


def test_pacer_applies_rpm_and_tpm_buckets() -> None:
    pacer = Pacer(None, rpm=60, tpm=600)
    waits = [pacer.wait(0.0, 10) for _ in range(8)]
    assert waits[:5] == [0, 0, 0, 0, 0]  # five seconds of burst at one a second
    assert waits[5] == pytest.approx(1.0)


def test_pacer_waits_for_the_servers_reset_when_its_budget_is_spent() -> None:
    pacer = Pacer(None)
    spent = RateInfo(remaining_requests=0, reset_requests_s=2.5)
    pacer.succeeded(5.0, estimated_tokens=10, used_tokens=8, output_tokens=4, ttft=0.1,
                    rate=spent, sent_at_limit=1)  # fmt: skip
    assert pacer.wait(5.0, 10) == pytest.approx(2.5)
    low_tokens = RateInfo(remaining_tokens=5, reset_tokens_s=1.0)
    pacer.succeeded(10.0, estimated_tokens=10, used_tokens=8, output_tokens=4, ttft=0.1,
                    rate=low_tokens, sent_at_limit=1)  # fmt: skip
    assert pacer.wait(10.0, 10) == pytest.approx(1.0)


def test_pacer_spaces_requests_at_the_refill_rate_once_the_budget_runs_low() -> None:
    pacer = Pacer(None, in_flight=10)

    def told(remaining: int, reset: float) -> None:
        rate = RateInfo(remaining_requests=remaining, reset_requests_s=reset,
                        limit_requests=3000)  # fmt: skip
        pacer.succeeded(0.0, estimated_tokens=10, used_tokens=None, output_tokens=4, ttft=0.1,
                        rate=rate, sent_at_limit=10)  # fmt: skip

    told(2500, 10.0)  # plenty left: no spacing
    assert [pacer.wait(0.0, 10) for _ in range(5)] == [0.0] * 5
    # 15 left, under two rounds of 10 in flight; 2985 used refill in 59.7 s: 50 a second
    told(15, 59.7)
    waits = [pacer.wait(0.0, 10) for _ in range(4)]
    assert waits == pytest.approx([0.0, 0.02, 0.04, 0.06])
    told(2000, 20.0)  # refilled: spacing stops
    assert pacer.wait(1.0, 10) == 0.0


def test_tokens_budget_spaces_requests_by_their_estimated_tokens() -> None:
    pacer = Pacer(None, in_flight=4)
    rate = RateInfo(remaining_tokens=500, reset_tokens_s=5.0, limit_tokens=10_500)
    pacer.succeeded(0.0, estimated_tokens=100, used_tokens=None, output_tokens=4, ttft=0.1,
                    rate=rate, sent_at_limit=4)  # fmt: skip
    # 10,000 tokens refill in 5 s: 2,000 a second; a 100-token request every 0.05 s
    assert [pacer.wait(0.0, 100) for _ in range(3)] == pytest.approx([0.0, 0.05, 0.1])


def test_completions_sent_under_an_old_limit_are_ignored() -> None:
    ctl = ConcurrencyController(initial=4)
    for i in range(20):
        assert ctl.completed(float(i), tokens=10, ttft=0.1, sent_at_limit=2) is None
    assert ctl.limit == 4 and not ctl.history


def test_estimated_request_tokens() -> None:
    body = {"messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 50}
    assert estimate_request_tokens(body) == 150
    assert estimate_request_tokens({"prompt": "abcd"}) == 1 + 256


def test_a_burst_of_refusals_of_one_episode_cuts_once() -> None:
    ctl = ConcurrencyController(initial=128, maximum=1024)
    changes = [ctl.overloaded(5.0, retry_after=1.0, sent_at_limit=128) for _ in range(30)]
    assert [c.limit for c in changes if c is not None] == [64]
    assert ctl.limit == 64  # the 29 others were requests sent before the cut
    later = ctl.overloaded(9.0, sent_at_limit=64)  # a new episode at the new limit
    assert later is not None and later.limit == 32
