"""The pipeline: claim -> worker pool -> sender (pacing, retries, validation) -> group commits.

One feeder leases pending items in small batches and hands them to N workers through a bounded
channel; workers send results to one writer, which commits them in groups at most
`commit_interval` seconds old. Stopping (Ctrl-C, SIGTERM, or a fatal endpoint error) never
cancels the writer: workers stop taking items, in-flight requests get `drain_timeout` to finish,
what finished is committed, and unfinished claims go back to pending for `resume`.

Knows only the Backend protocol and the Ledger's API; ledger calls run in a worker thread, one
at a time, so the event loop never blocks on disk.
"""

from __future__ import annotations

import contextlib
import math
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from batchrun.backends import Backend
from batchrun.budget import Budget
from batchrun.config import ANSWER_FIELDS, RunSpec
from batchrun.controller import Change
from batchrun.errors import (
    BatchrunError,
    LedgerError,
    OutputError,
)
from batchrun.ledger import ClaimedItem, ItemResult, Ledger
from batchrun.ledger_calls import LedgerCalls
from batchrun.progress import JobLog, Progress
from batchrun.retrying import OutageWatch, RetryPolicy
from batchrun.reuse import answer_spec
from batchrun.run_state import RunnerSettings, RunStats
from batchrun.sender import Sender
from batchrun.server_metrics import ServerLoad
from batchrun.structured import OutputRules
from batchrun.throttle import Throttle

MAX_GROUP = 1000  # results per commit at most
MAX_CLAIM = 256  # items per claim at most


