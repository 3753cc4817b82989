"""The simulator's capacity model: slots, queueing, decode slow-down, gate, per-minute limits."""

from __future__ import annotations

import orjson
import pytest

from batchrun.sim import SimConfig, SimModel
from batchrun.sim.capacity import Admission, Capacity, Refusal


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def admit(cap: Capacity, n_out: int = 11, ttft: float = 0.1, tpot: float = 0.01) -> Admission:
    result = cap.admit(prompt_tokens=5, n_out=n_out, ttft=ttft, tpot=tpot)
    assert isinstance(result, Admission), result
    return result


def test_without_slots_nothing_waits() -> None:
    cap = Capacity(clock=Clock())
    assert all(admit(cap).queue_wait == 0 for _ in range(100))


def test_requests_beyond_the_slots_wait_for_the_first_free_slot() -> None:
    clock = Clock()
    cap = Capacity(slots=2, clock=clock)
    # each request holds its slot for ttft + tpot * (n_out - 1) = 0.1 + 0.01 * 10 = 0.2 s
    assert admit(cap).queue_wait == 0
    assert admit(cap).queue_wait == 0
    third = admit(cap)
    assert third.queue_wait == pytest.approx(0.2)
    fourth = admit(cap)
    assert fourth.queue_wait == pytest.approx(0.2)
    assert cap.queued == 2
    clock.now += 0.3  # the first two finished, the queued two are decoding until 0.4
    assert cap.queued == 0
    assert admit(cap).queue_wait == pytest.approx(0.1)


def test_time_to_first_token_grows_with_the_queue() -> None:
    cap = Capacity(slots=4, clock=Clock())
    waits = [admit(cap).queue_wait for _ in range(16)]
    assert waits[:4] == [0, 0, 0, 0]
    assert waits[4:8] == pytest.approx([0.2] * 4)
    assert waits[8:12] == pytest.approx([0.4] * 4)
    assert waits[12:] == pytest.approx([0.6] * 4)


def test_decode_slows_as_the_batch_fills() -> None:
    cap = Capacity(slots=4, tpot_slope=0.6, clock=Clock())
    factors = [admit(cap).tpot_factor for _ in range(4)]
    assert factors == pytest.approx([1.0, 1.15, 1.3, 1.45])


def test_gate_refuses_past_the_queue_limit_with_retry_after() -> None:
    cap = Capacity(slots=1, queue_limit=1, gate_status=503, clock=Clock())
    admit(cap)
    assert admit(cap).queue_wait == pytest.approx(0.2)
    refused = cap.admit(prompt_tokens=5, n_out=11, ttft=0.1, tpot=0.01)
    assert isinstance(refused, Refusal)
    assert refused.status == 503 and refused.retry_after == pytest.approx(0.2)


def test_requests_per_minute_refill_like_openais_budget() -> None:
    clock = Clock()
    cap = Capacity(rpm=3, clock=clock)  # 3 at most, refilling at 3 a minute
    remaining = []
    for _ in range(3):
        first = admit(cap)
        remaining.append(first.headers["x-ratelimit-remaining-requests"])
        assert first.headers["x-ratelimit-limit-requests"] == "3"
        clock.now += 1
    assert remaining == ["3", "2", "1"]
    refused = cap.admit(prompt_tokens=5, n_out=11, ttft=0.1, tpot=0.01)
    assert isinstance(refused, Refusal) and refused.status == 429
    # 0.15 requests left: one more in (1 - 0.15) / (3/60) s; full again in (3 - 0.15) / (3/60)
    assert refused.retry_after == pytest.approx(17.0)
    assert refused.headers["x-ratelimit-reset-requests"] == "57.000s"
    clock.now += 17.0
    assert admit(cap).headers["x-ratelimit-remaining-requests"] == "1"


def test_tokens_per_minute() -> None:
    clock = Clock()
    cap = Capacity(tpm=40, clock=clock)
    admit(cap, n_out=15)  # 5 prompt + 15 output = 20 tokens
    second = admit(cap, n_out=15)
    assert second.headers["x-ratelimit-remaining-tokens"] == "20"
    refused = cap.admit(prompt_tokens=5, n_out=15, ttft=0.1, tpot=0.01)
    assert isinstance(refused, Refusal) and "tokens per minute" in refused.message
    clock.now += 60.5
    admit(cap, n_out=15)


def test_the_model_plays_queueing_and_refusals_as_replies() -> None:
    clock = Clock()
    config = SimConfig(
        ttft_ms=100,
        tpot_ms=10,
        min_output_tokens=11,
        max_output_tokens=11,
        slots=1,
        queue_limit=1,
        rpm=100,
    )
    model = SimModel(config, clock=clock)
    body = {"model": "sim-1", "messages": [{"role": "user", "content": "x"}], "stream": True}
    first = model.complete("chat", body)
    second = model.complete("chat", {**body, "messages": [{"role": "user", "content": "y"}]})
    third = model.complete("chat", {**body, "messages": [{"role": "user", "content": "z"}]})
    assert first.events is not None and second.events is not None
    # the first content event waits for the time to first token, plus the queue for the second
    assert first.events[1][0] == pytest.approx(0.1)
    assert second.events[1][0] == pytest.approx(0.1 + 0.2)
    assert second.headers["x-ratelimit-remaining-requests"] == "99"
    assert third.status == 429 and int(third.headers["retry-after"]) >= 1
    assert "queue full" in orjson.loads(third.body)["error"]["message"]


def test_a_gate_with_no_queue_refuses_everything_past_the_slots() -> None:
    cap = Capacity(slots=2, queue_limit=0, clock=Clock())
    admit(cap)
    admit(cap)
    refused = cap.admit(prompt_tokens=5, n_out=11, ttft=0.1, tpot=0.01)
    assert isinstance(refused, Refusal) and refused.status == 429
    assert refused.retry_after == pytest.approx(0.2)  # when the first slot frees


def test_load_is_the_busy_slots_and_the_queue_now() -> None:
    clock = Clock()
    cap = Capacity(slots=2, clock=clock)
    assert cap.load() == (0, 0)
    for _ in range(5):  # 0.2 s each: two start now, two at 0.2, one at 0.4
        admit(cap)
    assert cap.load() == (2, 3)
    clock.now += 0.3
    assert cap.load() == (2, 1)
    clock.now += 0.2
    assert cap.load() == (1, 0)
    clock.now += 0.2
    assert cap.load() == (0, 0)


def test_load_without_slots_is_what_is_in_flight() -> None:
    clock = Clock()
    cap = Capacity(clock=clock)
    admit(cap)  # 0.2 s
    admit(cap, n_out=21)  # 0.3 s
    assert cap.load() == (2, 0)
    clock.now += 0.25
    assert cap.load() == (1, 0)
    clock.now += 0.1
    assert cap.load() == (0, 0)


def test_refused_requests_are_no_load() -> None:
    gated = Capacity(slots=1, queue_limit=1, clock=Clock())
    limited = Capacity(rpm=1, clock=Clock())
    for cap in (gated, limited):
        while isinstance(cap.admit(prompt_tokens=5, n_out=11, ttft=0.1, tpot=0.01), Admission):
            pass
    assert gated.load() == (1, 1)
    assert limited.load() == (1, 0)
