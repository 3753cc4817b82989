"""Client-side rate limits, as pure objects fed with observations: --rpm/--tpm token buckets,
and pacing from a hosted API's own `x-ratelimit-*` budget.

Nothing here does I/O or reads a clock: callers pass `now`, so every decision is unit-testable.
(The adaptive concurrency limit lives in controller.py; throttle.py puts both together.)
"""

from __future__ import annotations

from typing import Any

from batchrun.backends.base import RateInfo
from batchrun.errors import RateLimited, RequestError
from batchrun.inputs import estimate_tokens, prompt_chars


class TokenBucket:
    """Client-side pacing for requests or tokens per minute: `take` says how long to wait."""

    def __init__(
        self, per_minute: float, *, burst: float | None = None, least: float = 0.0
    ) -> None:
        if per_minute <= 0:
            raise ValueError("per_minute must be positive")
        self.per_minute = per_minute
        self.least = least  # the burst is never below this (one request: --rpm 1 sends now)
        self.rate = per_minute / 60.0
        self.capacity = burst if burst is not None else max(self.rate * 5, least)  # 5 s
        self.level = self.capacity
        self.updated: float | None = None

    def share(self, fraction: float, *, rank: int = 0) -> None:
        """Keep `fraction` of the budget (this worker's part of a job's): rate and burst. A
        bucket not yet taken from starts `rank` parts of one request behind: workers started
        together take turns, not the same moment (four sharing --rpm 2 sent four at once)."""
        self.rate = self.per_minute / 60.0 * fraction
        self.capacity = max(self.rate * 5, self.least * fraction)  # the job's: one request
        self.level = min(self.level, self.capacity)
        if self.updated is None:
            self.level -= rank * fraction

    def _level_at(self, now: float) -> float:
        """The level at `now`, refilled since the last look (nothing is changed)."""
        if self.updated is None:
            return self.level
        return min(self.capacity, self.level + (now - self.updated) * self.rate)

    def _refill(self, now: float) -> None:
        self.level, self.updated = self._level_at(now), now

    def take(self, now: float, amount: float = 1.0) -> float:
        """Spend `amount` (a request, or its estimated tokens); returns the seconds to wait
        before sending. The level may go negative: later callers wait for the debt."""
        self._refill(now)
        self.level -= amount
        return 0.0 if self.level >= 0 else -self.level / self.rate

    def ready(self, now: float) -> bool:
        """Whether a request taken at `now` would go without waiting (nothing is taken)."""
        return self._level_at(now) >= 1.0

    def correct(self, now: float, estimated: float, actual: float) -> None:
        """Give back (or charge) the difference once the real usage is known."""
        self._refill(now)
        self.level = min(self.capacity, self.level + estimated - actual)


