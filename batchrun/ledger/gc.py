"""Retention: old jobs' rows removed, keeping what reuse needs, then the space given back.

A job is old when nothing touched it (`jobs.updated_at`: loads, joins, finishing) for the
given time; a job with a live worker is never touched, however old. Of an old job, the
answers that later jobs may reuse stay: `done` items made by a request (with `answer_spec`),
their request bodies emptied (the digest is what reuse matches). Everything else goes: other
items, reused copies, the workers' rows. With `everything`, the job goes entirely.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Connection, and_, delete, select, update

from batchrun.ledger import workers
from batchrun.ledger.chunks import CLOSED
from batchrun.ledger.schema import chunks, items, jobs, waits
from batchrun.ledger.schema import workers as worker_rows


@dataclass(frozen=True)
class Collected:
    jobs: list[str]  # the old jobs collected
    removed: int  # item rows deleted
    kept: int  # answers kept for reuse (bodies emptied)
    running: list[str]  # old jobs left alone: a worker is running them


def collect(conn: Connection, *, before: float, everything: bool, ttl: float) -> Collected:
    untouched = select(jobs.c.name).where(jobs.c.updated_at < before)
    if not everything:  # a job collected already has nothing more to give
        untouched = untouched.where(jobs.c.collected_at.is_(None))
    old = conn.execute(untouched).scalars().all()
    now = workers.db_now(conn)
    collected: list[str] = []
    running: list[str] = []
    removed = kept = 0
    for name in old:
        workers.lock_job(conn, name)
        if any(w.alive(now, ttl) for w in workers.listed(conn, name, live=True)):
            running.append(name)
            continue
        at_provider = select(chunks.c.chunk).where(
            chunks.c.job == name, chunks.c.state.not_in(CLOSED)
        )
        if conn.execute(at_provider).first() is not None:  # a batch may still answer it
            running.append(name)
            continue
        source = and_(items.c.status == "done", items.c.answer_spec.is_not(None))
        doomed = delete(items).where(items.c.job == name)
        if not everything:
            doomed = doomed.where(~source)
            emptied = update(items).where(items.c.job == name, source)
            kept += int(conn.execute(emptied.values(body="{}", meta=None)).rowcount)
        removed += int(conn.execute(doomed).rowcount)
        conn.execute(delete(worker_rows).where(worker_rows.c.job == name))
        conn.execute(delete(waits).where(waits.c.job == name))
        conn.execute(delete(chunks).where(chunks.c.job == name))
        if everything:
            conn.execute(delete(jobs).where(jobs.c.name == name))
        else:
            conn.execute(update(jobs).where(jobs.c.name == name).values(collected_at=now))
        collected.append(name)
    return Collected(collected, removed, kept, running)
