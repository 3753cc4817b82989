"""Joining a job that other workers run: the check that they ask for the same answers
(check_same), the join itself (join_as), and the join again of a worker back from a silence
past its lease (rejoin). A caller that waited for the job's lock forgives the others as long a
silence: their heartbeats waited for the same lock."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import orjson
from sqlalchemy import Connection, and_, case, func, select, update

from batchrun.errors import OptionError
from batchrun.ledger.rows import as_json
from batchrun.ledger.schema import items, jobs, workers
from batchrun.ledger.workers import db_now, join, leased, listed, lock_job, not_collected


@dataclass(frozen=True)
class Joining:
    """A run about to join a job: its spec, the keys of it that must agree with the job's
    while other workers run it, and how long a silent worker counts as live. With `worker`,
    the run joins as it (the runner's own id) in the same transaction as what it then
    changes: a run that checked before another joined is never let in beside it."""

    spec: dict[str, Any]
    same: tuple[str, ...]
    ttl: float
    worker: str | None = None


def locked(conn: Connection, name: str, since: float) -> float:
    """Take the job's row first (lock_job); how long the caller has waited since `since`, its
    wait for SQLite's write lock included: the others' heartbeats waited as long."""
    lock_job(conn, name)
    return time.monotonic() - since


def checked(conn: Connection, name: str, joining: Joining, *, waited: float) -> None:
    """Before a run's copies (Ledger.prepare_reuse): it joins as `joining.worker` where it has
    one (the runner's join reclaims what dead workers held, after the copies, as ever), else
    only the check its join will make."""
    if joining.worker is not None:
        join_as(conn, name, joining.worker, joining, store=True, reclaim_dead=False, waited=waited)
    else:
        check_same(conn, name, joining.spec, joining.same, ttl=joining.ttl, waited=waited)


def check_same(
    conn: Connection,
    name: str,
    spec: dict[str, Any],
    same: tuple[str, ...],
    *,
    ttl: float,
    worker: str | None = None,
    waited: float = 0.0,
) -> int:
    """Joining `name` with `spec` while other workers run it: the keys in `same` (the options
    that change an answer) must agree with the job's, or OptionError says which differ. How
    many other workers (than `worker`) run it. A caller that `waited` for the job's lock
    forgives as long a silence: the others' heartbeats waited for the same lock."""
    now = db_now(conn) - waited
    live = listed(conn, name, live=True)
    others = sum(w.alive(now, ttl) for w in live if w.id != worker)
    row = conn.execute(select(jobs.c.spec).where(jobs.c.name == name)).first()
    if not others or row is None:
        return others
    theirs = orjson.loads(row.spec)
    differ = [key for key in same if _differ(theirs.get(key), spec.get(key))]
    if differ:
        said = "; ".join(
            f"{{{key}}} {_shown(spec.get(key))} here, {_shown(theirs.get(key))} there"
            for key in differ
        )
        raise OptionError(
            f"job {OptionError.quoted(name)} is being run by {others} other worker(s) that ask "
            f"for other answers: {said}. Join with the same options, or after they finish."
        )
    return others


def _differ(theirs: Any, mine: Any) -> bool:
    """Options that disagree; a mapping (a model per endpoint) where both name one for a key."""
    if not (isinstance(theirs, dict) and isinstance(mine, dict)):
        return bool(theirs != mine)
    return any(None is not theirs[k] != mine[k] is not None for k in theirs.keys() & mine.keys())


def _shown(value: object) -> str:
    return "(not set)" if value is None else OptionError.quoted(value)


def join_as(
    conn: Connection,
    name: str,
    worker: str,
    joining: Joining,
    *,
    store: bool,
    reclaim_dead: bool = True,
    waited: float = 0.0,
) -> int:
    """`worker` joins the job (see Ledger.join): its spec checked against the live workers'
    on `joining.same`, and stored when `store` and it is alone (beside others, its own URL,
    pacing and budget would become the job's, for the next plain `resume` on another host);
    how many items dead workers left came back. A join that `waited` past the lease for the
    job's lock reclaims nobody: their beats waited as long (the next beat looks again)."""
    ttl, others = joining.ttl, 0
    if joining.same:
        lock_job(conn, name)
        others = check_same(
            conn, name, joining.spec, joining.same, ttl=ttl, worker=worker, waited=waited
        )
    # the job's row is locked first
    back = join(conn, name, worker, ttl=ttl, reclaim_dead=reclaim_dead and waited < ttl)
    if store and not others:
        stored = {"spec": as_json(joining.spec), "updated_at": time.time()}
        conn.execute(update(jobs).where(jobs.c.name == name).values(**stored))
    return back


def rejoin(conn: Connection, name: str, joining: Joining, *, waited: float = 0.0) -> set[int]:
    """Ledger.rejoin. Back from a silence past the lease, the ledger may have been away for all:
    every worker still running gets a lease's grace, its own (beat, leases; none is cut), or
    this one's next beat would judge them by a silence they could not help, and take items
    they have answers for. A job `gc` collected meanwhile is refused, as a join is."""
    worker, ttl = joining.worker or "", joining.ttl  # (a worker's id: never "")
    lock_job(conn, name)
    not_collected(conn, name)
    check_same(conn, name, joining.spec, joining.same, ttl=ttl, worker=worker, waited=waited)
    now, me = db_now(conn), workers.c.id == worker
    last = conn.execute(select(workers.c.heartbeat).where(me)).scalar()
    conn.execute(update(workers).where(me).values(stopped_at=None))
    if last is None or now - last > ttl:
        me = and_(workers.c.job == name, workers.c.stopped_at.is_(None))  # and the others
    conn.execute(update(workers).where(me).values(heartbeat=now))
    theirs = items.c.owner.in_(select(workers.c.id).where(me))
    own = select(workers.c.lease).where(workers.c.id == items.c.owner).scalar_subquery()
    grace, later = now + func.coalesce(own, ttl), items.c.lease_expires
    expires = case((later > grace, later), else_=grace)  # its lease, where that is later
    conn.execute(update(items).where(leased(name, None), theirs).values(lease_expires=expires))
    return set(conn.execute(select(items.c.line).where(leased(name, worker))).scalars())
