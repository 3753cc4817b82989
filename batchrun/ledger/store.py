"""The ledger's API: jobs, ingest, the job's runner lock, claims with leases, results, stats.

Every write goes through a guard so that nothing is recorded twice: a result lands only on an
item that is still `running` under the caller's lease, and a job has at most one live runner."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, Engine, select, update
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from batchrun.errors import EmptyInput, InputError, JobExists
from batchrun.ledger import gc, joins, reuse, stats, workers
from batchrun.ledger.chunks import ChunkStore
from batchrun.ledger.dialect import HURRY_OPTION, IDLE_OPTION, WRITE_OPTION, dialect_of
from batchrun.ledger.driver import Many
from batchrun.ledger.engine import shown_ledger, storage_errors
from batchrun.ledger.gc import Collected
from batchrun.ledger.ingest import Loader
from batchrun.ledger.joins import Joining
from batchrun.ledger.migrations import ready_engine
from batchrun.ledger.records import (
    BadLine,
    ClaimedItem,
    IngestReport,
    InputItem,
    ItemResult,
    Job,
    LimitMove,
    Recorded,
    Spent,
    StoredItem,
)
from batchrun.ledger.rows import (
    STORED_COLUMNS,
    as_json,
    job_of,
    recording,
    requeueing,
    result_row,
    stored_of,
)
from batchrun.ledger.schema import OPEN_STATUSES, items, jobs
from batchrun.ledger.workers import Worker


class Ledger:
    def __init__(self, url: str, engine: Engine | None = None, *, patience: float = 0.0) -> None:
        self.url = url  # `patience`: how long a database out of reach is waited for, opening
        self.engine = ready_engine(url, engine, patience=patience)
        self.dialect = dialect_of(self.engine)
        self.where = shown_ledger(url)  # errors name it
        self.chunks = ChunkStore(self)  # hosted Batch API batches (chunks.py)
        self._recorders: dict[bool, Many] = {}  # record's statement, by `batched`
        self.hurried = False  # a run told to stop now: its writes wait 1 s for SQLite's lock
        self.idle_ms = 0  # while a run is joined: its lease, the longest a write may sit idle

    def close(self) -> None:
        self.engine.dispose()

    @contextmanager
    def _write(self, action: str) -> Iterator[Connection]:
        """A write transaction: BEGIN IMMEDIATE on SQLite, so it holds the lock from the start."""
        options = {WRITE_OPTION: True, HURRY_OPTION: self.hurried, IDLE_OPTION: self.idle_ms}
        with storage_errors(action, self.dialect, self.where), self.engine.connect() as conn:
            conn.execution_options(**options)
            with conn.begin():
                yield conn

    @contextmanager
    def _read(self, action: str) -> Iterator[Connection]:
        """A read: a deferred transaction, which never waits for a writer in WAL mode."""
        with storage_errors(action, self.dialect, self.where), self.engine.connect() as conn:
            yield conn

    # --- jobs ------------------------------------------------------------------------------

    def get_job(self, name: str) -> Job | None:
        with self._read("reading a job") as conn:
            row = conn.execute(select(jobs).where(jobs.c.name == name)).mappings().first()
        return job_of(row) if row else None

    def list_jobs(self) -> list[Job]:
        with self._read("listing jobs") as conn:
            rows = conn.execute(select(jobs).order_by(jobs.c.created_at)).mappings().all()
        return [job_of(r) for r in rows]

    def mark_finished(self, name: str, finished: bool) -> bool:
        """Mark the job finished (or not); True when this call finished it. Not while an item
        is open: a `retry` since the caller looked has put items back, and they are to come."""
        now = time.time()
        with self._write("updating a job") as conn:
            if not finished:
                return False  # a job is unfinished again only when items are requeued
            open_item = select(items.c.line).where(
                items.c.job == name, items.c.status.in_(OPEN_STATUSES)
            )
            first = update(jobs).where(
                jobs.c.name == name, jobs.c.finished_at.is_(None), ~open_item.exists()
            )
            return bool(conn.execute(first.values(finished_at=now, updated_at=now)).rowcount)

    def create_job(
        self,
        name: str,
        *,
        input_path: str,
        input_digest: str | Callable[[], str],
        spec: dict[str, Any],
        lines: Iterable[InputItem | BadLine],
        skip_invalid: bool,
    ) -> IngestReport:
        """Create the job and load every line in one transaction: all of it, or nothing.

        Without skip_invalid, any bad line (duplicate ids included) rolls everything back and
        raises InputError listing every problem found. `input_digest` may be a callable, read
        after `lines` is exhausted, so a streaming reader can hash the file as it goes."""
        now = time.time()
        with self._write("loading the input") as conn:
            if conn.execute(select(jobs.c.name).where(jobs.c.name == name)).first():
                raise JobExists(f"job {name!r} already exists")
            row = {"name": name, "input_path": input_path, "spec": as_json(spec), "total": 0}
            new_job = jobs.insert().values(input_digest="", created_at=now, updated_at=now, **row)
            try:
                conn.execute(new_job)
            except IntegrityError:  # PostgreSQL: another process made it since we looked
                raise JobExists(f"job {name!r} already exists") from None
            loader = Loader(conn, name, now, skip_invalid=skip_invalid)
            for entry in lines:
                loader.add(entry)
            loader.flush()
            problems, accepted, rejected = loader.problems, loader.accepted, loader.rejected
            # Raising inside the transaction rolls all of it back: no job, no items.
            if problems and not skip_invalid:
                problems.sort()
                raise InputError(problems, path=input_path)
            if accepted + rejected == 0:
                raise EmptyInput(f"{input_path}: no items (the file is empty or only blank lines)")
            digest = input_digest() if callable(input_digest) else input_digest
            conn.execute(
                update(jobs)
                .where(jobs.c.name == name)
                .values(total=accepted + rejected, input_digest=digest)
            )
        with contextlib.suppress(SQLAlchemyError):  # statistics only (autovacuum's, later): a
            self.dialect.loaded(self.engine)  # connection lost now loses no part of the load
        groups = loader.grouper
        return IngestReport(accepted, rejected, groups=groups.groups, grouped=groups.grouped)

    # --- workers: the processes that run the job together (workers.py) -----------------------

    def join(
        self,
        name: str,
        worker: str,
        *,
        ttl: float,
        spec: dict[str, Any] | None = None,
        same: tuple[str, ...] = (),
    ) -> int:
        """Join the job as `worker`, recording this run's spec (`status` shows the latest);
        items that dead workers held go back to pending: how many. While other workers run
        the job, `spec` must agree with the job's on the keys in `same` (the options that
        change an answer), or OptionError says which differ, and nothing changes."""
        began, joining, stored = time.monotonic(), Joining(spec or {}, same, ttl), spec is not None
        with self._write("joining the job") as conn:
            waited = joins.locked(conn, name, began)
            back = joins.join_as(conn, name, worker, joining, store=stored, waited=waited)
        self.idle_ms = max(1000, int(ttl * 1000))  # joined: the run's writes (dialect.py)
        return back

    def rejoin(self, name: str, joining: Joining) -> set[int]:
        """A worker back after a silence past its lease, checked as a join is, its leases
        renewed: the lines it still holds (others may hold the rest now). See joins.rejoin."""
        began = time.monotonic()
        with self._write("joining again") as conn:
            return joins.rejoin(conn, name, joining, waited=joins.locked(conn, name, began))

    def heartbeat(
        self,
        name: str,
        worker: str,
        *,
        lease_ttl: float,
        progress: tuple[int, int] = (0, 0),
        limits: list[LimitMove] | None = None,
        endpoints: dict[str, Any] | None = None,
    ) -> int:
        """The worker is alive (its leases renewed, its results and requests counted, the
        adaptive limit's history and its endpoints' states noted); leases of workers that
        are gone are reclaimed: how many items went back to pending."""
        with self._write("renewing leases") as conn:
            workers.lock_job(conn, name)
            if limits:
                conn.execute(
                    update(jobs).where(jobs.c.name == name).values(limit_history=as_json(limits))
                )
            away = workers.beat(conn, name, worker, lease_ttl=lease_ttl, progress=progress)
            workers.note_endpoints(conn, worker, endpoints)
            if away > lease_ttl:  # its own beat was kept away as long (a ledger locked past
                return 0  # the lease): the others' too, and they are not judged by it now
            return workers.reclaim(conn, name, worker, ttl=lease_ttl)

    def release(
        self,
        name: str,
        worker: str,
        *,
        progress: tuple[int, int] = (0, 0),
        limits: list[LimitMove] | None = None,
        endpoints: dict[str, Any] | None = None,
        spent: list[Spent] | None = None,
    ) -> int:
        """The worker leaves: its unfinished claims go back to pending, `spent` kept; how many."""
        self.idle_ms = 0  # the run is over: a load's gaps are its input's
        with self._write("releasing the job") as conn:
            workers.lock_job(conn, name)
            if limits:
                conn.execute(
                    update(jobs).where(jobs.c.name == name).values(limit_history=as_json(limits))
                )
            workers.note_endpoints(conn, worker, endpoints)
            return workers.leave(conn, name, worker, progress=progress, spent=spent)

    def put_back_strays(self, name: str, worker: str, held: set[int]) -> int:
        """Items leased to `worker` beyond `held` (the lines it knows it claimed) go back to
        pending: after a connection lost mid-claim, the claim may have committed unseen."""
        with self._write("putting back unseen claims") as conn:
            return workers.put_back_strays(conn, name, worker, held)

    def more_may_come(self, name: str, worker: str) -> bool:
        """Nothing was claimed: whether items are pending (put back behind this worker's
        claims) or held by others (they may come back). A read: idle workers do not hold the
        write lock; heartbeats reclaim what dead workers held."""
        with self._read("looking for unfinished work") as conn:
            if workers.more_may_come(conn, name, worker):
                return True
            stray, coming = reuse.waiting_on(conn, name)
        if stray:  # a write only when one is there (see settle_strays)
            with self._write("answering repeated lines") as conn:
                reuse.settle_strays(conn, name, time.time())
        return stray or coming

    def live_workers(self, name: str, *, ttl: float) -> list[str]:
        """The ids of the job's workers running now, first started first."""
        with self._read("counting workers") as conn:
            return workers.live(conn, name, ttl=ttl)

    def workers(self, name: str) -> list[Worker]:
        with self._read("listing workers") as conn:
            return workers.listed(conn, name)

    def now(self) -> float:  # the clock of workers' times: the database's (hosts differ)
        with self._read("reading the clock") as conn:
            return workers.db_now(conn)

    # --- items ------------------------------------------------------------------------------

    def claim(
        self,
        name: str,
        owner: str,
        limit: int,
        *,
        lease_ttl: float,
        after: int = -1,
        by_prefix: bool = True,
    ) -> list[ClaimedItem]:
        """Lease up to `limit` pending items placed after `after` in the claim order: lines
        that share a long prompt prefix together (prefixes.py; `after` a `sched`), or input
        order (`by_prefix` False; `after` a line).

        A runner passes the last place it claimed, so each claim is a short range scan of an
        index instead of a walk over every finished item before it."""
        with self._write("claiming items") as conn:
            return workers.claim(
                conn, name, owner, limit, lease_ttl=lease_ttl, after=after, by_prefix=by_prefix
            )

    def record(
        self,
        name: str,
        owner: str,
        results: list[ItemResult],
        *,
        answer_spec: str | None = None,
        chunk: int | None = None,
    ) -> Recorded:
        """Commit a group of results in one transaction, made under `answer_spec` (see
        reuse.py); lines waiting for the same request get them too. Returns the items it
        finished: the group's rows that changed, and the lines that waited for them. The guard
        (still running, still ours; or with `chunk`, still in that hosted batch) makes a late
        or duplicate result a no-op."""
        if not results:
            return Recorded({})
        now = time.time()
        head = (name, owner if chunk is None else chunk, now)
        rows = [result_row(head, r, answer_spec) for r in results]
        with self._write("recording results") as conn:
            changed = int(self._recording(conn, chunk is not None).run(conn, rows).rowcount)
            return Recorded(reuse.finished(conn, name, results, changed, now))

    def _recording(self, conn: Connection, batched: bool) -> Many:
        """record's statement, compiled once for this ledger's database."""
        if batched not in self._recorders:
            stmt, names = recording(batched=batched)
            self._recorders[batched] = Many.compile(stmt, conn.dialect, names)
        return self._recorders[batched]

    def prepare_reuse(
        self,
        name: str,
        keys: reuse.Keys | None,
        *,
        reuse_since: float | None,
        earlier: bool = True,
        joining: Joining | None = None,
    ) -> tuple[int, int]:
        """Before a run: lines that repeat an earlier line's request wait for its answer, and
        (with `earlier`) pending items that an earlier job answered under the same options
        (made at `reuse_since` or later) take that answer. (waiting, reused). `keys` None
        (--no-reuse): lines a run before left waiting for a repeat are sent instead. With
        `joining`, first the check `join` makes: a run that other workers would refuse (it
        asks for other answers) changes nothing in their job (OptionError)."""
        began = time.monotonic()
        with self._write("looking for answers to reuse") as conn:
            waited = joins.locked(conn, name, began)
            if joining is not None:  # the runner's join reclaims what dead workers held, later
                joins.checked(conn, name, joining, waited=waited)
            if keys is None:
                reuse.forget_duplicates(conn, name)
                return 0, 0
            waiting = reuse.mark_duplicates(conn, name)
            if not earlier:
                return waiting, 0
            now = time.time()
            reused = reuse.reuse_earlier(conn, name, keys, since=reuse_since, now=now)
            return reuse.still_waiting(conn, name) if reused else waiting, reused

    def preview(
        self,
        name: str,
        keys: reuse.Keys | None,
        *,
        reuse_since: float | None,
        estimate: Callable[[dict[str, Any]], tuple[int, int]],
    ) -> tuple[int, int, int, tuple[int, int]]:
        """What a run would send now (see reuse.preview); a read."""
        with self._read("estimating the job") as conn:
            return reuse.preview(conn, name, keys, since=reuse_since, estimate=estimate)

    def collect(self, *, before: float, everything: bool, ttl: float) -> Collected:
        """Remove jobs untouched since `before` that no live worker runs (see gc.py); then
        the caller removes their files and gives the space back (reclaim_space)."""
        with self._write("removing old jobs") as conn:
            return gc.collect(conn, before=before, everything=everything, ttl=ttl)

    def reclaim_space(self) -> None:
        with storage_errors("reclaiming space", self.dialect, self.where):
            self.dialect.reclaim_space(self.engine)

    def requeue(self, name: str, statuses: tuple[str, ...] = ("failed", "invalid")) -> int:
        """Put finished-but-unsuccessful items back to pending (the `retry` command). The
        tokens their answers used stay paid for (budgets and `status` count them)."""
        now = time.time()
        with self._write("re-queueing items") as conn:
            count = conn.execute(requeueing(name, statuses, now)).rowcount
            if count:
                conn.execute(
                    update(jobs).where(jobs.c.name == name).values(finished_at=None, updated_at=now)
                )
        return int(count)

    def counts(self, name: str) -> dict[str, int]:
        with self._read("counting items") as conn:
            return stats.counts(conn, name)

    def attempts(self, name: str) -> int:
        """Requests recorded for the job's items, all runs together (0: it never ran)."""
        with self._read("counting attempts") as conn:
            return stats.attempts(conn, name)

    def iter_results(
        self, name: str, batch: int = 2000, *, models: bool = False
    ) -> Iterator[StoredItem]:
        """Every item of the job in input order, streamed in pages (constant memory); with
        `models`, each with the model its line asked for, if any."""
        last, columns = 0, [*STORED_COLUMNS, *([items.c.body] if models else [])]
        while True:
            with self._read("reading results") as conn:
                rows = (
                    conn.execute(
                        select(*columns)
                        .where(items.c.job == name, items.c.line > last)
                        .order_by(items.c.line)
                        .limit(batch)
                    )
                    .mappings()
                    .all()
                )
            if not rows:
                return
            yield from (stored_of(r) for r in rows)
            last = rows[-1]["line"]

    def paid_tokens(self, name: str) -> tuple[int, int]:
        with self._read("counting tokens") as conn:
            return stats.paid_tokens(conn, name)

    def item_stats(self, name: str) -> dict[str, Any]:
        """Token totals, latency percentiles and the commonest errors, for `status`."""
        with self._read("reading stats") as conn:
            return stats.item_stats(conn, name)