class Pacer:
    """Everything that decides when the next request may go, apart from the concurrency limit:
    a shared pause (an exhausted budget), the --rpm/--tpm buckets, and spacing at a hosted
    budget's refill rate.

    Pure like the rest of this module: the caller passes `now` and sleeps for what `wait` says.
    A 429 pauses everyone only when the server said its whole budget is spent; otherwise the
    refused request waits its own Retry-After (the retry policy does that) and others go on.
    """

    def __init__(
        self, *, rpm: float | None = None, tpm: float | None = None, in_flight: int = 16
    ) -> None:
        self.requests = TokenBucket(rpm, least=1.0) if rpm else None
        self.tokens = TokenBucket(tpm) if tpm else None
        self.pause_until = 0.0
        self.in_flight = in_flight  # the most requests in flight (the throttle keeps it current)
        # Spacing from the server's own budget when it runs low: seconds between requests
        # (requests budget) and seconds per token (tokens budget), and the next free slot.
        self._request_gap: float | None = None
        self._token_gap: float | None = None
        self._next_send = 0.0

    def wait(self, now: float, estimated_tokens: int) -> float:
        """Seconds to hold this request back; reserves its share of the buckets."""
        wait = max(0.0, self.pause_until - now)
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

    def ready(self, now: float) -> bool:
        """Whether a request could go at `now` without a wait (not paused, its --rpm budget
        has one; the tokens it will estimate are not known yet): nothing is reserved."""
        if self.pause_until > now or self._next_send > now:
            return False
        return self.requests is None or self.requests.ready(now)

    def share(self, workers: int, *, rank: int = 0) -> None:
        """--rpm/--tpm are budgets for the whole job: with `workers` live, take a part each;
        `rank`, this worker's place among them (by start), sets its turn for requests."""
        part = 1 / max(1, workers)
        if self.requests is not None:
            self.requests.share(part, rank=min(rank, max(1, workers) - 1))
        if self.tokens is not None:
            self.tokens.share(part)

    def pause(self, until: float) -> None:
        self.pause_until = max(self.pause_until, until)

    def succeeded(
        self, now: float, *, estimated_tokens: int, used_tokens: int | None, rate: RateInfo | None
    ) -> None:
        if self.tokens is not None and used_tokens is not None:
            self.tokens.correct(now, estimated_tokens, used_tokens)
        if rate is not None:
            self._respect(now, rate, estimated_tokens)

    def failed(self, now: float, error: RequestError) -> None:
        """A 429 that says the whole budget is spent pauses everyone for its Retry-After."""
        if isinstance(error, RateLimited) and error.budget_spent:
            self.pause(now + (error.retry_after or 1.0))

    def _respect(self, now: float, rate: RateInfo, estimated_tokens: int) -> None:
        """Proactive pacing from the server's `x-ratelimit-*` headers. While the budget is
        ample nothing changes; once what remains would not cover two rounds of requests in
        flight, requests are spaced at the rate the budget refills, (limit - remaining) /
        reset, so it never runs dry and no 429 comes. A server that gives no limit: when
        its budget is spent, everyone waits for its reset."""
        wave = 2 * self.in_flight
        r = rate
        self._request_gap = _gap(r.remaining_requests, r.limit_requests, r.reset_requests_s, wave)
        low_tokens = wave * estimated_tokens
        self._token_gap = _gap(r.remaining_tokens, r.limit_tokens, r.reset_tokens_s, low_tokens)
        spent = r.remaining_requests is not None and r.remaining_requests <= 0
        if spent and r.limit_requests is None:
            self.pause(now + (r.reset_requests_s or 1.0))
        short = r.remaining_tokens is not None and r.remaining_tokens < estimated_tokens
        if short and r.limit_tokens is None:
            self.pause(now + (r.reset_tokens_s or 1.0))


def _gap(remaining: int | None, limit: int | None, reset: float | None, low: float) -> float | None:
    """Seconds per unit at the budget's refill rate, when what remains is below `low`."""
    if remaining is None or limit is None or not reset or remaining >= low:
        return None
    used = limit - remaining
    return reset / used if used > 0 else None


def estimate_request_tokens(body: dict[str, Any]) -> int:
    """What a request may cost against a tokens-per-minute budget: its prompt (4 characters a
    token) plus the most it may generate."""
    return sum(estimate_split(body))


def estimate_split(body: dict[str, Any]) -> tuple[int, int]:
    """The same estimate in its two parts (prompt, output): budgets price them apart."""
    # Both may be sent (a line's max_completion_tokens over the job's --max-tokens), and
    # servers differ in which they obey: the larger bounds the answer. `n` answers are paid.
    # (Two lookups, no list: this runs for every request.)
    limit, other = body.get("max_tokens"), body.get("max_completion_tokens")
    if not isinstance(limit, int) or (isinstance(other, int) and other > limit):
        limit = other if isinstance(other, int) else DEFAULT_MAX_TOKENS
    n = body.get("n")
    return estimate_tokens(prompt_chars(body)), limit * n if isinstance(n, int) and n > 1 else limit


DEFAULT_MAX_TOKENS = 256  # assumed when a request does not say
