"""Several processes on one job: each joins as a worker (a row with its host, pid and heartbeat),
leases items in small batches, and leaves. A worker whose heartbeat stops (killed, frozen, its
machine gone) loses its leases to the live ones once they expire, or at once when it ran on the
same host and its process is gone. A result is committed only under the lease that claimed it
(store.record), so a worker that wakes up after its items went to another commits nothing for
them and carries on with new claims.

These take an open write transaction (store.Ledger makes it): BEGIN IMMEDIATE on SQLite, a row
lock on the job on PostgreSQL, so joins and reclaims of one job never interleave.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

from sqlalchemy import Connection, and_, func, or_, select, update

from batchrun.ledger.schema import items, jobs, workers


@dataclass(frozen=True)
class Worker:
    """A worker as `status` shows it."""

    id: str
    host: str
    pid: int
    started_at: float
    heartbeat: float
    stopped_at: float | None
    recorded: int
    requests: int

    def alive(self, now: float, ttl: float) -> bool:
        """Running, by the evidence: not stopped, a recent heartbeat, and (on this host) its
        process still there."""
        if self.stopped_at is not None or now - self.heartbeat > ttl:
            return False
        return self.host != socket.gethostname() or pid_alive(self.pid)


def join(conn: Connection, name: str, worker: str, *, ttl: float, now: float) -> int:
    """Add `worker` to the job and reclaim what dead workers left; how many items went back."""
    conn.execute(select(jobs.c.name).where(jobs.c.name == name).with_for_update()).first()
    host = socket.gethostname()
    conn.execute(
        workers.insert().values(
            id=worker, job=name, host=host, pid=os.getpid(), started_at=now, heartbeat=now
        )
    )
    return reclaim(conn, name, worker, ttl=ttl, now=now)


def reclaim(conn: Connection, name: str, worker: str, *, ttl: float, now: float) -> int:
    """Items leased by workers that are gone go back to pending: their lease ran out, or their
    worker ran on this host and its process is gone (no need to wait out a kill -9 here)."""
    gone = [w.id for w in listed(conn, name) if w.id != worker and not w.alive(now, ttl)]
    expired = and_(items.c.lease_expires.is_not(None), items.c.lease_expires < now)
    stmt = (
        update(items)
        .where(items.c.job == name, items.c.status == "running", items.c.owner != worker)
        .where(or_(expired, items.c.owner.in_(gone), items.c.owner.not_in(_known(conn, name))))
        .values(status="pending", owner=None, lease_expires=None, updated_at=now)
    )
    back = conn.execute(stmt).rowcount
    if gone:  # say so in `status`: their heartbeat will not come
        conn.execute(
            update(workers)
            .where(workers.c.id.in_(gone), workers.c.stopped_at.is_(None))
            .values(stopped_at=now)
        )
    return int(back)


def _known(conn: Connection, name: str) -> list[str]:
    """Every worker that ever joined the job (an owner not among them is a runner from before
    workers: its items are reclaimed as a dead worker's)."""
    return list(conn.execute(select(workers.c.id).where(workers.c.job == name)).scalars())


def beat(
    conn: Connection, name: str, worker: str, *, lease_ttl: float, progress: tuple[int, int]
) -> None:
    """The worker is alive: its heartbeat, its counts (results, requests), its leases renewed."""
    recorded, requests = progress
    moment = time.time()
    conn.execute(
        update(workers)
        .where(workers.c.id == worker)
        # alive: if it was taken for gone while frozen, it is back (its old leases are not)
        .values(heartbeat=moment, stopped_at=None, recorded=recorded, requests=requests)
    )
    conn.execute(
        update(items)
        .where(items.c.job == name, items.c.owner == worker, items.c.status == "running")
        .values(lease_expires=moment + lease_ttl)
    )


def leave(conn: Connection, name: str, worker: str, *, progress: tuple[int, int]) -> int:
    """The worker stops: its unfinished claims go back to pending; how many."""
    moment = time.time()
    recorded, requests = progress
    back = conn.execute(
        update(items)
        .where(items.c.job == name, items.c.owner == worker, items.c.status == "running")
        .values(status="pending", owner=None, lease_expires=None, updated_at=moment)
    ).rowcount
    conn.execute(
        update(workers)
        .where(workers.c.id == worker)
        .values(stopped_at=moment, heartbeat=moment, recorded=recorded, requests=requests)
    )
    return int(back)


def others_running(conn: Connection, name: str, worker: str) -> int:
    """Items other workers hold now: they may come back to pending, so a worker with nothing
    to claim waits for them rather than leaving them to a dead worker's lease."""
    count = conn.execute(
        select(func.count())
        .select_from(items)
        .where(items.c.job == name, items.c.status == "running", items.c.owner != worker)
    ).scalar()
    return int(count or 0)


def listed(conn: Connection, name: str) -> list[Worker]:
    rows = conn.execute(
        select(
            workers.c.id,
            workers.c.host,
            workers.c.pid,
            workers.c.started_at,
            workers.c.heartbeat,
            workers.c.stopped_at,
            workers.c.recorded,
            workers.c.requests,
        )
        .where(workers.c.job == name)
        .order_by(workers.c.started_at)
    ).all()
    return [Worker(*row) for row in rows]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
