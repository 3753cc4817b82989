"""The concurrency controller against synthetic servers, in simulated time: no I/O, no clock.

`drive` plays a closed loop of whole jobs: it keeps `ctl.admitted` requests in flight, each one
seeing the server shape at the concurrency it was sent with, and feeds the controller response
heads (HEAD_S after sending), first tokens, answers and failures in time order, as the throttle
does in a real run.
"""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass

import pytest

from batchrun.controller import Change, ConcurrencyController
from batchrun.evidence import Curve, Observation
from batchrun.server_metrics import ServerLoad


@dataclass(frozen=True)
class Shape:
    """What a request sent with `n` in flight sees: `slots` sequences decode at once, each token
    slower as the batch fills; past the slots, requests queue for the next free slot."""

    slots: int = 64
    ttft: float = 0.05
    tpot: float = 0.01
    slope: float = 0.5
    tokens: int = 40
    prefill_growth: float = 0.0  # TTFT grows this much (x unloaded) per concurrent prefill
    gate: int | None = None  # refused (429) past this many in flight
    fault_rate: float = 0.0  # scattered failures, whatever the load
    fault_kind: str = "error"  # "error": halfway through an answer; "refused": at its head
    one_at_a_time: bool = False  # a new request cuts the one running

    def prefill(self, n: int) -> float:
        return self.ttft * (1 + self.prefill_growth * (min(n, self.slots) - 1))

    def service(self, n: int) -> float:
        active = min(n, self.slots)
        factor = 1 + self.slope * (active - 1) / self.slots
        return self.prefill(n) + self.tpot * factor * (self.tokens - 1)

    def rate(self, n: int) -> float:
        """Requests per second with n in flight, in steady state."""
        return min(n, self.slots) / self.service(n)

    def queue_wait(self, n: int) -> float:
        return max(0, n - self.slots) / self.rate(n)

    def best_rate(self) -> float:
        return max(self.rate(n) for n in range(1, (self.gate or 1024) + 1))


HEAD_S = 0.001  # a server's success or refusal status comes back this soon


@dataclass
class Run:
    elapsed: float
    sent: int
    failures: int
    ctl: ConcurrencyController


def drive(ctl: ConcurrencyController, shape: Shape, items: int, seed: int = 0) -> Run:
    rng = random.Random(seed)
    events: list[tuple[float, int, str, dict[str, float | int]]] = []
    order = itertools.count()
    now, in_flight, pending, sent, failures = 0.0, 0, items, 0, 0
    running: dict[int, dict[str, float | int]] = {}
    cancelled: set[int] = set()

    def send() -> None:
        nonlocal in_flight, pending, sent
        in_flight += 1
        pending -= 1
        sent += 1
        n = in_flight
        rid = next(order)
        req: dict[str, float | int] = {"n": n, "limit": ctl.limit, "at": now, "id": rid}
        if shape.one_at_a_time and running:
            victim = min(running)  # the oldest running answer is cut
            cancelled.add(victim)
            heapq.heappush(events, (now + 0.001, victim, "cut", running.pop(victim)))
        refused = shape.fault_kind == "refused" and rng.random() < shape.fault_rate
        if refused or (shape.gate is not None and n > shape.gate):
            heapq.heappush(events, (now + HEAD_S, rid, "refused", req))
            return
        heapq.heappush(events, (now + HEAD_S, rid, "accepted", req))
        if shape.fault_kind == "error" and rng.random() < shape.fault_rate:
            heapq.heappush(events, (now + shape.service(n) / 2, rid, "error", req))
            return
        wait = shape.queue_wait(n)
        ttft = wait + shape.prefill(n)
        running[rid] = req
        heapq.heappush(events, (now + ttft, rid, "first", req))
        heapq.heappush(events, (now + wait + shape.service(n), rid, "end", req))

    while pending or events:
        while pending and in_flight < ctl.admitted and now >= ctl.pause_until:
            send()
        if not events:
            now = max(now, ctl.pause_until)
            continue
        now, rid, kind, req = heapq.heappop(events)
        if rid in cancelled and kind in ("first", "end"):
            continue
        n, limit, at = int(req["n"]), int(req["limit"]), req["at"]
        if kind == "accepted":
            ctl.accepted(n)
            continue
        if kind == "first":
            ctl.first_token(now, ttft=now - at, sent_in_flight=n, sent_at_limit=limit)
            continue
        in_flight -= 1
        running.pop(rid, None)
        seen = dict(sent_in_flight=n, ended_in_flight=in_flight + 1, sent_at_limit=limit)
        if kind == "end":
            ttft = shape.queue_wait(n) + shape.prefill(n)
            ctl.finished(now, Observation(**seen, tokens=shape.tokens, latency=now - at, ttft=ttft))
        else:
            failures += 1
            pending += 1  # retried later
            retry = 1.0 if kind == "refused" else None
            ctl.finished(now, Observation(**seen, failure=kind, retry_after=retry))
    return Run(now, sent, failures, ctl)


