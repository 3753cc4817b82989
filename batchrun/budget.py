"""A job's spending limit: tokens (--max-total-tokens) or money (--max-cost at --price-in and
--price-out per million tokens). Pure and clock-free.

Every request asks before it is sent (`admit`, with its estimate: the prompt's length and the
most it may generate, the same estimate `--tpm` uses) and is settled with the usage its answer
reports (`settle`); estimates of requests in flight are held, so requests sent together never
add up past the limit. What the job spent before (earlier runs, other workers' commits) is the
starting point, and is looked at again now and then (`saw_spent`). The first request that would
go past the limit is not sent: the job stops there, its untouched items still pending, and a
`resume` with a higher limit continues.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchrun.errors import FatalError

PER = 1_000_000  # prices are per million tokens


class BudgetReached(FatalError):
    """The next request would take the job past its budget; it was not sent."""


@dataclass
class Budget:
    max_tokens: int | None = None
    max_cost: float | None = None
    price_in: float = 0.0  # per million prompt tokens
    price_out: float = 0.0  # per million completion tokens
    spent_in: int = 0  # prompt tokens paid so far (the whole job)
    spent_out: int = 0
    held_in: int = 0  # estimates of requests on the wire now
    held_out: int = 0

    def cost(self, tokens_in: int, tokens_out: int) -> float:
        return (tokens_in * self.price_in + tokens_out * self.price_out) / PER

    def admit(self, est_in: int, est_out: int) -> None:
        """Hold a request's estimate, or raise BudgetReached (and hold nothing)."""
        tokens_in = self.spent_in + self.held_in + est_in
        tokens_out = self.spent_out + self.held_out + est_out
        if self.max_tokens is not None and tokens_in + tokens_out > self.max_tokens:
            raise BudgetReached(
                f"--max-total-tokens {self.max_tokens:,} reached: {self.spent:,} tokens spent, "
                f"{self.held_in + self.held_out:,} in flight, the next request may take "
                f"{est_in + est_out:,}; resume with a higher --max-total-tokens to go on"
            )
        if self.max_cost is not None and self.cost(tokens_in, tokens_out) > self.max_cost:
            spent = self.cost(self.spent_in, self.spent_out)
            raise BudgetReached(
                f"--max-cost {self.max_cost:g} reached: {spent:.4f} spent, the next request "
                f"may cost {self.cost(est_in, est_out):.4f}; resume with a higher --max-cost"
            )
        self.held_in += est_in
        self.held_out += est_out

    def settle(self, est_in: int, est_out: int, used: tuple[int, int] | None) -> None:
        """The request is over: its estimate is released and what it used is spent (its
        estimate, when the server reported no usage; nothing for a request that failed)."""
        self.held_in -= est_in
        self.held_out -= est_out
        used_in, used_out = used if used is not None else (0, 0)
        self.spent_in += used_in
        self.spent_out += used_out

    def saw_spent(self, spent_in: int, spent_out: int) -> None:
        """The ledger's count of what the whole job paid (other workers too): taken when it is
        ahead of ours (ours also counts answers not committed yet)."""
        self.spent_in = max(self.spent_in, spent_in)
        self.spent_out = max(self.spent_out, spent_out)

    @property
    def spent(self) -> int:
        return self.spent_in + self.spent_out
