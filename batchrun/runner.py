"""The pipeline: claim -> worker pool -> sender (pacing, retries, validation) -> group commits.

One feeder leases pending items in small batches and hands them to N workers; workers send
results to one writer (group_commit.py), which commits them in groups at most `commit_interval`
seconds old. Stopping (Ctrl-C, SIGTERM, a fatal endpoint error) never cancels the writer:
workers stop taking items, in-flight requests get `drain_timeout` to finish, what finished is
committed, unfinished claims go back to pending. A caller's cancel scope does cancel it, and it
commits what it holds first. Knows only the Backend protocol and the Ledger's API; ledger calls
run in a worker thread, one at a time, so the event loop never blocks on disk.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
import uuid
from collections import deque
from collections.abc import Sequence
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from batchrun.budget import Budget, BudgetReached
from batchrun.config import RunSpec
from batchrun.controller import Change
from batchrun.errors import BatchrunError, LedgerError, OutputError
from batchrun.feeder import Feeder
from batchrun.fleet import Fleet
from batchrun.group_commit import write_in_groups
from batchrun.lanes import EndpointUse, Lane, Route, watch_server
from batchrun.ledger import FINAL_STATUSES, ClaimedItem, ItemResult, Joining, Ledger, left
from batchrun.ledger_calls import LedgerCalls
from batchrun.progress import JobLog, Progress
from batchrun.retrying import OutageWatch, RetryPolicy, until_set
from batchrun.reuse import SAME, answer_spec, joined
from batchrun.routes import by_prefix
from batchrun.run_state import RunnerSettings, RunStats
from batchrun.sender import Sender
from batchrun.structured import OutputRules
from batchrun.throttle import Throttle

SAID = ("endpoint_down", "endpoint_up", "endpoint_out")  # endpoint events said on the terminal


class Runner:
    def __init__(
        self,
        ledger: Ledger,
        routes: list[Route],
        job: str,
        spec: RunSpec,
        *,
        log: JobLog,
        progress: Progress | None = None,
        rules: OutputRules | None = None,
        settings: RunnerSettings | None = None,
        left_out: Sequence[EndpointUse] = (),
    ) -> None:
        self.ledger, self.routes, self.job, self.spec = ledger, routes, job, spec
        self.log = log
        self.progress = progress
        self.settings = settings or RunnerSettings()
        self.owner = self.settings.worker or uuid.uuid4().hex
        self.stats = RunStats()
        self.answer_spec = answer_spec(spec)  # recorded with each result, for later reuse
        self.fleet = Fleet(
            [self._lane(route) for route in routes],
            clock=self.settings.clock,
            on_event=self._endpoint_event,
            left_out=left_out,
            named=bool(spec.endpoints),
        )
        self._db = LedgerCalls(
            self.settings,
            outage_timeout=spec.outage_timeout,
            log=log,
            say=progress.say if progress is not None else None,
        )
        self._sharing = 1  # workers the --rpm/--tpm budget is shared between
        self._budget_stop: anyio.Event | None = None  # set: a Ctrl-C during a budget's stop
        self._looking = anyio.Lock()  # one look at the job's spending at a time
        self._given = self._committed = 0  # results given to the writer, and committed, so far
        self._limit_log: deque[tuple[float, int, str]] = deque(maxlen=20)
        self.feeder = Feeder(
            ledger,
            self._db,
            job=job,
            owner=self.owner,
            limit=lambda: self.fleet.limit,
            settings=self.settings,
            log=log,
            by_prefix=by_prefix(spec, routes),
            rejoining=Joining(joined(spec, routes), SAME, self.settings.lease_ttl, self.owner),
        )
        self._stopping = self.feeder.stopping
        if progress is not None:
            progress.concurrency = self.fleet.limit
            progress.on_raised = self._stopping.set  # a callback raised: stop as on Ctrl-C
        # A retry's wait ends at a stop; the retry then is not sent (the sender's check).
        sleep = until_set(self._stopping, self.settings.sleep)
        self.policy = RetryPolicy(spec.max_attempts, self.fleet, sleep=sleep)
        self._workers_scope: anyio.CancelScope | None = None
        self.rules = rules or OutputRules()
        self.sender = Sender(
            self.fleet,
            policy=self.policy,
            rules=self.rules,
            defaults=spec.request_defaults(),
            log=log,
            stats=self.stats,
            settings=self.settings,
            on_fatal=self._abort,
        )
        self.sender.warm_groups = self.feeder.by_prefix
        self.sender.stopping = self._stopping
        self.sender.holds = self.feeder.still_held

    def _lane(self, route: Route) -> Lane:
        """An endpoint's own throttle (adaptive limit, rpm/tpm) and outage watch."""
        s = self.settings
        throttle = Throttle.for_pacing(
            route.spec.pacing,
            clock=s.clock,
            sleep=s.sleep,
            on_change=functools.partial(self._adjust, route.name),
        )
        outage = OutageWatch(route.spec.outage_timeout, clock=s.clock)
        lane = Lane(route, throttle, outage, answer_spec(route.spec))
        if route.waiting:  # its server was away as the job started: a probe asks its model
            lane.wait_for_model(s.clock())
            self._endpoint_event("endpoint_down", endpoint=route.name, error=route.waiting)
        return lane

    def request_stop(self, signum: int | None = None) -> None:
        """Ctrl-C / SIGTERM (`signum`): stop taking work; in-flight requests get a short grace. A
        second call stops them at once (what finished is still committed)."""
        waiting = self._budget_stop is not None and not self._budget_stop.is_set()
        if self._budget_stop is not None:  # it let its requests finish: now the usual grace
            self._budget_stop.set()
        if self._stopping.is_set() and self._workers_scope is not None and not waiting:
            self._workers_scope.cancel()
            self._hurry()  # "stop now": the last commit and release wait out no lock
        elif self.progress is not None:
            self.progress.say(
                f"stopping: waiting up to {self.settings.drain_timeout:g} s for "
                f"{self.fleet.in_flight} request(s) in flight (Ctrl-C again to stop now)"
            )
        self.stats.interrupted = True
        self.stats.stopped_by = self.stats.stopped_by or signum
        self._stopping.set()

    def _abort(self, error: BatchrunError) -> None:
        if self.stats.aborted is None:
            self.stats.aborted, stopped = str(error), self._stopping.is_set()  # a Ctrl-C first
            if isinstance(error, BudgetReached) and not stopped:
                self._budget_stop = anyio.Event()
            self.log.event("abort", error=str(error), kind=type(error).__name__)
        self._stopping.set()

    async def run(self) -> RunStats:
        try:  # from the join on: whatever ends the run, the worker leaves
            self.stats.reclaimed = await self._db(
                self.ledger.join,
                self.job,
                self.owner,
                ttl=self.settings.lease_ttl,
                spec=joined(self.spec, self.routes),
                same=SAME,
            )
            await self._watch_spending()
            self.log.event(
                "run_started",
                owner=self.owner,
                reclaimed=self.stats.reclaimed,
                concurrency=self.spec.concurrency,
                backend=self.spec.backend,
                model=self.spec.model,
                order="prefix" if self.feeder.by_prefix else "input",
            )
            results_send, results_recv = anyio.create_memory_object_stream[ItemResult](math.inf)
            async with anyio.create_task_group() as tg:
                writer = functools.partial(write_in_groups, hurry=self._hurry)
                tg.start_soon(writer, results_recv, self._commit, self.settings.commit_interval)
                async with anyio.create_task_group() as side:
                    side.start_soon(self._heartbeat)
                    side.start_soon(self._drain_on_stop)
                    for lane in self.fleet.lanes:
                        if lane.route.server_load is not None:
                            side.start_soon(watch_server, lane, self.log)
                    await self._run_workers(results_send)
                    side.cancel_scope.cancel()
        except BaseException:
            # the error that stopped the run is raised; a failed release is only logged
            self._hurry()
            with anyio.CancelScope(shield=True):
                await self._finish(quiet_errors=True)
            raise
        with anyio.CancelScope(shield=True):
            await self._finish(quiet_errors=False)
        if self.progress is not None:  # other workers' commits too: where the job stands
            counts = await self._db(self.ledger.counts, self.job)
            done = sum(counts[status] for status in FINAL_STATUSES)
            if done != self.progress.done:
                self.progress.done = done
                self._report_progress(0)
        return self.stats

    def _hurry(self) -> None:
        """The run is ending badly: its last ledger calls wait out no lock or outage."""
        self._db.no_waiting = self.ledger.hurried = True

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
                endpoints=self._endpoints(),
                spent=self.sender.spent,
            )
        except LedgerError:
            if not quiet_errors:
                raise
        self.stats.elapsed = time.monotonic() - self.stats.started
        self.stats.endpoints = self.fleet.uses()
        with contextlib.suppress(OutputError):
            self.log.event(
                "run_stopped",
                owner=self.owner,
                released=back,
                recorded=self.stats.recorded,
                requests=self.stats.requests,
                retries=self.stats.retries,
                stale_resends=sum(lane.backend.stale_resends for lane in self.fleet.lanes),
                limit=self.fleet.limit,
                aborted=self.stats.aborted,
                interrupted=self.stats.interrupted,
                elapsed_s=round(self.stats.elapsed, 3),
            )

    def _endpoints(self) -> dict[str, Any] | None:
        """Per endpoint, for `status`, with several (one left out at start counts)."""
        return None if self.fleet.only and not self.fleet.left_out else self.fleet.describe()

    def _endpoint_event(self, name: str, **fields: Any) -> None:
        self.log.event(name, **fields)
        if name in SAID and self.progress is not None:
            why = f": {fields['error']}" if fields.get("error") else ""
            self.progress.say(f"endpoint {fields['endpoint']} {name.partition('_')[2]}{why}")

    async def _run_workers(self, results_send: MemoryObjectSendStream[ItemResult]) -> None:
        # More workers than slots (an item sleeping before its retry holds no slot, and another
        # takes its place), but no more than items left: a 1-line job at --concurrency 40000
        slots = sum(route.spec.most_in_flight for route in self.routes)
        open_items = left(await self._db(self.ledger.counts, self.job))
        most = min(slots + max(4, slots // 4), max(1, open_items))
        # The feeder bounds what is claimed; a bound here too would hold it back from its next
        # claim until the last one were all taken, and the workers would wait on the ledger.
        work_send, work_recv = anyio.create_memory_object_stream[ClaimedItem](math.inf)
        async with anyio.create_task_group() as workers:
            self._workers_scope = workers.cancel_scope
            workers.start_soon(self.feeder.run, work_send)
            async with work_recv, results_send:
                for _ in range(most):
                    workers.start_soon(self._worker, work_recv.clone(), results_send.clone())

    async def _drain_on_stop(self) -> None:
        await self._stopping.wait()
        if self._budget_stop is not None:  # it lets what it admitted finish (paid for),
            with anyio.move_on_after(self.spec.timeout):  # until a Ctrl-C
                await self._budget_stop.wait()
        await anyio.sleep(self.settings.drain_timeout)
        if self._workers_scope is not None:
            self._workers_scope.cancel()

    async def _share_budget(self) -> None:
        """--rpm/--tpm are the whole job's: this worker takes 1/N (N live workers) and its turn."""
        if all(r.spec.rpm is None and r.spec.tpm is None for r in self.routes):
            return
        ids = await self._db(self.ledger.live_workers, self.job, ttl=self.settings.lease_ttl)
        live, rank = max(1, len(ids)), ids.index(self.owner) if self.owner in ids else 0
        if live != self._sharing:
            self._sharing = live
            for lane in self.fleet.lanes:
                lane.throttle.pacer.share(live, rank=rank)
            spec = self.spec
            self.log.event("budget_share", workers=live, rank=rank, rpm=spec.rpm, tpm=spec.tpm)

    async def _watch_spending(self) -> None:
        """With --max-total-tokens or --max-cost: what the job has paid so far (other
        workers too), as the budget's starting point, then with every heartbeat."""
        spec = self.spec
        if spec.max_total_tokens is None and spec.max_cost is None:
            return
        lanes = self.fleet.lanes
        if lanes[0].throttle.budget is None:  # one budget, whichever endpoint spends it
            prices = (spec.price_in or 0.0, spec.price_out or 0.0)
            budget = Budget(spec.max_total_tokens, spec.max_cost, *prices)
            for lane in lanes:
                lane.throttle.budget, lane.throttle.look = budget, self._look_at_spending
        await self._look_at_spending(None)

    async def _look_at_spending(self, looks: int | None) -> None:
        """What the job has paid (other workers too) and the workers alive, for the budget:
        with each heartbeat (`looks` None), and where this worker's part of it is half spent
        (once for the requests refused before a look: `looks`, the looks they had seen)."""
        async with self._looking:
            budget = self.fleet.lanes[0].throttle.budget
            assert budget is not None
            if looks is None or budget.looks == looks:
                given = self._given  # ours committed first, for the others to count
                while looks is not None and self._committed < given:
                    await anyio.sleep(self.settings.commit_interval / 4 or 0.005)
                spent = await self._db(self.ledger.paid_tokens, self.job)
                ttl = self.settings.lease_ttl
                live = await self._db(self.ledger.live_workers, self.job, ttl=ttl)
                budget.saw_spent(*spent, workers=len(live))

    async def _heartbeat(self) -> None:
        while True:
            await self._share_budget()
            await self._watch_spending()
            await anyio.sleep(self.settings.lease_ttl / 3)
            await self.feeder.recheck()  # first, after a silence past the lease
            began = self.settings.clock()
            reclaimed = await self._db(
                self.ledger.heartbeat,
                self.job,
                self.owner,
                lease_ttl=self.settings.lease_ttl,
                progress=(self.stats.recorded, self.stats.requests),
                limits=list(self._limit_log),
                endpoints=self._endpoints(),
            )
            self.feeder.beat_at = began  # its leases renewed from then on
            if reclaimed:  # a worker that is gone left these: back to pending, for anyone
                self.log.event("reclaimed", items=reclaimed)

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
                    self.feeder.answered()
                    continue  # left running; released to pending when the run ends
                result = await self.sender.process(item)
                self.feeder.answered()
                if result is not None:
                    results.send_nowait(result)  # unbounded: never drops a finished result
                    self._given += 1

    def _adjust(self, endpoint: str, change: Change) -> None:
        """A reported move of an adaptive limit: to the progress bar, `status` and the log."""
        limit = self.fleet.limit
        self._limit_log.append((round(time.time(), 3), limit, change.reason))
        if self.progress is not None:
            self.progress.concurrency = limit
        named = {} if len(self.routes) == 1 else {"endpoint": endpoint}
        self.log.event(
            "concurrency", limit=change.limit, reason=change.reason, signal=change.signal, **named
        )

    async def _commit(self, group: list[ItemResult]) -> None:
        if not group:
            return
        recorded = await self._db(  # the group's, and the repeated lines that waited for it
            self.ledger.record, self.job, self.owner, group, answer_spec=self.answer_spec
        )
        for result in group:
            self.feeder.held.pop(result.line, None)
        self._committed += len(group)
        self.stats.recorded += recorded.finished
        for status, count in recorded.by_status.items():
            self.stats.by_status[status] = self.stats.by_status.get(status, 0) + count
        self.log.flush()
        if self.progress is not None:
            self._report_progress(max(len(group), recorded.finished))

    def _report_progress(self, newly_done: int) -> None:
        assert self.progress is not None
        self.progress.update(
            newly_done=newly_done,
            tokens=self.stats.output_tokens,
            retries=self.stats.retries,
            failed=sum(self.stats.by_status.get(s, 0) for s in ("failed", "invalid")),
        )
