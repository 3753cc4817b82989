"""Loading input lines into the items table: fast batches, with a slow path for duplicates.

Batches go in with one executemany each; when the unique index on (job, item_id) refuses a batch,
that batch is replayed row by row under savepoints to find which lines repeat an earlier id.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, select
from sqlalchemy.exc import IntegrityError

from batchrun.inputs import InputItem
from batchrun.ledger.schema import items


def insert_batch(
    conn: Connection,
    batch: list[dict[str, Any]],
    problems: list[tuple[int, str]],
    skip_invalid: bool,
    accepted: int,
    rejected: int,
) -> tuple[int, int]:
    """Insert one batch; duplicates are added to `problems` (and stored as rejected when
    skip_invalid). Returns the running (accepted, rejected) totals."""
    n_rejected = sum(1 for row in batch if row["status"] == "rejected")
    try:
        with conn.begin_nested():
            conn.execute(items.insert(), batch)
        return accepted + len(batch) - n_rejected, rejected + n_rejected
    except IntegrityError:
        pass
    # Rare path: some id in this batch repeats an earlier one. Insert row by row to find it.
    for row in batch:
        try:
            with conn.begin_nested():
                conn.execute(items.insert(), row)
            if row["status"] == "rejected":
                rejected += 1
            else:
                accepted += 1
        except IntegrityError:
            first = conn.execute(
                select(items.c.line).where(
                    items.c.job == row["job"],
                    items.c.item_id == row["item_id"],
                    items.c.status != "rejected",
                )
            ).scalar()
            reason = f"duplicate id {row['item_id']!r} (first on line {first})"
            problems.append((row["line"], reason))
            if skip_invalid:
                with conn.begin_nested():
                    conn.execute(items.insert(), {**row, "status": "rejected", "error": reason})
                rejected += 1
    return accepted, rejected


def pending_row(job: str, item: InputItem, now: float) -> dict[str, Any]:
    return {
        "job": job,
        "line": item.line,
        "item_id": item.item_id,
        "endpoint": item.endpoint,
        "body": item.body.decode(),
        "digest": item.digest,
        "meta": item.meta.decode() if item.meta else None,
        "status": "pending",
        "attempts": 0,
        "error": None,
        "created_at": now,
        "updated_at": now,
    }


def rejected_row(job: str, line: int, item_id: str, reason: str, now: float) -> dict[str, Any]:
    return {
        "job": job,
        "line": line,
        "item_id": item_id,
        "endpoint": "",
        "body": "null",
        "digest": "",
        "meta": None,
        "status": "rejected",
        "attempts": 0,
        "error": reason,
        "created_at": now,
        "updated_at": now,
    }
