"""What a worker leases: small batches of pending items, in claim order, never many more than
its endpoints can have in flight.

It claims up to four times the current concurrency limit (summed over the endpoints) of items
not yet answered, or a quarter second of its answers when that is more (up to sixteen times
the limit), and claims again when half of that is left: a free slot finds an item waiting, and
at the end of a job no worker sits on a backlog that another could send (with several
workers, or after a stop). It also knows which lines this worker holds, so that after a lost
connection the claims it never saw go back to pending.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from batchrun.ledger import ClaimedItem, Joining, Ledger
from batchrun.ledger_calls import LedgerCalls
from batchrun.progress import JobLog
from batchrun.run_state import RunnerSettings

MAX_CLAIM = 256  # items per claim at most
# A worker answering fast holds this long of its answers: a claim goes through the ledger's
# thread, behind its group commits, and took 20-60 ms on a job answering 2,000 items a second
# here, when the items queued at a claim (half of four limits, less the 32 in flight: 32)
# lasted 16 ms, and its workers waited.
BACKLOG_S = 0.25
# ... but never more than this many limits: past answers do not promise the next ones (an
# endpoint that slows keeps what its worker holds from the others). A quarter second of
# answers passes four limits only where a request takes under 60 ms (answers a second are
# limit / latency); this cap is reached where it takes under 16 ms.
MOST_LIMITS = 16


class Feeder:
    def __init__(
        self,
        ledger: Ledger,
        db: LedgerCalls,
        *,
        job: str,
        owner: str,
        limit: Callable[[], int],
        settings: RunnerSettings,
        log: JobLog,
        by_prefix: bool = True,
        rejoining: Joining | None = None,
    ) -> None:
        self.by_prefix = by_prefix  # claim order: prefix groups together, or input order
        self.ledger = ledger
        self._db = db
        self.job = job
        self.owner = owner
        self._limit = limit
        self.settings = settings
        self.log = log
        self.stopping = anyio.Event()
        self.held: dict[int, ClaimedItem] = {}  # lines claimed, not yet committed: their copy
        self._unfinished = 0  # items claimed and not yet answered (in flight, queued, waiting)
        self._room = anyio.Event()  # set when an item is answered
        self._answered = 0  # since `_since`
        self._since = settings.clock()
        self._recently = 0  # answered in the last whole BACKLOG_S
        self.rejoining = rejoining  # how it joins again after a silence (None: it never does)
        self.beat_at = settings.clock()  # when the latest beat that renewed its leases began
        self._rechecking = anyio.Lock()

    async def still_held(self, item: ClaimedItem) -> bool:
        """Whether this worker still holds `item`, to send it (see `recheck`): its line, under
        this claim of it (a line lost and claimed again later is sent as the later copy)."""
        await self.recheck()
        return self.held.get(item.line) is item

    async def recheck(self) -> None:
        """Silent past its lease (frozen, its ledger away), this worker may have been taken
        for gone and its items given to others: it joins again (Ledger.rejoin: the lines it
        still holds; refused where the workers since ask for other answers), and sends only
        those, not what others hold now (paid twice). Its heartbeat rechecks before it beats."""
        lease, clock = self.settings.lease_ttl, self.settings.clock
        if self.rejoining is None or clock() - self.beat_at <= lease:
            return
        async with self._rechecking:  # one look for all the workers that find it silent
            if clock() - self.beat_at > lease:
                began = clock()
                ours = await self._db(self.ledger.rejoin, self.job, self.rejoining)
                self.held = {line: item for line, item in self.held.items() if line in ours}
                self.beat_at = began

    def answered(self) -> None:
        """One claimed item is answered (or dropped at a stop): room for another."""
        self._unfinished -= 1
        self._answered += 1
        self._room.set()

    async def run(self, send: MemoryObjectSendStream[ClaimedItem]) -> None:
        # claims walk forward; what other workers put back is found by a look from the start
        after = -1
        async with send:
            while not self.stopping.is_set():
                size = await self._claim_size()
                if not size:
                    return  # stopping: nothing more is claimed
                batch = await self._claim(size, after)
                if not batch:
                    # what other workers put back can be behind our last claim: look from the
                    # start once, then wait while any may come
                    if after == -1 and not await self._more_may_come():
                        return
                    after = -1
                    continue
                after = batch[-1].sched if self.by_prefix else batch[-1].line
                for item in batch:
                    if self.stopping.is_set():
                        return  # claimed but unsent items are released at the end
                    try:  # a worker is free: no trip through the event loop
                        send.send_nowait(item)
                    except anyio.WouldBlock:
                        await send.send(item)
                    except anyio.BrokenResourceError:  # the workers are gone: a cancel
                        return  # (a claim in its thread does not see one) released at the end

    async def _claim_size(self) -> int:
        while True:
            limit = self._limit()
            most = max(32, 4 * limit, min(self._recent(), MOST_LIMITS * limit))
            if self.stopping.is_set():
                return 0
            if self._unfinished <= most // 2:
                return min(MAX_CLAIM, most - self._unfinished)
            self._room = anyio.Event()
            await self._room.wait()

    def _recent(self) -> int:
        """How many items it answered in the last BACKLOG_S (a whole window, not the one
        under way: a few answers in a moment are no rate)."""
        now = self.settings.clock()
        if now - self._since >= BACKLOG_S:
            self._recently = math.ceil(self._answered * BACKLOG_S / (now - self._since))
            self._answered, self._since = 0, now
        return self._recently

    async def _claim(self, size: int, after: int) -> list[ClaimedItem]:
        outages = self._db.outages
        batch = await self._db(
            self.ledger.claim,
            self.job,
            self.owner,
            size,
            lease_ttl=self.settings.lease_ttl,
            after=after,
            by_prefix=self.by_prefix,
        )
        self.held.update((item.line, item) for item in batch)
        self._unfinished += len(batch)
        if self._db.outages != outages:
            # A claim that the connection lost may have committed: items leased to us that
            # no worker here holds would wait for our lease forever; they go back to pending.
            held = set(self.held)
            strays = await self._db(self.ledger.put_back_strays, self.job, self.owner, held)
            if strays:
                self.log.event("strays_put_back", items=strays)
        return batch

    async def _more_may_come(self) -> bool:
        """Nothing left to claim: wait while items are pending or held by other workers (one
        that dies leaves them to us: the heartbeat reclaims them); False when none is."""
        if not await self._db(self.ledger.more_may_come, self.job, self.owner):
            return False
        with anyio.move_on_after(min(1.0, self.settings.lease_ttl / 6)):  # then claim again
            await self.stopping.wait()
        return not self.stopping.is_set()
