"""The adaptive concurrency controller: how many requests to keep in flight, decided on evidence.

What a serving engineer concludes from a server, done continuously:

- **Ramp.** Like TCP's slow start, clocked by answers: each request sent while the window was
  (nearly) full that gets its first token unqueued opens two more slots (its own slot stays
  busy while the answer streams, so two new requests double what is sent per round trip), and a
  round trip here is a time to first token, not a whole answer: long answers do not slow the
  ramp. Without streaming, an answer frees its slot and opens one more.
- **Knee.** The ramp stops at the first sign of a queue at the server: its own metrics (requests
  waiting: it settles where the queue began), or time to first token well above the unloaded
  value for most recent requests (it settles where it is: that may be a queue, or prefill
  contention while throughput still grows, and throughput decides which). Throughput is read
  from the curve of throughput against concurrency (evidence.py), built from every answer with
  Little's law, each level judged on many answers, never on one burst of completions.
- **Steady.** Now and then the limit probes higher (boldly right after a first-token knee, and
  only while the curve shows half the level giving clearly less); a probe is kept when it
  bought 5% more throughput and more than chance explains, and kept probes grow bolder. When
  the curve says a level elsewhere gives clearly more, the limit moves there; while requests
  queue and a lower level gives as much, it moves down to it.
- **Frontier.** However the limit grows, only a few requests at a time go above the most the
  server has yet accepted (a success status, long before any token; streamed answers only):
  a server that refuses past a line it draws (a gateway's cap, a 429 gate) refuses those few,
  not the whole burst a doubling would have sent before the first refusal came back.
- **Failures** are capacity evidence only where they are common (evidence.Outcomes: a
  refusal weighed against the statuses that come as soon, other failures against answers).
  While ramping, a refusal, cut answer or timeout at a new height steps back below it at once,
  and a second at about the same height makes a ceiling if they are common there. Later, the
  level where failures begin to concentrate (evidence.failure_split) becomes a ceiling, looked
  past now and then by binary search (with the server's own counts too). Scattered faults
  change nothing, so a background error rate cannot pin the limit. A server that cuts a
  running answer when another arrives shows exactly that pattern at 2 and settles at 1.

Nothing here does I/O or reads a clock: callers pass `now` and what they observed, so every
decision is unit-testable with synthetic observation streams.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from batchrun.evidence import (
    MIN_SAMPLES,
    Curve,
    Observation,
    Outcomes,
    Period,
    QueueSignal,
    failure_split,
    refusal_wave,
)
from batchrun.server_metrics import PagePart, ServerLoad

STEADY = 0.95  # a request sent with this share of the limit in flight shows the limit's load
FULL_WINDOW = 0.75  # a request sent with this share of the limit in flight: the limit was binding
KNEE_BELOW = 0.8  # queueing, and the curve's knee this far below: move down to it
GAIN = 1.10  # twice the concurrency must buy 10% more throughput to be worth it
PROBE_GAIN = 1.05  # a probe is kept when it buys 5% more
NOISE_MARGIN = 1.5  # ... and the gain is over 1.5 standard errors of the difference
PROBE_EVERY = 4  # steady evaluations between probes
MAX_PROBE_STEP = 4.0  # kept probes double the next one's step, up to this factor
LOAD_FAILURES = ("refused", "cut", "timeout")  # kinds that more load brings on
PAST_CEILING_S = 15.0  # a ceiling stands this long before a look past it (then twice as long)
REPORT_STEP = 1.25  # a ramp is reported each time the limit grows by a quarter
FRONTIER = 2  # requests in flight above the most the server has accepted: at least this many
FRONTIER_SHARE = 8  # ... or an eighth of that most


@dataclass(frozen=True)
class Change:
    limit: int
    reason: str  # ramp | knee | probe | probe kept | probe reverted | move | ceiling | ...
    signal: str = ""  # the evidence: ttft | throughput | failures | server metrics


class ConcurrencyController:
    def __init__(self, *, initial: int = 2, minimum: int = 1, maximum: int = 256) -> None:
        if not 1 <= minimum <= maximum:
            raise ValueError("need 1 <= minimum <= maximum")
        self.minimum = minimum
        self.maximum = maximum
        self.limit = max(minimum, min(initial, maximum))
        self.phase = "ramp"  # ramp | steady | probe
        self.ceiling: int | None = None  # the most that failures said the server takes
        self.pause_until = 0.0
        self.history: list[tuple[float, Change]] = []
        self.curve = Curve()
        self._queue = QueueSignal()
        self._seen = Outcomes()
        self._reported = self.limit
        self._since_change = 0  # answers to requests sent at the current limit
        self._period = Period()  # ... and what they showed; then the limit before
        self._before = Period()
        self._evaluations = 0  # steady evaluations since the last probe
        self._probe_from = self.limit
        self._probe_step = 1.25
        self._kept = False  # the last probe was kept (by throughput) and nothing judged since
        self._past_ceiling_wait = PAST_CEILING_S  # seconds before a look past the ceiling
        self._ceiling_since = 0.0
        self._fail_level: int | None = None  # the lowest level where failures concentrated
        self._ramp_failures: list[int] = []  # levels of load-bound failures while ramping
        self._waiting_reads = 0  # consecutive server-metrics reads with a queue
        self._roomy_reads = 0  # ... with no queue while our limit was binding
        self.metrics = False  # the server's own metrics are the queue signal
        self.page = PagePart()  # whether the load page speaks for the whole server
        self.accepted_most = 0  # the most requests in flight that the server has accepted
        self.frontier = True  # pace growth by acceptances (streamed answers only)

    @property
    def admitted(self) -> int:
        """How many may be in flight now: the limit, but never more than a few above the most
        the server has accepted, so a line it draws refuses a few requests, not a burst."""
        if not self.frontier:
            return self.limit
        seen = self.accepted_most
        return min(self.limit, seen + max(FRONTIER, seen // FRONTIER_SHARE))

    # --- feeding it ---------------------------------------------------------------------------

    def accepted(self, sent_in_flight: int) -> None:
        """The server took a request sent with `sent_in_flight` in flight (its own included):
        its success status, which comes as soon as a refusal would have."""
        self._seen.heads.append((sent_in_flight, False))
        self._took(sent_in_flight)

    def _took(self, sent_in_flight: int) -> None:
        self.accepted_most = max(self.accepted_most, sent_in_flight)

    def first_token(
        self, now: float, *, ttft: float, sent_in_flight: int, sent_at_limit: int
    ) -> Change | None:
        """A streamed answer began: the earliest evidence, long before it is whole.

        While ramping, a request sent under a lower limit still says whether that level
        queued; once settled, only requests sent at the current limit speak for it."""
        self._seen.answers.append((sent_in_flight, False))  # not refused, not cut before it began
        self._took(sent_in_flight)  # (a backend may not say so apart)
        if self.phase != "ramp" and sent_at_limit != self.limit:
            return None
        if not self.metrics:
            self._queue.add(ttft)
        if self.phase != "ramp":
            return None
        if not self.metrics and self._queue.queued():
            # Settle where it is: a rising time to first token may be a queue (then the curve
            # soon says a lower level gives as much) or prefill contention while throughput
            # still grows (then probes pay). Throughput decides either way.
            return self._settle(now, self.limit, "knee", "ttft")
        return self._grow(now, sent_in_flight, sent_at_limit, 2)

    def finished(self, now: float, seen: Observation) -> Change | None:
        """A request ended: a whole answer, or a failure of the kind named."""
        # An answer vouches for the load it was sent into; a failure may have come from load
        # that arrived later (a server that cuts the running answer for a new one).
        # (A streamed answer was counted at its first token.)
        failed = seen.failure is not None
        self._seen.times.append((now, seen.failure == "refused"))
        if seen.failure == "refused":
            self._seen.heads.append((seen.blamed, True))
        if failed or seen.ttft is None:
            self._seen.answers.append((seen.blamed, failed))
        if seen.failure is not None:
            return self._failed(now, seen)
        if seen.ttft is None:
            # Not streamed: the success status comes with the whole answer, far too late to
            # pace growth by (answers clock the ramp instead); no frontier.
            self.frontier = False
        self._took(seen.sent_in_flight)
        self.curve.add(seen.level, seen.tokens, seen.latency)
        if self.phase == "ramp":
            if seen.ttft is None:  # not streamed: answers are the only clock
                change = self._grow(now, seen.sent_in_flight, seen.sent_at_limit, 1)
                return change or self._plateau(now)
            return self._plateau(now)
        if seen.sent_at_limit != self.limit or seen.sent_in_flight < STEADY * self.limit:
            return None  # not this limit's evidence yet: the queue it brings is still building
        self._period.add(seen)
        self._since_change += 1
        if self.metrics and self.phase == "steady":
            return None  # the server's own counts steer (server_load); no need to probe
        if self._since_change >= max(MIN_SAMPLES, self.limit // 4):
            self._since_change = 0
            return self._evaluate(now)
        return None

    def server_load(
        self, now: float, load: ServerLoad, *, in_flight: int, streaming: int = 0
    ) -> Change | None:
        """The server's own running/waiting counts: keep its batch full, its queue near 0.
        `streaming`: ours whose answers are coming in now (a page of one server of several
        behind a balancer, PagePart, is ignored from then on)."""
        if self.page.partial:
            return None
        if self.page.read(load, streaming):
            self.metrics = False  # first tokens and throughput steer again
            ignored = "slots ignored" if load.slots_page else "metrics ignored"
            return self._record(now, Change(self.limit, ignored, "server metrics"))
        self.metrics = True
        waiting = load.waiting_with(in_flight)
        allowance = max(1.0, 0.05 * load.running)
        if waiting > allowance:
            self._roomy_reads = 0
            self._waiting_reads += 1
            if self.phase == "ramp" or self._waiting_reads >= 2:
                # Ours that run: in flight less those waiting, and never more than the server
                # runs (on a busy client some of "in flight" have not reached it yet).
                ours = in_flight - waiting
                target = math.ceil(min(ours, load.running or ours) + allowance)
                if target < self.limit:
                    return self._settle(now, target, "queue", "server metrics")
            return None
        self._waiting_reads = 0
        full = load.kv_usage is not None and load.kv_usage >= 0.9
        full = full or (load.slots is not None and load.running >= load.slots)
        binding = in_flight >= FULL_WINDOW * self.limit
        # Our requests are at the server, not answered and still being read by a busy client
        # (then more in flight would only wait in the client).
        arrived = load.running + waiting >= FULL_WINDOW * in_flight
        self._roomy_reads = self._roomy_reads + 1 if binding and arrived and not full else 0
        if self.phase == "steady" and self._roomy_reads >= 2:
            self._roomy_reads = 0
            if self.ceiling is not None and self.limit >= self._cap():
                return self._look_past(now, "server metrics")  # failures drew it: they judge
            grown = min(self._cap(), self.limit + max(1, self.limit // 8))
            return self._set(now, grown, "room", "server metrics")
        return None

    def server_quiet(self) -> None:
        """The server's counts stopped coming: first tokens and throughput steer meanwhile."""
        self.metrics, self._waiting_reads, self._roomy_reads = False, 0, 0
        self.page.quiet()

    # --- deciding -----------------------------------------------------------------------------

    def _cap(self) -> int:
        return min(self.maximum, self.ceiling) if self.ceiling is not None else self.maximum

    def _grow(
        self, now: float, sent_in_flight: int, sent_at_limit: int, step: int
    ) -> Change | None:
        if sent_in_flight < FULL_WINDOW * sent_at_limit or self.limit >= self._cap():
            return None  # the limit was not what held requests back: no evidence for more
        self.limit = min(self._cap(), self.limit + step)
        if self.limit >= self._reported * REPORT_STEP or self.limit >= self._cap():
            return self._record(now, Change(self.limit, "ramp", "ttft"))
        return None

    def _plateau(self, now: float) -> Change | None:
        """During the ramp: stop once doubling the concurrency no longer buys throughput."""
        known = dict(self.curve.known())
        keys = [key for key in known if key <= Curve.bucket(self.limit)]
        if not keys:
            return None
        top = max(keys)
        lower = known.get(top - 2)
        if lower is None or known[top] >= GAIN * lower:
            return None
        knee = self.curve.knee()
        return self._settle(now, math.ceil(knee), "knee", "throughput") if knee else None

    def _settle(self, now: float, limit: int, reason: str, signal: str) -> Change:
        self.phase = "steady"
        # Check the curve above the knee at once, boldly: time to first token may rise with
        # load (prefill contention) while throughput still grows.
        self._evaluations = PROBE_EVERY - 1
        self._probe_step = 2.0
        self._queue.clear()
        return self._set(now, limit, reason, signal) or self._record(
            now, Change(limit, reason, signal)
        )

    def _evaluate(self, now: float) -> Change | None:
        """A steady period's worth of answers at this limit: judge a probe, move, or probe."""
        if self.phase == "probe":
            return self._judge_probe(now, self._period.rate())
        # Right after a probe was kept, its judged period outranks curve levels filled while
        # the limit was opening towards it: look higher first, lower only later.
        kept, self._kept = self._kept, False
        target = self._better_level()
        if target is not None and not (kept and target < self.limit):
            return self._set(now, target, "move", "throughput")
        self._evaluations += 1
        if self._evaluations >= PROBE_EVERY:
            return self._probe(now)
        return None

    def _better_level(self) -> int | None:
        """A level the curve says gives clearly more than this one, or, while requests queue
        here, a lower one that gives as much (no need to queue them)."""
        current = self.curve.rate(Curve.bucket(self.limit))
        best = max(self.curve.known(), key=lambda kr: kr[1], default=None)
        if current is not None and best is not None and best[1] > GAIN * current:
            target = math.ceil(self.curve.level(best[0]))
            if target != self.limit and target <= self._cap():
                return target
        knee = self.curve.knee()
        if knee is not None and knee < KNEE_BELOW * self.limit and self._queue.queued():
            return math.ceil(knee)
        return None

    def _probe(self, now: float) -> Change | None:
        step = self._probe_step
        if step > 1.25 and self.curve.flat_below(self.limit, GAIN):
            step = 1.25  # bold only while the curve still climbs: past a knee it costs a queue
        target = min(self.maximum, max(self.limit + 1, math.ceil(self.limit * step)))
        if self.ceiling is not None and target > self.ceiling:
            return self._look_past(now, "throughput")
        return self._probe_to(now, target, "throughput")

    def _look_past(self, now: float, signal: str) -> Change | None:
        """A probe past the ceiling, when one is due (_past_ceiling); judged by failures."""
        past = self._past_ceiling(now)
        return None if past is None else self._probe_to(now, min(self.maximum, past), signal)

    def _probe_to(self, now: float, target: int, signal: str) -> Change | None:
        self._evaluations = 0
        if target <= self.limit:
            return None
        self._probe_from, self.phase = self.limit, "probe"
        return self._set(now, target, "probe", signal)

    def _past_ceiling(self, now: float) -> int | None:
        """Where to look past the ceiling: halfway to where failures began (a binary search
        for the server's line), or one step past it, less and less often, once the two meet:
        servers change."""
        assert self.ceiling is not None
        if self.limit < self.ceiling:
            return self.ceiling
        gap = (self._fail_level or self.ceiling + 1) - self.ceiling
        if gap <= 1 and now < self._ceiling_since + self._past_ceiling_wait:
            return None
        return self.ceiling + max(1, gap // 2)

    def _judge_probe(self, now: float, rate: float | None) -> Change | None:
        self.phase = "steady"
        if self.ceiling is not None and self.limit > self.ceiling:
            # Failures set the ceiling, so failures judge a look past it: none came.
            self.ceiling = self.limit
            if self._fail_level is not None and self.limit >= self._fail_level:
                self.ceiling = self._fail_level = None  # past where they began: it has room
            self._past_ceiling_wait = PAST_CEILING_S
            self._evaluations = PROBE_EVERY - 1
            return self._record(now, Change(self.limit, "probe kept", "failures (none)"))
        before = self._before.rate()
        if rate is not None and (before is None or self._beats(rate, before)):
            self._evaluations = PROBE_EVERY - 1  # kept: look higher soon, and bolder
            self._probe_step = min(MAX_PROBE_STEP, self._probe_step * 2)
            self._kept = True
            return self._record(now, Change(self.limit, "probe kept", "throughput"))
        self._probe_step = 1.25
        return self._set(now, self._probe_from, "probe reverted", "throughput")

    def _beats(self, rate: float, before: float) -> bool:  # 5% more, and more than chance
        noise = math.hypot(self._period.error(), self._before.error())
        return rate >= PROBE_GAIN * before and rate - before > NOISE_MARGIN * noise

    def _failed(self, now: float, seen: Observation) -> Change | None:
        """Capacity evidence only when failures concentrate at high concurrency."""
        if seen.failure == "refused" and refusal_wave(self._seen.times, now):
            # A spent budget: everyone waits, not each one alone.
            self.pause_until = max(self.pause_until, now + (seen.retry_after or 1.0))
        load_bound = seen.failure in LOAD_FAILURES
        if load_bound and self.phase == "ramp":
            return self._ramp_failure(now, seen)
        fail_level = self._fail_level
        if load_bound and self.phase == "probe" and fail_level and seen.blamed >= fail_level:
            common = self._seen.concentrated(fail_level, seen.failure, heads=self.frontier)
            return self._ceiling_at(now, fail_level, seen) if common else None  # else: scattered
        split = failure_split(self._seen.weighed(seen.failure, heads=self.frontier))
        if split is None or split[1] > seen.blamed:
            return None  # scattered, or this failure came from below the line: bad luck
        return self._ceiling_at(now, split[1], seen)

    def _ramp_failure(self, now: float, seen: Observation) -> Change | None:
        """While ramping, a refusal (or cut, or timeout) at a new height: step back below it at
        once, so few more requests meet the same fate, and ramp on. A second one at about the
        same height is a line the server draws: a ceiling."""
        level = seen.blamed
        twice = [f for f in self._ramp_failures if abs(f - level) <= max(1, level // 10)]
        self._ramp_failures.append(level)
        if twice:  # a line, if they are common there; scattered (a busy hosted API) if not
            line = min(level, *twice)
            common = self._seen.concentrated(line, seen.failure, heads=self.frontier)
            return self._ceiling_at(now, line, seen) if common else None
        if seen.failure == "refused" and self.frontier and level <= self.accepted_most:
            return None  # not a new height: the server took as many in flight before
        return self._set(now, min(self.limit, level - 1), "step back", f"failures ({seen.failure})")

    def _ceiling_at(self, now: float, fail_level: int, seen: Observation) -> Change | None:
        """Failures begin at `fail_level`: stay below it (nothing in between says less)."""
        self._fail_level = fail_level
        ceiling = max(self.minimum, fail_level - 1)
        self.ceiling = ceiling if self.ceiling is None else min(self.ceiling, ceiling)
        if self.phase == "steady" and self.limit <= self.ceiling:
            return None
        if self.phase == "probe" and self._probe_from >= self.ceiling:
            self._past_ceiling_wait *= 2  # it held: look past it less and less often
        self._ceiling_since = now
        self.phase, self._kept = "steady", False
        self._evaluations = 0
        self._probe_step = 1.25
        limit = min(self.limit, self.ceiling)
        change = self._set(now, limit, "ceiling", f"failures ({seen.failure})")
        return change or self._record(now, Change(limit, "ceiling", f"failures ({seen.failure})"))

    def _set(self, now: float, limit: int, reason: str, signal: str) -> Change | None:
        limit = max(self.minimum, min(self.maximum, limit))
        if limit == self.limit:
            return None
        self.limit = limit
        self._since_change = 0
        self._kept = False  # a kept probe's standing ends when the limit moves
        self._before, self._period = self._period, Period()
        return self._record(now, Change(limit, reason, signal))

    def _record(self, now: float, change: Change) -> Change:
        self._reported = change.limit
        self.history.append((now, change))
        return change
