"""Several processes on one job: each joins as a worker (a row with its host, pid and heartbeat),
leases items in small batches, and leaves. A worker whose heartbeat stops (killed, frozen, its
machine gone) loses its leases to the live ones once they expire, or at once when it ran in the
same process namespace of the same boot of the same machine and its process is gone. A result
is committed only under the lease that claimed it (store.record), so a worker that wakes up
after its items went to another commits nothing for them and carries on with new claims.

Time is the database's (`db_now`): hosts' clocks may differ, the server's is one. Writes that
may touch other workers' items lock the job's row first, in the same order everywhere.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import orjson
from sqlalchemy import (
    Connection,
    and_,
    bindparam,
    exists,
    func,
    literal_column,
    or_,
    select,
    update,
)
from sqlalchemy.sql.elements import ColumnElement

from batchrun.errors import UsageError
from batchrun.ledger.dialect import dialect_of
from batchrun.ledger.records import ClaimedItem, Spent
from batchrun.ledger.rows import CLAIMED_COLUMNS, claimed_of
from batchrun.ledger.schema import items, jobs, workers


@dataclass(frozen=True)
class Worker:
    """A worker as `status` shows it."""

    id: str
    host: str
    machine: str  # this boot of this machine, in this pid namespace (see `this_machine`)
    pid: int
    started_at: float
    heartbeat: float
    stopped_at: float | None
    recorded: int
    requests: int
    endpoints: dict[str, Any] | None = None  # name -> state, answered, errors, limit, reason
    lease: float | None = None  # its own --lease (None: a worker from before migration 9)

    def alive(self, now: float, ttl: float) -> bool:
        """Running, by the evidence: not stopped, a heartbeat within its own lease (`ttl`
        where it has none on record), and (where its pid means something to us) its process
        still there."""
        if self.stopped_at is not None or now - self.heartbeat > (self.lease or ttl):
            return False
        return self.machine != this_machine() or pid_alive(self.pid)

    def took_part(self, started: float, ttl: float) -> bool:
        """Whether it ran during a run that began at `started`: it beat since (a leave beats
        too), or it beat within its lease before and its process is still there (one that
        joined a moment before beats next 20 s on); not one dead before (killed, its pid gone:
        that run's reclaim marked it stopped since), nor one stopped before."""
        if self.stopped_at is not None and self.stopped_at < started:
            return False
        if self.heartbeat >= started:
            return True
        here = self.machine == this_machine()
        alive = pid_alive(self.pid) if here else self.stopped_at is None
        return alive and self.heartbeat + (self.lease or ttl) >= started


@cache
def this_machine() -> str:
    """Who can check a pid: the hostname alone is shared by containers and cloned images, so
    the kernel's boot id and our pid namespace go with it."""
    parts = [socket.gethostname()]
    try:
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
        parts.append(os.readlink("/proc/self/ns/pid"))
    except OSError:  # not Linux: the hostname alone
        pass
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def db_now(conn: Connection) -> float:
    """The clock leases are written in (PostgreSQL's, for every host alike)."""
    return dialect_of(conn).now(conn)


def lock_job(conn: Connection, name: str) -> None:
    """Take the job first: joins, heartbeats and reclaims of one job never deadlock."""
    dialect_of(conn).lock_job(conn, name)


def join(conn: Connection, name: str, worker: str, *, ttl: float, reclaim_dead: bool = True) -> int:
    """Add `worker` to the job and reclaim what dead workers left; how many items went back
    (none without `reclaim_dead`: the runner's own join, later, does it and says so). A job
    `gc` collected since the caller looked is refused: its rest and results are gone."""
    lock_job(conn, name)
    not_collected(conn, name)
    now = db_now(conn)
    row = {"host": socket.gethostname(), "machine": this_machine(), "pid": os.getpid()}
    known = select(workers.c.id).where(workers.c.id == worker)
    if conn.execute(known).first() is None:
        values = {"id": worker, "job": name, "started_at": now, "heartbeat": now, **row}
        conn.execute(workers.insert().values(lease=ttl, **values))
    else:  # joined already: a join whose answer was lost with the connection, tried again
        conn.execute(update(workers).where(workers.c.id == worker).values(heartbeat=now))
    return reclaim(conn, name, worker, ttl=ttl) if reclaim_dead else 0


def not_collected(conn: Connection, name: str) -> None:
    """Refuse a job `gc` collected since the caller looked: its rest and results are gone."""
    kept = conn.execute(select(jobs.c.collected_at).where(jobs.c.name == name)).first()
    if kept is None or kept[0] is not None:
        raise UsageError(
            f"job {name!r} was collected by `gc` as this run started: its rest and results are "
            "gone; submit the file under another name (--job NAME) to reuse the answers kept"
        )


def reclaim(conn: Connection, name: str, worker: str, *, ttl: float) -> int:
    """Items leased by workers that are gone go back to pending: their lease ran out, their
    process is gone, or they belong to no worker (a runner from before workers)."""
    now = db_now(conn)
    gone = [w.id for w in listed(conn, name, live=True) if w.id != worker and not w.alive(now, ttl)]
    expired = and_(items.c.lease_expires.is_not(None), items.c.lease_expires < now)
    unknown = ~exists().where(workers.c.id == items.c.owner)
    stmt = (
        update(items)
        .where(items.c.job == name, items.c.status == "running", items.c.owner != worker)
        .where(or_(expired, items.c.owner.in_(gone), unknown))
        .values(status="pending", owner=None, lease_expires=None, updated_at=now)
    )
    back = conn.execute(stmt).rowcount
    if gone:  # say so in `status`: their heartbeat will not come
        conn.execute(update(workers).where(workers.c.id.in_(gone)).values(stopped_at=now))
    return int(back)


def beat(
    conn: Connection, name: str, worker: str, *, lease_ttl: float, progress: tuple[int, int]
) -> float:
    """The worker is alive: its heartbeat, its counts (results, requests), its leases renewed.
    If it was taken for gone while frozen, it is back (its old leases are not). Returns the
    seconds since its last beat."""
    recorded, requests = progress
    now = db_now(conn)
    last = conn.execute(select(workers.c.heartbeat).where(workers.c.id == worker)).scalar()
    conn.execute(
        update(workers)
        .where(workers.c.id == worker)
        .values(heartbeat=now, stopped_at=None, recorded=recorded, requests=requests)
    )
    # A running job is touched: `gc` takes a job untouched for its age for abandoned.
    conn.execute(update(jobs).where(jobs.c.name == name).values(updated_at=time.time()))
    conn.execute(update(items).where(leased(name, worker)).values(lease_expires=now + lease_ttl))
    return now - last if last is not None else 0.0


def leased(name: str, worker: str | None) -> ColumnElement[bool]:
    """The items `worker` holds (leased, not yet answered); None: any worker."""
    held = and_(items.c.job == name, items.c.status == "running")
    return held if worker is None else and_(held, items.c.owner == worker)


def claim(
    conn: Connection,
    name: str,
    owner: str,
    limit: int,
    *,
    lease_ttl: float,
    after: int,
    by_prefix: bool,
) -> list[ClaimedItem]:
    """Ledger.claim's query: the next pending items in claim order, leased to `owner`."""
    place = items.c.sched if by_prefix else items.c.line
    # a literal, not a parameter: SQLite then uses the partial index of pending items
    pending: ColumnElement[str] = literal_column("'pending'")
    claimable = dialect_of(conn).claimable(
        select(items.c.line)
        .where(items.c.job == name, place > after, items.c.status == pending)
        .where(items.c.dup_of.is_(None))  # a duplicate waits for its first line's answer
        .order_by(place)
        .limit(limit)
    )
    stmt = (
        update(items)
        # status again here: PostgreSQL re-checks only the outer WHERE after a row lock
        .where(
            items.c.job == name,
            items.c.line.in_(select(claimable.c.line)),
            items.c.status == "pending",
        )
        .values(
            status="running",
            owner=owner,
            lease_expires=bindparam("expires"),
            updated_at=bindparam("now"),
        )
        .returning(*CLAIMED_COLUMNS)
    )
    now = db_now(conn)  # leases in the database's time, for every host alike
    rows = conn.execute(stmt, {"expires": now + lease_ttl, "now": now}).all()
    claimed = (claimed_of(row) for row in rows)
    return sorted(claimed, key=lambda c: c.sched if by_prefix else c.line)


def note_endpoints(conn: Connection, worker: str, endpoints: dict[str, Any] | None) -> None:
    """Its endpoints as it sees them (state, answered, errors, limit), for `status`."""
    if endpoints:
        value = orjson.dumps(endpoints).decode()
        conn.execute(update(workers).where(workers.c.id == worker).values(endpoints=value))


def leave(
    conn: Connection,
    name: str,
    worker: str,
    *,
    progress: tuple[int, int],
    spent: list[Spent] | None = None,
) -> int:
    """The worker stops: its unfinished claims go back to pending, with what it `spent` on
    them (requests sent, attempts charged); how many."""
    now = db_now(conn)
    recorded, requests = progress
    if spent:
        mine = (items.c.job == name, items.c.owner == worker, items.c.status == "running")
        stmt = (
            update(items)
            .where(*mine, items.c.line == bindparam("b_line"))
            .values(attempts=items.c.attempts + bindparam("b_sent"), charged=bindparam("b_charged"))
        )
        rows = [{"b_line": s.line, "b_sent": s.requests, "b_charged": s.charged} for s in spent]
        conn.execute(stmt, rows)
    back = conn.execute(
        update(items)
        .where(items.c.job == name, items.c.owner == worker, items.c.status == "running")
        .values(status="pending", owner=None, lease_expires=None, updated_at=now)
    ).rowcount
    conn.execute(
        update(workers)
        .where(workers.c.id == worker)
        .values(stopped_at=now, heartbeat=now, recorded=recorded, requests=requests)
    )
    return int(back)


def put_back_strays(conn: Connection, name: str, worker: str, held: set[int]) -> int:
    """Items leased to `worker` that it does not hold (a claim whose commit reached the
    database while the answer was lost with the connection) go back to pending; how many."""
    mine = select(items.c.line).where(
        items.c.job == name, items.c.owner == worker, items.c.status == "running"
    )
    strays = [line for line in conn.execute(mine).scalars() if line not in held]
    if not strays:
        return 0
    back = conn.execute(
        update(items)
        .where(items.c.job == name, items.c.owner == worker, items.c.line.in_(strays))
        .where(items.c.status == "running")
        .values(status="pending", owner=None, lease_expires=None, updated_at=db_now(conn))
    )
    return int(back.rowcount)


def more_may_come(conn: Connection, name: str, worker: str) -> bool:
    """Nothing was claimed: is there more? Items pending (put back behind the claims by a
    worker that left, or reclaimed), or held by other workers (they may come back); lines that
    wait for another line's answer are not asked about here (reuse.waiting_on). A read."""
    left = or_(
        and_(items.c.status == "pending", items.c.dup_of.is_(None)),
        and_(items.c.status == "running", items.c.owner != worker),
    )
    found = conn.execute(select(items.c.line).where(items.c.job == name, left).limit(1)).first()
    return found is not None


def listed(conn: Connection, name: str, *, live: bool = False) -> list[Worker]:
    """The job's workers, oldest first; `live`: only those not stopped (the history of nightly
    runs is not read on every heartbeat)."""
    query = select(
        workers.c.id,
        workers.c.host,
        workers.c.machine,
        workers.c.pid,
        workers.c.started_at,
        workers.c.heartbeat,
        workers.c.stopped_at,
        workers.c.recorded,
        workers.c.requests,
        workers.c.endpoints,
        workers.c.lease,
    ).where(workers.c.job == name)
    if live:
        query = query.where(workers.c.stopped_at.is_(None))
    rows = conn.execute(query.order_by(workers.c.started_at)).all()
    return [
        Worker(**{**row._mapping, "endpoints": orjson.loads(row.endpoints or "null")})
        for row in rows
    ]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def live(conn: Connection, name: str, *, ttl: float) -> list[str]:
    """Workers of the job that are running now, by their heartbeats (database time) within
    their own leases: their ids, first started first (each worker's rank is the same to all)."""
    fresh = workers.c.heartbeat > db_now(conn) - func.coalesce(workers.c.lease, ttl)
    query = select(workers.c.id).where(workers.c.job == name, workers.c.stopped_at.is_(None))
    order = (workers.c.started_at, workers.c.id)
    return list(conn.execute(query.where(fresh).order_by(*order)).scalars())
