"""A job's hosted Batch API chunks: which items went out in which batch, and how far each got.

A chunk's row and its items' `batched` status are written in one transaction before anything
is uploaded; the provider's file id and batch id are each recorded as soon as they are known.
Items of a chunk are neither claimed nor reclaimed by online workers; when the chunk's results
are recorded, what it did not answer goes back to pending.
"""

from __future__ import annotations

import os
import secrets
import time
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import orjson
from sqlalchemy import and_, bindparam, func, insert, or_, select, update

from batchrun.ledger.records import ClaimedItem
from batchrun.ledger.rows import CLAIMED_COLUMNS, claimed_of
from batchrun.ledger.schema import chunks, items
from batchrun.ledger.workers import pid_alive, this_machine

CLOSED = ("collected",)


def run_owner() -> str:
    """Who submits a chunk: this machine (boot, pid namespace), this process, this run."""
    return f"{this_machine()}|{os.getpid()}|{uuid.uuid4().hex[:8]}"


def _alive(owner: str) -> bool:
    """Whether the run named `owner` may still be submitting (unknown machines: yes)."""
    machine, _, rest = owner.partition("|")
    pid = rest.partition("|")[0]
    return (
        machine != this_machine() or not pid.isdigit() or pid_alive(int(pid))
    )  # results recorded and the rest put back: nothing more to do


@dataclass(frozen=True)
class Chunk:
    job: str
    chunk: int
    state: str  # intent, validating, in_progress, finalizing, completed, expired, ...
    key: str  # in the batch's metadata: what a run looks for to adopt it
    created_at: float
    input_file: str | None
    batch_id: str | None
    lines: int
    counts: dict[str, Any] | None