def share_of_best(run: Run, shape: Shape, items: int) -> float:
    """The job's throughput as a share of the server's best steady throughput."""
    return items / run.elapsed / shape.best_rate()


@pytest.mark.parametrize("slots", [8, 24, 64, 256])
def test_ramps_fast_and_settles_at_the_knee(slots: int) -> None:
    shape = Shape(slots=slots)
    items = 40 * slots
    run = drive(ConcurrencyController(initial=2, maximum=1024), shape, items)
    # From the knee to about twice it: the curve learns only the levels it visits.
    assert slots * 0.9 <= run.ctl.limit <= slots * 2.25
    assert share_of_best(run, shape, items) >= 0.9  # ramp included
    reasons = [c.reason for _, c in run.ctl.history]
    assert reasons[0] == "ramp" and "knee" in reasons


def test_long_requests_do_not_slow_the_ramp() -> None:
    shape = Shape(slots=48, ttft=0.2, tpot=0.05, tokens=150)  # about 8-10 s an answer
    run = drive(ConcurrencyController(), shape, 500)
    assert share_of_best(run, shape, 500) >= 0.85  # the job is only ~12 rounds long
    ramp = [t for t, c in run.ctl.history if c.reason == "ramp"]
    assert ramp[-1] < 5.0  # the ramp ran on first tokens, not on whole answers


def test_ttft_that_grows_with_prefills_does_not_stop_the_ramp_below_the_throughput_knee() -> None:
    shape = Shape(slots=64, prefill_growth=0.1, tpot=0.02)
    run = drive(ConcurrencyController(), shape, 4000)
    assert share_of_best(run, shape, 4000) >= 0.85
    assert run.ctl.limit >= 32


def test_the_maximum_caps_the_ramp() -> None:
    run = drive(ConcurrencyController(maximum=16), Shape(slots=256), 600)
    assert run.ctl.limit == 16 and max(c.limit for _, c in run.ctl.history) == 16


def test_a_429_gate_becomes_a_ceiling_with_few_refusals() -> None:
    shape = Shape(slots=512, gate=100)
    run = drive(ConcurrencyController(), shape, 5000)
    assert run.ctl.ceiling is not None and 90 <= run.ctl.ceiling <= 100
    assert run.failures / run.sent < 0.01
    assert any(c.signal.startswith("failures") for _, c in run.ctl.history)