class Runner:
    def __init__(
        self,
        ledger: Ledger,
        backend: Backend,
        job: str,
        spec: RunSpec,
        *,
        log: JobLog,
        progress: Progress | None = None,
        rules: OutputRules | None = None,
        settings: RunnerSettings | None = None,
        server_load: Callable[[], Awaitable[ServerLoad | None]] | None = None,
    ) -> None:
        self.ledger = ledger
        self.backend = backend
        self.job = job
        self.spec = spec
        self.log = log
        self.progress = progress
        self.settings = settings or RunnerSettings()
        self.owner = uuid.uuid4().hex
        self.stats = RunStats()
        self.answer_spec = answer_spec(spec)  # recorded with each result, for later reuse
        retries, pacing = spec.retries, spec.pacing
        self.outage = OutageWatch(retries.outage_timeout, clock=self.settings.clock)
        self.policy = RetryPolicy(retries.max_attempts, self.outage, sleep=self.settings.sleep)
        self._db = LedgerCalls(
            self.settings,
            outage_timeout=retries.outage_timeout,
            log=log,
            say=progress.say if progress is not None else None,
        )
        self.throttle = Throttle.for_pacing(
            pacing, clock=self.settings.clock, sleep=self.settings.sleep, on_change=self._adjust
        )
        self._server_load = server_load
        self._sharing = 1  # workers the --rpm/--tpm budget is shared between
        self._limit_log: deque[tuple[float, int, str]] = deque(maxlen=20)
        if progress is not None:
            progress.concurrency = self.throttle.limit
        self._stopping = anyio.Event()
        self._held: set[int] = set()  # lines claimed and not yet committed
        self._unfinished = 0  # items claimed and not yet answered (in flight, queued, waiting)
        self._room = anyio.Event()  # set when an item is answered
        self._workers_scope: anyio.CancelScope | None = None
        self.rules = rules or OutputRules()
        self.sender = Sender(
            backend,
            policy=self.policy,
            throttle=self.throttle,
            rules=self.rules,
            defaults=spec.request_defaults(),
            log=log,
            stats=self.stats,
            settings=self.settings,
            on_fatal=self._abort,
        )

    # --- control --------------------------------------------------------------------------

    def request_stop(self, signum: int | None = None) -> None:
        """Ctrl-C / SIGTERM (`signum`): stop taking work; in-flight requests get a short grace.

        A second call stops in-flight requests at once (what finished is still committed)."""
        if self._stopping.is_set() and self._workers_scope is not None:
            self._workers_scope.cancel()
        elif self.progress is not None:
            self.progress.say(
                f"stopping: waiting up to {self.settings.drain_timeout:g} s for "
                f"{self.throttle.in_flight} request(s) in flight (Ctrl-C again to stop now)"
            )
        self.stats.interrupted = True
        self.stats.stopped_by = self.stats.stopped_by or signum
        self._stopping.set()

    def _abort(self, error: BatchrunError) -> None:
        if self.stats.aborted is None:
            self.stats.aborted = str(error)
            self.log.event("abort", error=str(error), kind=type(error).__name__)
        self._stopping.set()

    # --- the run --------------------------------------------------------------------------

    async def run(self) -> RunStats:
        s = self.settings
        self.stats.reclaimed = await self._db(
            self.ledger.join,
            self.job,
            self.owner,
            ttl=s.lease_ttl,
            spec=self.spec.to_json(),
            same=ANSWER_FIELDS,
        )
        await self._watch_spending()
        self.log.event(
            "run_started",
            owner=self.owner,
            reclaimed=self.stats.reclaimed,
            concurrency=self.spec.concurrency,
            backend=self.spec.backend,
            model=self.spec.model,
        )
        try:
            results_send, results_recv = anyio.create_memory_object_stream[ItemResult](math.inf)
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._writer, results_recv)
                async with anyio.create_task_group() as side:
                    side.start_soon(self._heartbeat)
                    side.start_soon(self._drain_on_stop)
                    if self._server_load is not None:
                        side.start_soon(self._watch_server, self._server_load)
                    await self._run_workers(results_send)
                    side.cancel_scope.cancel()
        except BaseException:
            # Keep the error that stopped the run; a failed release (same full disk, say) is
            # only logged; the next resume reclaims the leases anyway.
            self._db.no_waiting = True
            with anyio.CancelScope(shield=True):
                await self._finish(quiet_errors=True)
            raise
        with anyio.CancelScope(shield=True):
            await self._finish(quiet_errors=False)
        return self.stats

    async def _finish(self, *, quiet_errors: bool) -> None:
        """Give the job back (unfinished claims return to pending) and log the run's end."""
        back: int | None = None
        try:
            back = await self._db(
                self.ledger.release,
                self.job,
                self.owner,
                progress=(self.stats.recorded, self.stats.requests),
                limits=list(self._limit_log),
            )
        except LedgerError:
            if not quiet_errors:
                raise
        self.stats.elapsed = time.monotonic() - self.stats.started
        with contextlib.suppress(OutputError):
            self.log.event(
                "run_stopped",
                owner=self.owner,
                released=back,
                recorded=self.stats.recorded,
                requests=self.stats.requests,
                retries=self.stats.retries,
                stale_resends=self.backend.stale_resends,
                limit=self.throttle.limit,
                aborted=self.stats.aborted,
                interrupted=self.stats.interrupted,
                elapsed_s=round(self.stats.elapsed, 3),
            )

    async def _watch_server(self, read: Callable[[], Awaitable[ServerLoad | None]]) -> None:
        if not await self.throttle.watch_server(read):
            self.log.event("server_metrics", available=False)

    async def _run_workers(self, results_send: MemoryObjectSendStream[ItemResult]) -> None:
        # More workers than slots: an item sleeping before its retry holds no slot, and
        # another item takes its place on the wire.
        most = self.spec.most_in_flight + max(4, self.spec.most_in_flight // 4)
        work_send, work_recv = anyio.create_memory_object_stream[ClaimedItem](most)
        async with anyio.create_task_group() as workers:
            self._workers_scope = workers.cancel_scope
            workers.start_soon(self._feeder, work_send)
            async with work_recv, results_send:
                for _ in range(most):
                    workers.start_soon(self._worker, work_recv.clone(), results_send.clone())

    async def _drain_on_stop(self) -> None:
        await self._stopping.wait()
        await anyio.sleep(self.settings.drain_timeout)
        if self._workers_scope is not None:
            self._workers_scope.cancel()

    async def _share_budget(self) -> None:
        """--rpm/--tpm are the whole job's: this worker takes its part of them, 1/N with N
        workers alive (itself too), looked at again with each heartbeat."""
        if self.spec.rpm is None and self.spec.tpm is None:
            return
        live = await self._db(self.ledger.live_workers, self.job, ttl=self.settings.lease_ttl)
        live = max(1, live)
        if live != self._sharing:
            self._sharing = live
            self.throttle.pacer.share(live)
            self.log.event("budget_share", workers=live, rpm=self.spec.rpm, tpm=self.spec.tpm)

    async def _watch_spending(self) -> None:
        """With --max-total-tokens or --max-cost: what the job has paid so far (other
        workers too), as the budget's starting point, then with every heartbeat."""
        spec = self.spec
        if spec.max_total_tokens is None and spec.max_cost is None:
            return
        spent = await self._db(self.ledger.paid_tokens, self.job)
        if self.throttle.budget is None:
            prices = (spec.price_in or 0.0, spec.price_out or 0.0)
            self.throttle.budget = Budget(spec.max_total_tokens, spec.max_cost, *prices)
        self.throttle.budget.saw_spent(*spent)

    async def _heartbeat(self) -> None:
        while True:
            await self._share_budget()
            await self._watch_spending()
            await anyio.sleep(self.settings.lease_ttl / 3)
            reclaimed = await self._db(
                self.ledger.heartbeat,
                self.job,
                self.owner,
                lease_ttl=self.settings.lease_ttl,
                progress=(self.stats.recorded, self.stats.requests),
                limits=list(self._limit_log),
            )
            if reclaimed:  # a worker that is gone left these: back to pending, for anyone
                self.log.event("reclaimed", items=reclaimed)

    async def _feeder(self, send: MemoryObjectSendStream[ClaimedItem]) -> None:
        last_line = 0  # claims walk forward; what other workers put back is found by a look from 0
        async with send:
            while not self._stopping.is_set():
                size = await self._claim_size()
                if not size:
                    return  # stopping: nothing more is claimed
                batch = await self._claim(size, last_line)
                if not batch:
                    # what other workers put back can be behind our last claim: look from the
                    # start once, then wait while any may come
                    if last_line == 0 and not await self._more_may_come():
                        return
                    last_line = 0
                    continue
                last_line = batch[-1].line
                for item in batch:
                    if self._stopping.is_set():
                        return  # claimed but unsent items are released at the end
                    try:  # a worker is free: no trip through the event loop
                        send.send_nowait(item)
                    except anyio.WouldBlock:
                        await send.send(item)

    async def _claim_size(self) -> int:
        """Wait until at most two limits' worth of items are unanswered here, then claim up
        to four: a free slot finds an item waiting, and at the end of a job no worker sits on
        a backlog that another could send (with several workers, or after a stop)."""
        while True:
            most = max(32, 4 * self.throttle.limit)
            if self._stopping.is_set():
                return 0
            if self._unfinished <= most // 2:
                return min(MAX_CLAIM, most - self._unfinished)
            self._room = anyio.Event()
            await self._room.wait()

    async def _claim(self, size: int, after_line: int) -> list[ClaimedItem]:
        outages = self._db.outages
        batch = await self._db(
            self.ledger.claim,
            self.job,
            self.owner,
            size,
            lease_ttl=self.settings.lease_ttl,
            after_line=after_line,
        )
        self._held.update(item.line for item in batch)
        self._unfinished += len(batch)
        if self._db.outages != outages:
            # A claim that the connection lost may have committed: items leased to us that
            # no worker here holds would wait for our lease forever; they go back to pending.
            strays = await self._db(self.ledger.put_back_strays, self.job, self.owner, self._held)
            if strays:
                self.log.event("strays_put_back", items=strays)
        return batch

    async def _more_may_come(self) -> bool:
        """Nothing left to claim: wait while items are pending or held by other workers (one
        that dies leaves them to us: the heartbeat reclaims them); False when none is."""
        if not await self._db(self.ledger.more_may_come, self.job, self.owner):
            return False
        with anyio.move_on_after(min(1.0, self.settings.lease_ttl / 6)):  # then claim again
            await self._stopping.wait()
        return not self._stopping.is_set()

    async def _worker(
        self,
        work: MemoryObjectReceiveStream[ClaimedItem],
        results: MemoryObjectSendStream[ItemResult],
    ) -> None:
        async with work, results:
            while True:
                try:  # an item waiting: no trip through the event loop
                    item = work.receive_nowait()
                except anyio.WouldBlock:
                    try:
                        item = await work.receive()
                    except anyio.EndOfStream:
                        return
                except anyio.EndOfStream:
                    return
                if self._stopping.is_set():
                    self._unfinished -= 1
                    continue  # left running; released to pending when the run ends
                result = await self.sender.process(item)
                self._unfinished -= 1
                self._room.set()
                if result is not None:
                    results.send_nowait(result)  # unbounded: never drops a finished result

    def _adjust(self, change: Change) -> None:
        """A reported move of the adaptive limit: to the progress bar, `status` and the log."""
        self._limit_log.append((round(time.time(), 3), change.limit, change.reason))
        if self.progress is not None:
            self.progress.concurrency = change.limit
        self.log.event(
            "concurrency", limit=change.limit, reason=change.reason, signal=change.signal
        )

    async def _writer(self, results: MemoryObjectReceiveStream[ItemResult]) -> None:
        clock = time.monotonic
        group: list[ItemResult] = []
        oldest = 0.0
        async with results:
            while True:
                if group and (
                    len(group) >= MAX_GROUP or clock() - oldest >= self.settings.commit_interval
                ):
                    await self._commit(group)
                    group = []
                    continue
                try:  # what is there already, without a timer per result
                    result = results.receive_nowait()
                except anyio.WouldBlock:
                    pass
                except anyio.EndOfStream:
                    break
                else:
                    if not group:
                        oldest = clock()
                    group.append(result)
                    continue
                wait = self.settings.commit_interval - (clock() - oldest) if group else None
                with anyio.move_on_after(wait):
                    try:
                        result = await results.receive()
                    except anyio.EndOfStream:
                        break
                    if not group:
                        oldest = clock()
                    group.append(result)
        with anyio.CancelScope(shield=True):
            await self._commit(group)

    async def _commit(self, group: list[ItemResult]) -> None:
        if not group:
            return
        changed = await self._db(
            self.ledger.record, self.job, self.owner, group, answer_spec=self.answer_spec
        )
        self._held.difference_update(result.line for result in group)
        self.stats.recorded += changed
        for result in group:
            self.stats.by_status[result.status] = self.stats.by_status.get(result.status, 0) + 1
        self.log.flush()
        if self.progress is not None:
            self.progress.update(
                newly_done=len(group),
                tokens=self.stats.output_tokens,
                retries=self.stats.retries,
                failed=self.stats.by_status.get("failed", 0)
                + self.stats.by_status.get("invalid", 0),
            )