class ChunkStore:
    """The chunk verbs, over a Ledger's connections (`ledger.chunks`)."""

    def __init__(self, ledger: Any) -> None:
        self._ledger = ledger

    def listed(self, job: str, *, open_only: bool = False) -> list[Chunk]:
        query = select(chunks).where(chunks.c.job == job).order_by(chunks.c.chunk)
        if open_only:
            query = query.where(chunks.c.state.not_in(CLOSED))
        with self._ledger._read("reading batches") as conn:
            rows = conn.execute(query).mappings().all()
        return [
            Chunk(
                r["job"],
                r["chunk"],
                r["state"],
                r["key"],
                r["created_at"],
                r["input_file"],
                r["batch_id"],
                r["lines"],
                orjson.loads(r["counts"]) if r["counts"] else None,
            )
            for r in rows
        ]

    def pending(self, job: str, limit: int) -> list[ClaimedItem]:
        """Up to `limit` pending items in line order for a batch: not those waiting for a
        duplicate, nor those holding a batch answer that a follow-up (a repair, a longer
        retry) must follow, which only an online run sends (a batch would ask the item's
        own request again, and pay for it again, at every run)."""
        query = (
            select(*CLAIMED_COLUMNS)
            .where(*_waiting(job), items.c.followup.is_(None))
            .order_by(items.c.line)
            .limit(limit)
        )
        with self._ledger._read("reading pending items") as conn:
            return [claimed_of(row) for row in conn.execute(query)]

    def followups(self, job: str) -> int:
        """How many pending items wait for a follow-up that an online run sends."""
        query = select(func.count()).where(*_waiting(job), items.c.followup.is_not(None))
        with self._ledger._read("counting follow-ups") as conn:
            return int(conn.execute(query).scalar() or 0)

    def start(
        self, job: str, lines: list[int], *, owner: str, lease: float
    ) -> tuple[int, list[int]]:
        """A new chunk of these lines (those still pending), in state `intent`, leased to
        `owner` for `lease` seconds: (its number, its lines)."""
        now = time.time()
        with self._ledger._write("starting a batch") as conn:
            last = conn.execute(select(func.max(chunks.c.chunk)).where(chunks.c.job == job))
            number = (last.scalar() or 0) + 1
            taken = conn.execute(
                update(items)
                .where(items.c.job == job, items.c.line.in_(lines), items.c.status == "pending")
                .values(status="batched", chunk=number, updated_at=now)
                .returning(items.c.line)
            ).scalars()
            mine = sorted(taken)
            if mine:
                conn.execute(
                    insert(chunks).values(
                        job=job,
                        chunk=number,
                        state="intent",
                        key=secrets.token_hex(8),
                        owner=owner,
                        lease_until=now + lease,
                        lines=len(mine),
                        created_at=now,
                        updated_at=now,
                    )
                )
        return number, mine

    def take(self, job: str, chunk: int, *, owner: str, lease: float) -> bool:
        """Lease a chunk without a batch to `owner` for uploading and creating it, unless
        another live run holds it: two runs never create batches for the same chunk at once.
        A holder is gone when its lease ran out, or when its process is (same machine)."""
        now = time.time()
        where = (
            chunks.c.job == job,
            chunks.c.chunk == chunk,
            chunks.c.batch_id.is_(None),
            chunks.c.state.not_in(CLOSED),  # closed by another run meanwhile: its lines gone
        )
        with self._ledger._write("taking a batch") as conn:
            row = conn.execute(select(chunks.c.owner, chunks.c.lease_until).where(*where)).first()
            if row is None:
                return False
            holder, until = row
            if holder not in (None, owner) and (until or 0) > now and _alive(holder):
                return False
            # Taken only as it was read: another process that took it meanwhile wins.
            unchanged = (
                chunks.c.owner.is_(None) if holder is None else chunks.c.owner == holder,
                chunks.c.lease_until.is_(None) if until is None else chunks.c.lease_until == until,
            )
            taken = update(chunks).where(*where, *unchanged)
            return bool(conn.execute(taken.values(owner=owner, lease_until=now + lease)).rowcount)

    def let_go(self, job: str, *, owner: str, keep: Collection[int] = ()) -> None:
        """The run `owner` has ended (a notebook's stopped cell included): its leases on chunks
        it made no batch for go at once, not when they run out (its process may live on, and
        `take` would take it for a live run till then). Not those in `keep`, whose create may
        have reached the provider: a batch made there may not be listed yet, and the next run
        would make a second one (their leases run out as before)."""
        mine = and_(chunks.c.job == job, chunks.c.owner == owner, chunks.c.batch_id.is_(None))
        where = and_(mine, chunks.c.chunk.not_in(list(keep)))
        with self._ledger._write("letting go of batches") as conn:
            conn.execute(update(chunks).where(where).values(owner=None, lease_until=None))

    def lines(self, job: str, chunk: int) -> list[ClaimedItem]:
        """The items a chunk holds (still `batched`)."""
        query = (
            select(*CLAIMED_COLUMNS)
            .where(items.c.job == job, items.c.status == "batched", items.c.chunk == chunk)
            .order_by(items.c.line)
        )
        with self._ledger._read("reading a batch's items") as conn:
            return [claimed_of(row) for row in conn.execute(query)]

    def created(self, job: str, chunk: int, batch_id: str, state: Any) -> bool:
        """Record the chunk's batch, unless another batch is recorded for it already (another
        run, its lease over this one's, created one first) or the chunk was closed (its lines
        given back, by a run that took it over): False then."""
        with self._ledger._write("recording a batch") as conn:
            done = conn.execute(
                update(chunks)
                .where(chunks.c.job == job, chunks.c.chunk == chunk)
                .where(or_(chunks.c.batch_id.is_(None), chunks.c.batch_id == batch_id))
                .where(chunks.c.state.not_in(CLOSED))
                .values(batch_id=batch_id, state=str(state), updated_at=time.time())
            ).rowcount
        return bool(done)

    def note(self, job: str, chunk: int, **values: Any) -> None:
        """Record what is known of an open chunk: input_file, batch_id, state, counts (one
        another run closed meanwhile stays closed: its lines were given back)."""
        if "counts" in values:
            values["counts"] = orjson.dumps(values["counts"]).decode()
        with self._ledger._write("noting a batch") as conn:
            conn.execute(
                update(chunks)
                .where(chunks.c.job == job, chunks.c.chunk == chunk)
                .where(chunks.c.state.not_in(CLOSED))
                .values(updated_at=time.time(), **values)
            )

    def close(
        self, job: str, chunk: int, followups: dict[int, dict[str, Any]] | None = None
    ) -> int:
        """The chunk's results are in: what it did not answer goes back to pending, with the
        answers that need a follow-up kept for it (`followups`, by line); how many."""
        now = time.time()
        with self._ledger._write("closing a batch") as conn:
            if followups:
                conn.execute(
                    update(items)
                    .where(items.c.job == job, items.c.line == bindparam("l"))
                    .where(items.c.status == "batched", items.c.chunk == chunk)
                    .values(followup=bindparam("f")),
                    [{"l": line, "f": orjson.dumps(f).decode()} for line, f in followups.items()],
                )
            back = conn.execute(
                update(items)
                .where(
                    and_(items.c.job == job, items.c.status == "batched", items.c.chunk == chunk)
                )
                .values(status="pending", updated_at=now)
            ).rowcount
            conn.execute(
                update(chunks)
                .where(chunks.c.job == job, chunks.c.chunk == chunk)
                .values(state="collected", updated_at=now)
            )
        return int(back)


def _waiting(job: str) -> tuple[Any, ...]:
    """A job's pending items that are not waiting for a duplicate of theirs."""
    return (items.c.job == job, items.c.status == "pending", items.c.dup_of.is_(None))