@pytest.mark.parametrize("gate", [24, 64])
def test_a_gate_met_while_ramping_refuses_a_few_not_a_burst(gate: int) -> None:
    # First tokens that come together would open many slots at once; only a few requests go
    # above the most the server has accepted, so the gate refuses those few.
    shape = Shape(slots=512, gate=gate, ttft=0.03, tpot=0.01, tokens=60)
    run = drive(ConcurrencyController(), shape, 500)
    assert 1 <= run.failures <= max(2, gate // 8) + 1
    assert run.ctl.ceiling is not None and gate - 2 <= run.ctl.ceiling <= gate


def test_the_frontier_follows_what_the_server_accepted() -> None:
    ctl = ConcurrencyController(initial=2)
    assert ctl.admitted == 2
    ctl.limit = 100  # (as a ramp would set it)
    assert ctl.admitted == 2  # nothing accepted yet
    ctl.accepted(2)
    assert ctl.admitted == 4
    ctl.accepted(64)
    assert ctl.admitted == 72  # an eighth above the most accepted
    ctl.accepted(96)
    assert ctl.admitted == 100  # the limit binds


def test_without_streaming_there_is_no_frontier() -> None:
    # A plain answer's success status comes with the answer: pacing growth by it would make
    # the ramp grow by a few per whole answer.
    ctl = ConcurrencyController(initial=2)
    ctl.limit = 64
    assert ctl.admitted == 2
    seen = Observation(sent_in_flight=2, ended_in_flight=2, sent_at_limit=2, tokens=10, latency=1.0)
    ctl.finished(1.0, seen)
    assert ctl.admitted == ctl.limit


def test_scattered_faults_do_not_pin_the_limit() -> None:
    shape = Shape(slots=64, fault_rate=0.10)
    run = drive(ConcurrencyController(), shape, 5000, seed=3)
    assert run.ctl.limit >= 48
    assert share_of_best(run, shape, 5000) >= 0.8  # a tenth of the requests are lost work


def test_a_server_that_takes_one_at_a_time_settles_at_one() -> None:
    shape = Shape(slots=1, one_at_a_time=True)
    run = drive(ConcurrencyController(), shape, 500)
    assert run.ctl.limit == 1 and run.ctl.ceiling == 1
    assert run.failures <= 12  # found out at the start, and a rare look past the ceiling


def test_not_streamed_answers_clock_the_ramp_and_the_curve_finds_the_knee() -> None:
    ctl = ConcurrencyController()
    now = 0.0
    for _ in range(1, 200):  # answers only, no first tokens; throughput flat past 16
        level = min(ctl.limit, 200)
        latency = 0.1 * max(1.0, level / 16)
        now += latency / level
        seen = Observation(
            sent_in_flight=level,
            ended_in_flight=level,
            sent_at_limit=ctl.limit,
            tokens=40,
            latency=latency,
        )
        ctl.finished(now, seen)
        if ctl.phase != "ramp":
            break
    # The knee is 16; the curve needs 8 answers per half-octave, so it settles within one
    # octave above (too many in flight costs latency, too few costs throughput: it errs high).
    assert ctl.phase == "steady" and 14 <= ctl.limit <= 36
    assert ctl.history[-1][1].signal == "throughput"


def test_the_servers_own_queue_steers_when_it_publishes_one() -> None:
    ctl = ConcurrencyController(initial=40)
    ctl.phase = "steady"
    change = ctl.server_load(1.0, ServerLoad(running=24, waiting=16), in_flight=40)
    assert change is None  # one read could be a passing burst
    change = ctl.server_load(1.5, ServerLoad(running=24, waiting=16), in_flight=40)
    assert change is not None and change.limit == 26 and change.signal == "server metrics"
    for t in (2.0, 2.5):  # no queue while our limit binds: room to grow
        change = ctl.server_load(t, ServerLoad(running=26, waiting=0), in_flight=26)
    assert change is not None and change.limit == 29 and change.reason == "room"
    full = ServerLoad(running=29, waiting=0, kv_usage=0.95)
    assert ctl.server_load(3.0, full, in_flight=29) is None
    assert ctl.server_load(3.5, full, in_flight=29) is None  # the KV cache is full: no room


def test_requests_not_yet_at_the_server_do_not_count_as_running_there() -> None:
    """A busy client: 76 in flight, but the server runs 8 and holds 50 waiting (18 are still in
    the client's pipes). Ours that run are at most the 8 the server runs, not 76 - 50."""
    ctl = ConcurrencyController(initial=76)
    change = ctl.server_load(1.0, ServerLoad(running=8, waiting=50), in_flight=76)
    assert change is not None and change.reason == "queue" and change.limit == 9  # 8, +1 leeway


def test_server_metrics_end_the_ramp_at_the_queue() -> None:
    ctl = ConcurrencyController(initial=30)
    change = ctl.server_load(1.0, ServerLoad(running=8, waiting=22), in_flight=30)
    assert change is not None and change.limit == 9 and ctl.phase == "steady"
    assert ctl.metrics  # from now on time to first token is no longer the queue signal


def answer(
    ctl: ConcurrencyController, now: float, level: int, rate: float, at: int
) -> Change | None:
    """An answer of 40 tokens sent and ended with `level` in flight under limit `at`, its
    latency such that Little's law reads `rate` tokens/s at that level."""
    latency = level * 40 / rate
    seen = Observation(
        sent_in_flight=level, ended_in_flight=level, sent_at_limit=at, tokens=40, latency=latency
    )
    return ctl.finished(now, seen)


def test_a_kept_probe_is_not_undone_by_levels_passed_on_the_way_up() -> None:
    """A probe from 24 to 30 bought 20%, judged on answers sent at 30. Answers sent while the
    limit was opening, at 26 in flight, read faster still (a transition, not a level): the next
    evaluation looks higher rather than moving down to them."""
    ctl = ConcurrencyController(initial=24)
    ctl.phase = "steady"
    now = 0.0
    while ctl.phase != "probe":
        now += 0.01
        answer(ctl, now, 24, 1000.0, 24)
    assert ctl.limit == 30
    while ctl.phase == "probe":
        now += 0.01
        answer(ctl, now, 30, 1200.0 + (now * 100) % 7, 30)  # a little noise, as answers have
    assert ctl.history[-1][1].reason == "probe kept"
    for _ in range(64):  # the transition's answers: into the curve, not this limit's period
        answer(ctl, now, 26, 1500.0, 24)
    changes: list[str] = []
    for _ in range(16):
        now += 0.01
        change = answer(ctl, now, 30, 1200.0, 30)
        if change is not None:
            changes.append(change.reason)
    assert changes and changes[0] == "probe" and ctl.limit > 30, changes


def test_slots_without_a_waiting_count_end_the_ramp_just_above_them() -> None:
    """llama-server's /slots: 8 slots, all busy, 30 of ours in flight: the 22 beyond the busy
    slots wait there. Settle at the slots plus one, and do not grow while every slot is busy."""
    ctl = ConcurrencyController(initial=30)
    busy = ServerLoad(running=8, waiting=None, slots=8)
    change = ctl.server_load(1.0, busy, in_flight=30)
    assert change is not None and change.reason == "queue" and change.limit == 9
    for t in (2.0, 2.5, 3.0):  # 9 in flight, 8 running: one waits, within the allowance
        assert ctl.server_load(t, busy, in_flight=9) is None
    assert ctl.limit == 9


def test_a_slots_page_of_one_server_behind_a_balancer_is_ignored() -> None:
    """Two 4-slot servers behind one URL: each read describes one of them. Twelve of ours
    stream at once, more than 4 slots can hold: the page is not the whole server, so it must
    not cut the limit to 5; first tokens and throughput steer instead."""
    ctl = ConcurrencyController(initial=16)
    ctl.phase = "steady"
    one = ServerLoad(running=4, waiting=None, slots=4)
    assert ctl.server_load(0.5, one, in_flight=16, streaming=12) is None  # once: maybe late
    change = ctl.server_load(1.0, one, in_flight=16, streaming=12)
    assert change is not None and change.reason == "slots ignored" and change.limit == 16
    assert not ctl.metrics
    for t in (1.5, 2.0, 2.5):
        assert ctl.server_load(t, one, in_flight=16, streaming=4) is None
    assert ctl.limit == 16 and not ctl.metrics


def test_answers_still_being_read_are_not_taken_for_a_balancer() -> None:
    ctl = ConcurrencyController(initial=16)
    busy = ServerLoad(running=8, waiting=None, slots=8)
    change = ctl.server_load(1.0, busy, in_flight=16, streaming=10)  # two ending, client-side
    assert change is not None and change.reason == "queue" and change.limit == 9
    ctl = ConcurrencyController(initial=16)  # a burst of late reads, once: not a balancer
    assert ctl.server_load(1.0, busy, in_flight=16, streaming=13) is not None
    assert ctl.server_load(1.5, busy, in_flight=9, streaming=8) is None
    assert not ctl.page.partial and ctl.limit == 9


def test_free_slots_are_room_to_grow() -> None:
    ctl = ConcurrencyController(initial=4)
    ctl.phase = "steady"
    half = ServerLoad(running=4, waiting=None, slots=8)
    ctl.server_load(1.0, half, in_flight=4)
    change = ctl.server_load(1.5, half, in_flight=4)
    assert change is not None and change.reason == "room" and change.limit == 5


def test_once_settled_answers_sent_under_an_old_limit_say_nothing_about_this_one() -> None:
    ctl = ConcurrencyController(initial=4)
    ctl.phase = "steady"  # (while ramping, what a lower level showed still counts)
    for i in range(20):
        seen = Observation(
            sent_in_flight=2, ended_in_flight=2, sent_at_limit=2, tokens=10, latency=0.1, ttft=0.05
        )
        assert ctl.finished(float(i), seen) is None
        assert ctl.first_token(float(i), ttft=5.0, sent_in_flight=2, sent_at_limit=2) is None
    assert ctl.limit == 4 and not ctl.history


def test_the_curve_reads_throughput_by_littles_law() -> None:
    curve = Curve()
    for _ in range(8):
        curve.add(4, tokens=40, latency=0.1)  # 4 in flight, 400 tok/s each: 1,600 tok/s
        curve.add(16, tokens=40, latency=0.4)  # four times the latency: no more throughput
    rates = dict(curve.known())
    assert rates[Curve.bucket(4)] == pytest.approx(1600)
    assert rates[Curve.bucket(16)] == pytest.approx(1600)
    assert curve.knee() == pytest.approx(4)


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError):
        ConcurrencyController(minimum=0)
    with pytest.raises(ValueError):
        ConcurrencyController(minimum=8, maximum=4)


@pytest.mark.parametrize(
    ("half_latency", "probe"), [(0.1, 25), (0.2, 40)], ids=["flat", "climbing"]
)
def test_the_bold_probe_after_a_first_token_knee_needs_a_climbing_curve(
    half_latency: float, probe: int
) -> None:
    # llama-server -np 8: the ramp overshoots to ~20 before first tokens say "queue"; 10 in
    # flight gave as much, so twice 20 would only queue (one run lost 15% for 4.5 s at 40).
    # Prefill contention: throughput still doubles from 10 to 20, so twice is worth a look.
    ctl = ConcurrencyController(initial=20, maximum=256)
    for _ in range(8):
        ctl.curve.add(10, tokens=40, latency=half_latency)
    ctl._settle(0.0, 20, "knee", "ttft")  # as a first-token knee at 20 does
    at_20 = Observation(
        sent_in_flight=20, ended_in_flight=20, sent_at_limit=20, tokens=40, latency=0.2, ttft=0.05
    )
    change = None
    for i in range(8):
        change = ctl.finished(1.0 + i, at_20) or change
    assert change is not None and (change.reason, change.limit) == ("probe", probe)
