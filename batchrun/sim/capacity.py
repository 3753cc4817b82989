"""A continuous-batching server's capacity, and a hosted API's rate limits, for the simulator.

Like vLLM with `max_num_seqs` slots: a request decodes in a slot; with more sequences in the batch
each token takes longer; past the slots, requests wait in a queue, so their time to first token
grows with it; optionally a gate refuses requests past a queue length (429 or 503). Like a hosted
API (OpenAI's, Groq's): requests and tokens per minute as budgets that refill continuously, a
minute's worth at most, announced in `x-ratelimit-*` headers: the limit, what remains, and the
time until the budget is full again.

The schedule is planned when a request arrives (when it gets a slot, how fast it decodes), from
an injected clock, so the model stays a pure function of its inputs and the time.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

WINDOW_S = 60.0


@dataclass(frozen=True)
class Admission:
    queue_wait: float  # seconds before the request gets a slot
    tpot_factor: float  # >= 1: each token takes this much longer in a fuller batch
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Refusal:
    status: int
    retry_after: float
    message: str
    headers: dict[str, str] = field(default_factory=dict)


class Capacity:
    def __init__(
        self,
        *,
        slots: int | None = None,
        tpot_slope: float = 0.0,
        queue_limit: int | None = None,
        gate_status: int = 429,
        rpm: int | None = None,
        tpm: int | None = None,
        clock: Callable[[], float],
    ) -> None:
        self.slots = slots
        self.tpot_slope = tpot_slope
        self.queue_limit = queue_limit
        self.gate_status = gate_status
        self.rpm = rpm
        self.tpm = tpm
        self.clock = clock
        self._ends: list[float] = []  # heap: when each busy slot (no slots: request) frees up
        self._starts: list[float] = []  # planned starts still in the future: the queue (a heap)
        self._requests = _Budget(rpm) if rpm else None
        self._tokens = _Budget(tpm) if tpm else None

    def admit(
        self, *, prompt_tokens: int, n_out: int, ttft: float, tpot: float
    ) -> Admission | Refusal:
        now = self.clock()
        headers = self._rate_headers(now, prompt_tokens + n_out)
        refusal = self._rate_refusal(now, prompt_tokens + n_out, headers)
        if refusal is not None:
            return refusal
        self._prune(now)
        if self.slots is None:
            # No batch limit: every request decodes at once, busy until its planned end.
            heapq.heappush(self._ends, now + ttft + tpot * max(0, n_out - 1))
            self._count(now, prompt_tokens + n_out)
            return Admission(0.0, 1.0, headers)
        full = len(self._ends) >= self.slots
        if full and self.queue_limit is not None and len(self._starts) >= self.queue_limit:
            # when the first waiting request gets a slot; with no queue allowed, the first end
            wait = (self._starts[0] if self._starts else self._ends[0]) - now
            return Refusal(self.gate_status, wait, "server busy: queue full (simulated)", headers)
        start = heapq.heappop(self._ends) if full else now
        active = min(self.slots, len(self._ends) + 1)
        factor = 1.0 + self.tpot_slope * (active - 1) / self.slots
        heapq.heappush(self._ends, start + ttft + tpot * factor * max(0, n_out - 1))
        if start > now:
            heapq.heappush(self._starts, start)
        self._count(now, prompt_tokens + n_out)
        return Admission(start - now, factor, headers)

    def load(self) -> tuple[int, int]:
        """(running, waiting) now: what a vLLM server's /metrics reports, from the plan itself.

        A slot's requests follow each other without a gap (a queued request starts the moment
        the slot's previous one ends), so a slot is busy now exactly when its last planned end is
        still ahead; waiting are the admitted requests whose start is still ahead. Without slots,
        running is every request not yet finished and nothing waits."""
        self._prune(self.clock())
        return len(self._ends), len(self._starts)

    def _prune(self, now: float) -> None:
        """Forget slots that have freed up and queued requests that have started by `now`."""
        while self._ends and self._ends[0] <= now:
            heapq.heappop(self._ends)
        while self._starts and self._starts[0] <= now:
            heapq.heappop(self._starts)

    @property
    def queued(self) -> int:
        """Requests waiting for a slot right now."""
        now = self.clock()
        return sum(1 for start in self._starts if start > now)

    # --- hosted-API limits ------------------------------------------------------------------

    def _count(self, now: float, tokens: int) -> None:
        if self._requests is not None:
            self._requests.spend(now, 1)
        if self._tokens is not None:
            self._tokens.spend(now, tokens)

    def _rate_headers(self, now: float, tokens: int) -> dict[str, str]:
        headers: dict[str, str] = {}
        for name, budget in (("requests", self._requests), ("tokens", self._tokens)):
            if budget is not None:
                headers[f"x-ratelimit-limit-{name}"] = str(budget.size)
                headers[f"x-ratelimit-remaining-{name}"] = str(int(budget.level(now)))
                headers[f"x-ratelimit-reset-{name}"] = f"{budget.until_full(now):.3f}s"
        return headers

    def _rate_refusal(self, now: float, tokens: int, headers: dict[str, str]) -> Refusal | None:
        if self._requests is not None and self._requests.level(now) < 1:
            wait = self._requests.until(now, 1)
            return Refusal(429, wait, "rate limit: requests per minute (simulated)", headers)
        if self._tokens is not None and self._tokens.level(now) < tokens:
            wait = self._tokens.until(now, tokens)
            return Refusal(429, wait, "rate limit: tokens per minute (simulated)", headers)
        return None


class _Budget:
    """A per-minute budget refilling continuously: `size` at most, `size / 60` a second."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.rate = size / WINDOW_S
        self._level = float(size)
        self._at: float | None = None

    def level(self, now: float) -> float:
        if self._at is not None:
            self._level = min(float(self.size), self._level + (now - self._at) * self.rate)
        self._at = now
        return self._level

    def spend(self, now: float, amount: int) -> None:
        self._level = self.level(now) - amount

    def until(self, now: float, amount: float) -> float:
        """Seconds until `amount` is available."""
        return max(0.0, (min(amount, self.size) - self.level(now)) / self.rate)

    def until_full(self, now: float) -> float:
        return max(0.0, (self.size - self.level(now)) / self.rate)
