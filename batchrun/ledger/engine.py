"""Engine setup: SQLite tuned for one durable writer (WAL, busy timeout, BEGIN IMMEDIATE).

BEGIN IMMEDIATE takes the write lock when a write transaction starts instead of at its first
write, so two processes never both read, then both fail to upgrade to a write lock
mid-transaction. Reads begin deferred, so `status` never queues behind a writer.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from batchrun.errors import LedgerError

BUSY_TIMEOUT_MS = 30_000
WRITE_OPTION = "batchrun_write"  # execution option marking a write transaction


def make_engine(url: str) -> Engine:
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        try:
            return create_engine(url, pool_pre_ping=True)
        except ImportError as exc:
            raise LedgerError(f"the ledger URL needs a database driver: {exc}") from None
    database = parsed.database or ""
    if database and database != ":memory:":
        folder = Path(database).parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise LedgerError(f"cannot create the ledger folder {folder}: {exc.strerror}") from None
    engine = create_engine(
        url, connect_args={"check_same_thread": False, "timeout": BUSY_TIMEOUT_MS / 1000}
    )

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Let SQLAlchemy's "begin" event, not the driver, decide how transactions start.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            cursor.execute("PRAGMA journal_mode = WAL")
            cursor.execute("PRAGMA synchronous = FULL")
            cursor.execute("PRAGMA foreign_keys = ON")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        # Writers lock at BEGIN; readers start a deferred transaction and never wait in WAL.
        write = conn.get_execution_options().get(WRITE_OPTION)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

    return engine


def shown_url(url: str) -> str:
    """The ledger URL as it may be shown: a password in it becomes ***."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return "(an unreadable ledger URL)"


@contextmanager
def storage_errors(action: str) -> Iterator[None]:
    """Turn driver errors into one clear LedgerError (disk full, read-only, corrupt...)."""
    try:
        yield
    except SQLAlchemyError as exc:
        # The driver's own message only: SQLAlchemy's text would repeat the SQL and its
        # parameters, which hold prompts.
        reason = str(getattr(exc, "orig", None) or type(exc).__name__)
        busy = "locked" in reason or "busy" in reason
        if "disk I/O error" in reason or "full" in reason:
            reason += " (is the disk full, or the file over a size limit?)"
        elif "unable to open database file" in reason:
            reason += " (does the folder exist, and is it writable? read-only filesystem?)"
        raise LedgerError(f"ledger error while {action}: {reason}", busy=busy) from None
