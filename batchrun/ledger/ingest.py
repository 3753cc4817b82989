"""Loading input lines into the items table: fast batches, with a slow path for duplicates.

The insert is compiled once and sent as plain tuples through the driver's executemany (driver.py),
several times faster than SQLAlchemy's per-row parameter processing on a million lines. When the
unique index on (job, item_id) refuses a batch, that batch is replayed row by row under savepoints
to find which lines repeat an earlier id.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, select
from sqlalchemy.exc import IntegrityError

from batchrun.ledger.driver import Many
from batchrun.ledger.records import BadLine, InputItem
from batchrun.ledger.schema import items
from batchrun.prefixes import Grouper, in_input_order

BATCH_ROWS = 5000
COLUMNS = (
    "job",
    "line",
    "item_id",
    "endpoint",
    "body",
    "digest",
    "meta",
    "status",
    "attempts",
    "error",
    "created_at",
    "updated_at",
    "sched",
)
_LINE, _ITEM_ID, _STATUS, _ERROR = (
    COLUMNS.index(c) for c in ("line", "item_id", "status", "error")
)

Row = tuple[Any, ...]


class Loader:
    """Adds one job's lines to the items table inside the caller's transaction."""

    def __init__(self, conn: Connection, job: str, now: float, *, skip_invalid: bool) -> None:
        self.conn = conn
        self.job = job
        self.now = now
        self.skip_invalid = skip_invalid
        self.problems: list[tuple[int, str]] = []
        self.accepted = 0
        self.rejected = 0
        self._batch: list[Row] = []
        self.grouper = Grouper()  # claim positions: long shared prefixes together
        self._insert_many = Many.compile(items.insert(), conn.dialect, COLUMNS)

    def add(self, entry: InputItem | BadLine) -> None:
        if isinstance(entry, BadLine):
            self.problems.append((entry.line, entry.reason))
            if self.skip_invalid:
                self._batch.append(self._rejected(entry.line, entry.reason))
        else:
            self._batch.append(
                (
                    self.job,
                    entry.line,
                    entry.item_id,
                    entry.endpoint,
                    entry.body.decode(),
                    entry.digest,
                    entry.meta.decode() if entry.meta else None,
                    "pending",
                    0,
                    None,
                    self.now,
                    self.now,
                    self.grouper.position(entry.line, entry.prefix),
                )
            )
        if len(self._batch) >= BATCH_ROWS:
            self.flush()

    def flush(self) -> None:
        batch, self._batch = self._batch, []
        if not batch:
            return
        try:
            with self.conn.begin_nested():
                self._insert(batch)
        except IntegrityError:
            self._insert_one_by_one(batch)  # rare: an id in this batch repeats an earlier one
            return
        n_rejected = sum(1 for row in batch if row[_STATUS] == "rejected")
        self.accepted += len(batch) - n_rejected
        self.rejected += n_rejected

    def _insert(self, rows: list[Row]) -> None:
        self._insert_many.run(self.conn, rows)

    def _insert_one_by_one(self, batch: list[Row]) -> None:
        for row in batch:
            try:
                with self.conn.begin_nested():
                    self._insert([row])
            except IntegrityError:
                first = self.conn.execute(
                    select(items.c.line).where(
                        items.c.job == self.job,
                        items.c.item_id == row[_ITEM_ID],
                        items.c.status != "rejected",
                    )
                ).scalar()
                reason = f"duplicate id {row[_ITEM_ID]!r} (first on line {first})"
                self.problems.append((row[_LINE], reason))
                if self.skip_invalid:
                    with self.conn.begin_nested():
                        self._insert([self._rejected(row[_LINE], reason)])
                    self.rejected += 1
                continue
            if row[_STATUS] == "rejected":
                self.rejected += 1
            else:
                self.accepted += 1

    def _rejected(self, line: int, reason: str) -> Row:
        """A rejected line's row: no id (see outputs), no request; its reason as its error."""
        now = self.now
        sched = in_input_order(line)
        return (self.job, line, "", "", "null", "", None, "rejected", 0, reason, now, now, sched)
