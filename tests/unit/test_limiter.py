"""Client-side rate limits: the token buckets and the pacer. No I/O, no clock."""

from __future__ import annotations

import pytest

from batchrun.backends import RateInfo
from batchrun.errors import RateLimited
from batchrun.limiter import Pacer, TokenBucket, estimate_request_tokens


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


def test_pacer_applies_rpm_and_tpm_buckets() -> None:
    pacer = Pacer(rpm=60, tpm=600)
    waits = [pacer.wait(0.0, 10) for _ in range(8)]
    assert waits[:5] == [0, 0, 0, 0, 0]  # five seconds of burst at one a second
    assert waits[5] == pytest.approx(1.0)


def test_a_slow_rpm_sends_its_first_request_at_once() -> None:
    # --rpm 1: five seconds of burst is a twelfth of a request, and the first one waited 55 s;
    # the burst is at least one request, so it goes now and the next a minute later.
    pacer = Pacer(rpm=1)
    assert pacer.wait(0.0, 10) == 0
    assert pacer.wait(0.0, 10) == pytest.approx(60.0)
    shared = Pacer(rpm=6)
    shared.share(3)  # three workers, 2 a minute each: the job's one-request burst is shared
    assert shared.wait(0.0, 10) == pytest.approx(20.0)  # (1 - 1/3) of a request at 2 a minute


@pytest.mark.parametrize(("rpm", "workers"), [(2, 4), (6, 3), (30, 4), (1, 2)])
def test_workers_sharing_a_slow_rpm_keep_to_it_in_every_minute(rpm: int, workers: int) -> None:
    # Started together, each worker on its part of the rate: they sent at the same moment,
    # four at a time every two minutes under --rpm 2. Each takes its turn by its rank.
    sent: list[float] = []
    for rank in range(workers):
        pacer, now = Pacer(rpm=rpm), 0.0
        pacer.share(workers, rank=rank)
        for _ in range(12):
            now += pacer.wait(now, 10)
            sent.append(now)
    sent.sort()
    assert max(sum(1 for t in sent if start <= t < start + 60.0) for start in sent) <= rpm


def test_pacer_waits_for_the_servers_reset_when_its_budget_is_spent() -> None:
    pacer = Pacer()
    spent = RateInfo(remaining_requests=0, reset_requests_s=2.5)
    pacer.succeeded(5.0, estimated_tokens=10, used_tokens=8, rate=spent)
    assert pacer.wait(5.0, 10) == pytest.approx(2.5)
    low_tokens = RateInfo(remaining_tokens=5, reset_tokens_s=1.0)
    pacer.succeeded(10.0, estimated_tokens=10, used_tokens=8, rate=low_tokens)
    assert pacer.wait(10.0, 10) == pytest.approx(1.0)


def test_pacer_spaces_requests_at_the_refill_rate_once_the_budget_runs_low() -> None:
    pacer = Pacer(in_flight=10)

    def told(remaining: int, reset: float) -> None:
        rate = RateInfo(remaining_requests=remaining, reset_requests_s=reset, limit_requests=3000)
        pacer.succeeded(0.0, estimated_tokens=10, used_tokens=None, rate=rate)

    told(2500, 10.0)  # plenty left: no spacing
    assert [pacer.wait(0.0, 10) for _ in range(5)] == [0.0] * 5
    # 15 left, under two rounds of 10 in flight; 2985 used refill in 59.7 s: 50 a second
    told(15, 59.7)
    waits = [pacer.wait(0.0, 10) for _ in range(4)]
    assert waits == pytest.approx([0.0, 0.02, 0.04, 0.06])
    told(2000, 20.0)  # refilled: spacing stops
    assert pacer.wait(1.0, 10) == 0.0


def test_tokens_budget_spaces_requests_by_their_estimated_tokens() -> None:
    pacer = Pacer(in_flight=4)
    rate = RateInfo(remaining_tokens=500, reset_tokens_s=5.0, limit_tokens=10_500)
    pacer.succeeded(0.0, estimated_tokens=100, used_tokens=None, rate=rate)
    # 10,000 tokens refill in 5 s: 2,000 a second; a 100-token request every 0.05 s
    assert [pacer.wait(0.0, 100) for _ in range(3)] == pytest.approx([0.0, 0.05, 0.1])


def test_estimated_request_tokens() -> None:
    body = {"messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 50}
    assert estimate_request_tokens(body) == 150
    assert estimate_request_tokens({"prompt": "abcd"}) == 1 + 256


def test_a_429_pauses_everyone_only_when_the_whole_budget_is_spent() -> None:
    pacer = Pacer()
    pacer.failed(10.0, RateLimited("429", retry_after=4.0))  # this request's own bad luck
    assert pacer.wait(10.5, 100) == 0.0  # it waits its Retry-After alone (the retry policy)
    pacer.failed(10.0, RateLimited("429", retry_after=4.0, budget_spent=True))
    assert pacer.wait(11.0, 100) == pytest.approx(3.0)
    assert pacer.wait(14.5, 100) == 0


def test_a_workers_part_of_the_jobs_budget() -> None:
    def sent_in_a_minute(pacer: Pacer) -> int:
        now, sent = 0.0, 0
        while True:
            now += pacer.wait(now, 1)  # each request goes when the pacer lets it
            if now >= 60:
                return sent
            sent += 1

    alone, shared = Pacer(rpm=600), Pacer(rpm=600)
    shared.share(3)  # three workers on the job: 200 a minute each
    assert 600 <= sent_in_a_minute(alone) <= 660  # a minute's budget plus its 5 s of burst
    assert 200 <= sent_in_a_minute(shared) <= 220
    shared.share(1)  # the others left: the whole budget again
    assert shared.requests is not None and shared.requests.rate == 10.0


def test_ready_says_whether_a_request_would_go_now_and_takes_nothing() -> None:
    pacer = Pacer(rpm=2)
    assert pacer.ready(0.0) and pacer.ready(0.0)  # asking takes nothing
    assert pacer.wait(0.0, 10) == 0
    assert not pacer.ready(0.0) and not pacer.ready(29.0)
    assert pacer.ready(30.0)  # a request's worth again, at 2 a minute
    assert Pacer().ready(0.0)  # no --rpm: always
