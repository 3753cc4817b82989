"""What the concurrency controller learns from answers and failures, as small pure records.

Observation: what one request saw. Curve and Period: throughput against concurrency by Little's
law (a request that saw `n` in flight and took `latency` seconds for `tokens` tokens says the
server gives about `n * tokens / latency` tokens/s at `n`). QueueSignal: time to first token
against its unloaded value. failure_split: where failures begin, if they concentrate at high load.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

BASELINE_SAMPLES = 8  # first times to first token that set the unloaded value
QUEUE_FACTOR = 2.0  # time to first token above 2x unloaded (plus jitter): queued
JITTER_S = 0.010  # the client's own scheduling jitter on a busy machine, not a server queue
QUEUE_RECENT = 6  # the knee: at least half of the last 6 first tokens queued
MIN_SAMPLES = 8  # answers per concurrency level before the curve speaks for it
BUCKET_KEEP = 64  # recent answers kept per level
KNEE_SHARE = 0.97  # the knee: the lowest level giving 97% of the best throughput measured
MIN_FAILURES = 3  # ... and at least this many of them


@dataclass(frozen=True, slots=True)
class Observation:
    """What one request showed. Concurrency levels count the request itself."""

    sent_in_flight: int  # requests in flight when it was sent
    ended_in_flight: int  # and when it ended
    sent_at_limit: int
    tokens: int = 0
    latency: float = 0.0
    ttft: float | None = None
    failure: str | None = None  # None: a whole answer; else refused|timeout|cut|reset|error
    retry_after: float | None = None

    @property
    def level(self) -> float:
        return (self.sent_in_flight + self.ended_in_flight) / 2

    @property
    def blamed(self) -> int:
        """The load a failure is laid at: what it was sent into, or for a failure that can
        come from load arriving later (a cut answer, a timeout), the most it saw."""
        if self.failure in ("cut", "timeout"):
            return max(self.sent_in_flight, self.ended_in_flight)
        return self.sent_in_flight


class Curve:
    """Throughput against concurrency, from answers (Little's law), in half-octave levels."""

    def __init__(self) -> None:
        self._buckets: dict[int, deque[tuple[float, int, float]]] = {}

    @staticmethod
    def bucket(level: float) -> int:
        return round(2 * math.log2(max(1.0, level)))

    def add(self, level: float, tokens: int, latency: float) -> None:
        if latency <= 0:
            return
        key = self.bucket(level)
        samples = self._buckets.setdefault(key, deque(maxlen=BUCKET_KEEP))
        samples.append((level, tokens, latency))

    def rate(self, key: int) -> float | None:
        """Tokens/s the server gives at this level, or None on too few answers."""
        samples = self._buckets.get(key)
        if samples is None or len(samples) < MIN_SAMPLES:
            return None
        level = sum(s[0] for s in samples) / len(samples)
        latency = sum(s[2] for s in samples)
        return level * sum(s[1] for s in samples) / latency

    def level(self, key: int) -> float:
        samples = self._buckets[key]
        return sum(s[0] for s in samples) / len(samples)

    def known(self) -> list[tuple[int, float]]:
        """(level key, tokens/s) for every level with enough answers, lowest first."""
        rates = ((key, self.rate(key)) for key in sorted(self._buckets))
        return [(key, rate) for key, rate in rates if rate is not None]

    def flat_below(self, level: float, gain: float) -> bool:
        """Whether half `level` gave as much as `level` (within `gain`): then the server's
        batch is full there, and twice as high would only queue."""
        known = dict(self.known())
        here, half = known.get(self.bucket(level)), known.get(self.bucket(level) - 2)
        return here is not None and half is not None and here < gain * half

    def knee(self) -> float | None:
        """The lowest level within a few percent of the best measured throughput (too much
        concurrency costs only latency, too little costs throughput: err high)."""
        known = self.known()
        if not known:
            return None
        best = max(rate for _, rate in known)
        return next(self.level(key) for key, rate in known if rate >= KNEE_SHARE * best)


class Period:
    """Answers to requests sent at one limit, since it was set: that limit's throughput, as
    the mean of each answer's own estimate (`n * tokens / latency`), with its standard error."""

    def __init__(self) -> None:
        self.rates: list[float] = []

    def add(self, seen: Observation) -> None:
        if seen.latency > 0:
            self.rates.append(seen.level * seen.tokens / seen.latency)

    def rate(self) -> float | None:
        return statistics.fmean(self.rates) if len(self.rates) >= MIN_SAMPLES else None

    def error(self) -> float:
        """The standard error of rate(): how far chance alone moves it."""
        n = len(self.rates)
        return statistics.stdev(self.rates) / math.sqrt(n) if n >= 2 else math.inf


class QueueSignal:
    """Time to first token against its unloaded value: is the server queueing our requests?"""

    def __init__(self) -> None:
        self.baseline: float | None = None
        self._first: list[float] = []
        self._recent: deque[bool] = deque(maxlen=QUEUE_RECENT)  # queued?

    def add(self, ttft: float) -> None:
        if self.baseline is None:
            self._first.append(ttft)
            if len(self._first) >= BASELINE_SAMPLES:
                self.baseline = statistics.median(self._first)
            return
        self._recent.append(ttft > QUEUE_FACTOR * self.baseline + JITTER_S)

    def queued(self) -> bool:
        return len(self._recent) == QUEUE_RECENT and sum(self._recent) >= 3

    def clear(self) -> None:
        self._recent.clear()


def failure_split(recent: Iterable[tuple[int, bool]]) -> tuple[int, int] | None:
    """Given (level, failed) of recent requests: the concurrency that best splits them into
    answered (at or below it) and failed (above it), a failure weighing twice an answer, and
    the lowest failed level above it; None when no line does better than "failures are
    scattered" (or fewer than MIN_FAILURES lie above it)."""
    outcomes = sorted(recent)
    total_failed = sum(failed for _, failed in outcomes)
    if total_failed < MIN_FAILURES:
        return None
    total_answered = len(outcomes) - total_failed
    best_cost, best = 2 * total_failed, None  # the line above everything: no ceiling
    failed_below = answered_below = 0
    for i, (level, failed) in enumerate(outcomes):
        failed_below += failed
        answered_below += not failed
        if i + 1 < len(outcomes) and outcomes[i + 1][0] == level:
            continue  # split only between levels
        above_failed = total_failed - failed_below
        cost = 2 * failed_below + (total_answered - answered_below)
        if above_failed >= MIN_FAILURES and cost < best_cost:
            best_cost, best = cost, level
    if best is None:
        return None
    return best, min(level for level, failed in outcomes if failed and level > best)


WAVE_S = 1.0  # refusals of most requests within a second, at any load: a spent budget
WAVE_SHARE = 0.5


def refusal_wave(times: Iterable[tuple[float, bool]], now: float) -> bool:
    """Given (time, refused?) of recent requests: most of the last second's refused, whatever
    the load (a hosted API's requests per minute spent, say)."""
    recent = [refused for at, refused in times if at >= now - WAVE_S]
    refused = sum(recent)
    return refused >= MIN_FAILURES and refused >= WAVE_SHARE * len(recent)


RECENT_OUTCOMES = 256


class Outcomes:
    """How recent requests ended, by the concurrency they were sent into: what failures are
    weighed against. A refusal is weighed against the statuses of requests the server took
    (`heads`: they come as soon, long before the answers), other failures against whole
    answers (a cut or a timeout comes late too); where statuses are not told apart from
    answers (not streamed), against answers."""

    def __init__(self) -> None:
        self.answers: deque[tuple[int, bool]] = deque(maxlen=RECENT_OUTCOMES)  # failed?
        self.heads: deque[tuple[int, bool]] = deque(maxlen=RECENT_OUTCOMES)  # refused?
        self.times: deque[tuple[float, bool]] = deque(maxlen=RECENT_OUTCOMES)  # refused?

    def weighed(self, failure: str | None, *, heads: bool) -> deque[tuple[int, bool]]:
        return self.heads if failure == "refused" and heads and self.heads else self.answers

    def concentrated(self, level: int, failure: str | None, *, heads: bool) -> bool:
        """Failures are a line at `level` only if they are common there: more than one in
        three of the recent requests sent with that many in flight or more (the share where
        failure_split draws a line), and more than twice their share below it."""
        recent = self.weighed(failure, heads=heads)
        above = [failed for sent, failed in recent if sent >= level]
        below = [failed for sent, failed in recent if sent < level]
        share = sum(above) / len(above) if above else 0.0
        background = sum(below) / len(below) if below else 0.0
        return share > 1 / 3 and share > 2 * background
