"""A job's spending limit: tokens (--max-total-tokens) or money (--max-cost at --price-in and
--price-out per million tokens). Pure and clock-free.

Every request asks before it is sent (`admit`, with its estimate: the prompt's length and the
most it may generate, the same estimate `--tpm` uses) and is settled with the usage its answer
reports (`settle`); estimates of requests in flight are held, so requests sent together never
add up past the limit. What the job spent before (earlier runs, other workers' commits) is the
starting point, and is looked at again now and then (`saw_spent`). The first request that would
go past the limit is not sent: the job stops there, its untouched items still pending, and a
`resume` with a higher limit continues.

Several workers share what was left when they last looked (`saw_spent`): each may spend its
part, 1/N with N workers alive, so that together they stay within the limit. A worker that has
spent half its part since it looked, or would pass its part, looks again first (ShareSpent: the
ledger's count, and the workers alive now): a worker that joined since, or one that left, moves
every part. Past its part once it has looked, a worker stops; the others go on with theirs, and
the last one alive has all that is left.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchrun.errors import FatalError

PER = 1_000_000  # prices are per million tokens


class BudgetReached(FatalError):
    """The next request would take the job past its budget; it was not sent."""


class ShareSpent(Exception):
    """This worker's part of the budget is half spent, or would be passed: look at what the
    job spent, and at the workers alive, before the request is admitted (`admit` again)."""


def money(amount: float) -> str:
    """An amount as a budget's message says it: 4 decimals, or 2 figures where that would
    round a cost that is not nothing to 0.0000."""
    return f"{amount:.4f}" if amount == 0 or amount >= 0.00005 else f"{amount:.2g}"


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
    workers: int = 1  # alive when the job's spending was last looked at
    looked: tuple[int, int] = (0, 0)  # what the job had spent then
    looks = 0  # how often it was looked at (a request refused sees whether it was since)

    def cost(self, tokens_in: int, tokens_out: int) -> float:
        return (tokens_in * self.price_in + tokens_out * self.price_out) / PER

    def admit(self, est_in: int, est_out: int, *, looked: bool = False) -> None:
        """Hold a request's estimate, or raise BudgetReached (and hold nothing); ShareSpent
        when this worker should look at the job's spending first (unless it just `looked`)."""
        tokens_in = self.spent_in + self.held_in + est_in
        tokens_out = self.spent_out + self.held_out + est_out
        most = self.max_tokens
        if most is not None and self._over(tokens_in + tokens_out, most, sum(self.looked), looked):
            raise BudgetReached(self._said(f"{est_in + est_out:,}", tokens=True))
        if self.max_cost is not None:
            after = self.cost(tokens_in, tokens_out)
            if self._over(after, self.max_cost, self.cost(*self.looked), looked):
                raise BudgetReached(self._said(money(self.cost(est_in, est_out)), tokens=False))
        self.held_in += est_in
        self.held_out += est_out

    def _over(self, after: float, limit: float, then: float, looked: bool) -> bool:
        """Whether a request that takes the job's spending to `after` (tokens or money) may
        not go: past `limit`, or past this worker's part of what was left when it looked
        (`then` spent). ShareSpent: look first (half the part spent since, or past it)."""
        part = then + max(0.0, limit - then) / self.workers
        if after > limit or (looked and after > part):
            return True
        if not looked and self.looks and (after > part or after - then > (part - then) / 2):
            raise ShareSpent
        return False

    def _said(self, next_takes: str, *, tokens: bool) -> str:
        """Why the request may not go, naming the limit it would pass (`tokens`: the token
        budget, else the cost's) and what to raise."""
        part = "" if self.workers == 1 else f" (this worker's part, 1 of {self.workers} alive)"
        if tokens:
            return (
                f"--max-total-tokens {self.max_tokens:,} reached{part}: {self.spent:,} tokens "
                f"spent, {self.held_in + self.held_out:,} in flight, the next request may take "
                f"{next_takes}; resume with a higher --max-total-tokens to go on"
            )
        spent, held = (
            self.cost(self.spent_in, self.spent_out),
            self.cost(self.held_in, self.held_out),
        )
        return (
            f"--max-cost {self.max_cost:g} reached{part}: {money(spent)} spent, {money(held)} "
            f"in flight, the next request may cost {next_takes}; resume with a higher --max-cost"
        )

    def settle(self, est_in: int, est_out: int, used: tuple[int, int] | None) -> None:
        """The request is over: its estimate is released and what it used is spent (its
        estimate, when the server reported no usage; nothing for a request that failed)."""
        self.held_in -= est_in
        self.held_out -= est_out
        used_in, used_out = used if used is not None else (0, 0)
        self.spent_in += used_in
        self.spent_out += used_out

    def saw_spent(self, spent_in: int, spent_out: int, *, workers: int = 1) -> None:
        """The ledger's count of what the whole job paid (other workers too): taken when it is
        ahead of ours (ours also counts answers not committed yet); `workers` alive now."""
        self.spent_in = max(self.spent_in, spent_in)
        self.spent_out = max(self.spent_out, spent_out)
        self.workers, self.looked = max(1, workers), (self.spent_in, self.spent_out)
        self.looks += 1

    @property
    def spent(self) -> int:
        return self.spent_in + self.spent_out
