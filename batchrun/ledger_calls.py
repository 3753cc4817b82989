"""Ledger calls from the event loop: in a worker thread, one at a time, patient.

A run must not fail because the ledger is briefly unavailable: another process may hold
SQLite's write lock for a long ingest (waited out for `busy_patience`), or a PostgreSQL server
may be restarting (waited out for the run's outage timeout, as an endpoint outage is). Other
ledger errors (a full disk, a broken rule) are raised at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import anyio

from batchrun.errors import LedgerError
from batchrun.progress import JobLog
from batchrun.run_state import RunnerSettings

T = TypeVar("T")

RETRY_S = 1.0  # between tries of a ledger that is busy or out of reach


class LedgerCalls:
    def __init__(
        self,
        settings: RunnerSettings,
        *,
        outage_timeout: float,
        log: JobLog,
        say: Callable[[str], None] | None = None,
    ) -> None:
        self.settings = settings  # busy_patience, and the clock and sleep to wait with
        self.outage_timeout = outage_timeout
        self.log = log
        self.say = say or (lambda _text: None)
        self.no_waiting = False  # the run is failing: its last calls wait out no lock or outage
        self.outages = 0  # calls that found the database out of reach: their outcome is unknown
        self._lock = anyio.CapacityLimiter(1)
        self._lost: float | None = None  # when the ledger went out of reach

    async def __call__(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        busy_until = self.settings.clock() + self.settings.busy_patience
        while True:
            try:
                done = await anyio.to_thread.run_sync(
                    lambda: fn(*args, **kwargs), limiter=self._lock
                )
            except LedgerError as exc:
                await self._wait_out(exc, busy_until)
                continue
            if self._lost is not None:
                away = self.settings.clock() - self._lost
                self._lost = None
                self.log.event("ledger_back", after_s=round(away, 3))
                self.say(f"the ledger is back after {away:.0f} s")
            return done

    async def _wait_out(self, exc: LedgerError, busy_until: float) -> None:
        """Sleep before trying again, or raise `exc` when waiting is not worth it."""
        now = self.settings.clock()
        if exc.busy and now <= busy_until and not self.no_waiting:
            self.log.event("ledger_busy", error=str(exc))
            await self.settings.sleep(RETRY_S)
            return
        if not exc.out_of_reach or self.no_waiting:
            raise exc
        self.outages += 1
        if self._lost is None:
            self._lost = now
            self.log.event("ledger_unreachable", error=str(exc), wait_s=self.outage_timeout)
            self.say(f"the ledger is out of reach; waiting up to {self.outage_timeout:g} s: {exc}")
        elif now - self._lost > self.outage_timeout:
            raise LedgerError(
                f"the ledger stayed out of reach for more than {self.outage_timeout:g} s "
                f"(--outage-timeout): {exc}",
                out_of_reach=True,
            )
        await self.settings.sleep(RETRY_S)
