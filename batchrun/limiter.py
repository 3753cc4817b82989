"""Adaptive concurrency and client-side rate limits, as pure objects fed with observations.

The controller does what a serving engineer does by hand: start low, double the number of
requests in flight while output throughput keeps growing and time to first token (the server's
queueing signal) stays near its unloaded value, and settle at the knee, the last limit that still
bought throughput. Overload signals (429, 503, timeouts) cut the limit multiplicatively and pause
until the server's Retry-After. Now and then it probes a little higher, since servers change load.

Nothing here does I/O or reads a clock: callers pass `now`, so every decision is unit-testable
with synthetic observation streams.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from batchrun.backends.base import RateInfo
from batchrun.errors import Overloaded, RateLimited, RequestError, RequestTimeout
from batchrun.inputs import estimate_tokens, prompt_chars

RAMP_GROWTH = 1.10  # a window must beat the best throughput by 10% to keep ramping
PROBE_GROWTH = 1.05  # a probe is kept if it buys 5% more throughput
LATENCY_KNEE = 2.0  # p50 TTFT above 2x the unloaded value: requests are queueing
LATENCY_EASE = 1.5  # above 1.5x while ramping: the knee is near, grow by 25% instead of 2x
LATENCY_BACKOFF = 3.0  # p50 TTFT above 3x the unloaded value in steady state: back off
OVERLOAD_CUT = 0.5
LATENCY_CUT = 0.8
PROBE_STEP = 1.25
PROBE_EVERY = 8  # steady windows between probes


@dataclass
class _Window:
    started: float | None = None  # the first completion it counts
    tokens: int = 0
    done: int = 0
    ttfts: list[float] = field(default_factory=list)
    overloads: int = 0
    retry_after: float = 0.0

    def p50_ttft(self) -> float | None:
        if not self.ttfts:
            return None
        ordered = sorted(self.ttfts)
        return ordered[len(ordered) // 2]


@dataclass(frozen=True)
class Change:
    limit: int
    reason: str  # ramp | knee | probe | probe kept | probe reverted | latency | back-off


class ConcurrencyController:
    def __init__(self, *, initial: int = 2, minimum: int = 1, maximum: int = 256) -> None:
        if not 1 <= minimum <= maximum:
            raise ValueError("need 1 <= minimum <= maximum")
        self.minimum = minimum
        self.maximum = maximum
        self.limit = max(minimum, min(initial, maximum))
        self.phase = "ramp"
        self.pause_until = 0.0
        self.unloaded_ttft: float | None = None
        self.history: list[tuple[float, Change]] = []
        self._best = (0.0, self.limit)  # (tokens/s, limit) of the best window so far
        self._window: _Window | None = None
        self._steady_windows = 0
        self._steady_tps = 0.0
        self._before_probe = self.limit
        self._settling = False  # the first window after a change only lets the queue settle
        self._slow_windows = 0  # consecutive steady windows over the latency back-off line

    # --- feeding it ---------------------------------------------------------------------------

    def completed(
        self, now: float, *, tokens: int, ttft: float | None, sent_at_limit: int | None = None
    ) -> Change | None:
        """A request finished: its output tokens and time to first token. Requests sent under
        an earlier limit say nothing about this one and are left out."""
        if sent_at_limit is not None and sent_at_limit != self.limit:
            return None
        window = self._open()
        if window.started is None:
            window.started = now  # rates are measured from the first completion on
        else:
            window.tokens += tokens
        window.done += 1
        if ttft is not None:
            window.ttfts.append(ttft)
        return self._maybe_close(now)

    def overloaded(
        self, now: float, *, retry_after: float | None = None, sent_at_limit: int | None = None
    ) -> Change | None:
        """A 429, 503 or timeout: the server has too much. Cut at once, pause if asked to.

        One cut per episode: refusals of requests sent before the last cut are the same
        overload seen again (a burst of 429s is one signal, not thirty halvings)."""
        if retry_after:
            self.pause_until = max(self.pause_until, now + retry_after)
        if sent_at_limit is not None and sent_at_limit != self.limit:
            return None
        self._open().overloads += 1
        new = max(self.minimum, math.floor(self.limit * OVERLOAD_CUT))
        self.phase = "steady"
        self._steady_windows = 0
        self._window = None  # judge the new limit on fresh evidence
        return self._set(now, new, "back-off")

    # --- deciding -----------------------------------------------------------------------------

    def _open(self) -> _Window:
        if self._window is None:
            self._window = _Window()
        return self._window

    def _maybe_close(self, now: float) -> Change | None:
        window = self._window
        assert window is not None and window.started is not None
        if window.done < max(8, self.limit) or now <= window.started:
            return None
        self._window = None
        if self._settling:  # requests sent under this limit still queued behind older ones
            self._settling = False
            return None
        tps = window.tokens / (now - window.started)
        p50 = window.p50_ttft()
        if p50 is not None and (self.unloaded_ttft is None or p50 < self.unloaded_ttft):
            self.unloaded_ttft = p50
        ratio = p50 / self.unloaded_ttft if p50 is not None and self.unloaded_ttft else 1.0
        if self.phase == "ramp":
            return self._ramp(now, tps, ratio)
        return self._steady(now, tps, p50)

    def _ramp(self, now: float, tps: float, ttft_ratio: float) -> Change | None:
        best_tps, best_limit = self._best
        if tps >= best_tps * RAMP_GROWTH and ttft_ratio <= LATENCY_KNEE:
            self._best = (tps, self.limit)
            if self.limit >= self.maximum:
                self.phase = "steady"
                return None
            step = 2.0 if ttft_ratio <= LATENCY_EASE else PROBE_STEP
            return self._set(now, min(self.maximum, math.ceil(self.limit * step)), "ramp")
        self.phase = "steady"
        self._steady_tps = max(tps, best_tps)
        return self._set(now, best_limit, "knee")

    def _steady(self, now: float, tps: float, p50: float | None) -> Change | None:
        unloaded = self.unloaded_ttft
        if self.phase == "probe":
            self.phase = "steady"
            self._steady_windows = 0
            if tps >= self._steady_tps * PROBE_GROWTH and not (
                p50 is not None and unloaded is not None and p50 > LATENCY_KNEE * unloaded
            ):
                self._steady_tps = tps
                return self._set(now, self.limit, "probe kept")
            return self._set(now, self._before_probe, "probe reverted")
        self._steady_tps = 0.7 * self._steady_tps + 0.3 * tps if self._steady_tps else tps
        slow = p50 is not None and unloaded is not None and p50 > LATENCY_BACKOFF * unloaded
        self._slow_windows = self._slow_windows + 1 if slow else 0
        if self._slow_windows >= 2:  # twice in a row: not a passing burst
            self._slow_windows = 0
            new = max(self.minimum, math.floor(self.limit * LATENCY_CUT))
            return self._set(now, new, "latency")
        self._steady_windows += 1
        if self._steady_windows >= PROBE_EVERY and self.limit < self.maximum:
            self._before_probe = self.limit
            self.phase = "probe"
            return self._set(now, min(self.maximum, math.ceil(self.limit * PROBE_STEP)), "probe")
        return None

    def _set(self, now: float, limit: int, reason: str) -> Change | None:
        if limit == self.limit and reason not in ("probe kept",):
            return None
        self.limit = limit
        self._window = None
        self._settling = True
        change = Change(limit, reason)
        self.history.append((now, change))
        return change


class TokenBucket:
    """Client-side pacing for requests or tokens per minute: `take` says how long to wait."""

    def __init__(self, per_minute: float, *, burst: float | None = None) -> None:
        if per_minute <= 0:
            raise ValueError("per_minute must be positive")
        self.rate = per_minute / 60.0
        self.capacity = burst if burst is not None else per_minute / 60.0 * 5  # 5 s of burst
        self.level = self.capacity
        self.updated: float | None = None

    def _refill(self, now: float) -> None:
        if self.updated is not None:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now

    def take(self, now: float, amount: float = 1.0) -> float:
        """Spend `amount` (a request, or its estimated tokens); returns the seconds to wait
        before sending. The level may go negative: later callers wait for the debt."""
        self._refill(now)
        self.level -= amount
        return 0.0 if self.level >= 0 else -self.level / self.rate

    def correct(self, now: float, estimated: float, actual: float) -> None:
        """Give back (or charge) the difference once the real usage is known."""
        self._refill(now)
        self.level = min(self.capacity, self.level + estimated - actual)


class Pacer:
    """Everything that decides when the next request may go: the adaptive limit, a shared
    pause (Retry-After, an exhausted `x-ratelimit` budget) and the --rpm/--tpm buckets.

    Pure like the rest of this module: the runner passes `now`, sleeps for what `wait` says,
    and applies the returned limit changes to its capacity limiter.
    """

    def __init__(
        self,
        controller: ConcurrencyController | None,
        *,
        rpm: float | None = None,
        tpm: float | None = None,
        in_flight: int = 16,
    ) -> None:
        self.controller = controller
        self.requests = TokenBucket(rpm) if rpm else None
        self.tokens = TokenBucket(tpm) if tpm else None
        self.pause_until = 0.0
        self.in_flight = in_flight  # the most requests in flight, when not adaptive
        # Spacing from the server's own budget when it runs low: seconds between requests
        # (requests budget) and seconds per token (tokens budget), and the next free slot.
        self._request_gap: float | None = None
        self._token_gap: float | None = None
        self._next_send = 0.0

    def wait(self, now: float, estimated_tokens: int) -> float:
        """Seconds to hold this request back; reserves its share of the buckets."""
        pause = self.pause_until
        if self.controller is not None:
            pause = max(pause, self.controller.pause_until)
        wait = max(0.0, pause - now)
        gap = max(self._request_gap or 0.0, (self._token_gap or 0.0) * estimated_tokens)
        if gap:  # the budget runs low: one request per gap
            send_at = max(self._next_send, now)
            self._next_send = send_at + gap
            wait = max(wait, send_at - now)
        if self.requests is not None:
            wait = max(wait, self.requests.take(now))
        if self.tokens is not None:
            wait = max(wait, self.tokens.take(now, estimated_tokens))
        return wait

    def succeeded(
        self, now: float, *, estimated_tokens: int, used_tokens: int | None,
        output_tokens: int, ttft: float | None, rate: RateInfo | None, sent_at_limit: int,
    ) -> Change | None:  # fmt: skip
        if self.tokens is not None and used_tokens is not None:
            self.tokens.correct(now, estimated_tokens, used_tokens)
        if rate is not None:
            self._respect(now, rate, estimated_tokens)
        if self.controller is None:
            return None
        return self.controller.completed(
            now, tokens=output_tokens, ttft=ttft, sent_at_limit=sent_at_limit
        )

    def failed(
        self, now: float, error: RequestError, *, sent_at_limit: int | None = None
    ) -> Change | None:
        """A failed attempt: 429s pause everyone; overload signals cut the adaptive limit."""
        retry_after = getattr(error, "retry_after", None)
        if isinstance(error, RateLimited) and retry_after:
            self.pause_until = max(self.pause_until, now + retry_after)
        overload = isinstance(error, (RateLimited, RequestTimeout)) or (
            isinstance(error, Overloaded) and error.status == 503
        )
        if self.controller is None or not overload:
            return None
        return self.controller.overloaded(now, retry_after=retry_after, sent_at_limit=sent_at_limit)

    def _respect(self, now: float, rate: RateInfo, estimated_tokens: int) -> None:
        """Proactive pacing from the server's `x-ratelimit-*` headers. While the budget is
        ample nothing changes; once what remains would not cover two rounds of requests in
        flight, requests are spaced at the rate the budget refills, (limit - remaining) /
        reset, so it never runs dry and no 429 comes. A server that gives no limit: when
        its budget is spent, everyone waits for its reset."""
        wave = 2 * (self.controller.limit if self.controller is not None else self.in_flight)
        self._request_gap = _gap(rate.remaining_requests, rate.limit_requests,
                                 rate.reset_requests_s, wave)  # fmt: skip
        self._token_gap = _gap(rate.remaining_tokens, rate.limit_tokens, rate.reset_tokens_s,
                               wave * estimated_tokens)  # fmt: skip
        spent = rate.remaining_requests is not None and rate.remaining_requests <= 0
        if spent and rate.limit_requests is None:
            self.pause_until = max(self.pause_until, now + (rate.reset_requests_s or 1.0))
        short = rate.remaining_tokens is not None and rate.remaining_tokens < estimated_tokens
        if short and rate.limit_tokens is None:
            self.pause_until = max(self.pause_until, now + (rate.reset_tokens_s or 1.0))


def _gap(remaining: int | None, limit: int | None, reset: float | None, low: float) -> float | None:
    """Seconds per unit at the budget's refill rate, when what remains is below `low`."""
    if remaining is None or limit is None or not reset or remaining >= low:
        return None
    used = limit - remaining
    return reset / used if used > 0 else None


def estimate_request_tokens(body: dict[str, Any]) -> int:
    """What a request may cost against a tokens-per-minute budget: its prompt (4 characters a
    token) plus the most it may generate."""
    limit = body.get("max_tokens") or body.get("max_completion_tokens") or DEFAULT_MAX_TOKENS
    return estimate_tokens(prompt_chars(body)) + (limit if isinstance(limit, int) else 0)


DEFAULT_MAX_TOKENS = 256  # assumed when a request does not say
