"""What differs between the two databases a ledger lives in, behind one seam.

The Ledger's operations (store.py, workers.py, ingest.py, migrations.py) are written once, in
SQLAlchemy Core. What SQLite and PostgreSQL do differently is here and only here (a test holds
that): how an engine is made, whose clock leases use, how a writer locks a job, how a claim
passes over rows that another worker is taking, how migrations are serialised, and which
errors mean "the database is out of reach for now" rather than "this cannot work".

- SQLite: one file on one machine. Every write transaction takes the whole database's write
  lock at BEGIN (BEGIN IMMEDIATE), so the job lock and the migration lock are that lock, and a
  claim needs no row locks. The clock is this machine's: every process sharing the file is here.
- PostgreSQL: many hosts. Leases and heartbeats use the server's clock (hosts' clocks differ,
  the server's is one); writers that may touch another worker's items lock the job's row first;
  claims lock the rows they take and skip rows another claim holds (FOR UPDATE SKIP LOCKED, in
  a CTE that is materialised so that its LIMIT is applied once); migrations take an advisory
  lock; a restart of the server is an outage that a run waits out, not a failure. A run's write
  transaction that sits idle longer than its lease (its worker frozen, its machine gone: the
  session stays open for hours until TCP gives up) is ended by the server, so its row locks do
  not hold up the live workers that would take its items.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from sqlalchemy import CTE, Connection, Engine, Select, create_engine, event, select, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, OperationalError, SQLAlchemyError

from batchrun.errors import LedgerError
from batchrun.ledger.schema import jobs

BUSY_TIMEOUT_MS = 30_000
WRITE_OPTION = "batchrun_write"  # execution option marking a write transaction
HURRY_OPTION = "batchrun_hurry"  # a write of a run told to stop now: a short wait for the lock
HURRIED_BUSY_MS = 1000
IDLE_OPTION = "batchrun_idle_ms"  # a run's write: how long the server lets it sit idle (its lease)
MIGRATION_LOCK = 0x62617463  # PostgreSQL advisory lock key for migrations ("batc")
# SQLSTATEs of a server going away or not there yet: connection exceptions (class 08),
# admin_shutdown, crash_shutdown, cannot_connect_now (starting up)
OUT_OF_REACH_STATES = ("57P01", "57P02", "57P03")
# SQLSTATEs of a transaction that lost to another and may simply run again: deadlock_detected,
# serialization_failure, lock_not_available (told by code, not by the words of a message,
# which a server may say in another language)
CONFLICT_STATES = ("40P01", "40001", "55P03")
# What a server or resolver says when connecting cannot work however long we wait.
REFUSALS = (
    "authentication failed",
    "does not exist",
    "pg_hba.conf",
    "no password supplied",
    "name or service not known",
    "nodename nor servname",
    "permission denied",
    "ssl",
)


# What SQLAlchemy's SQLite driver reads from a plain (not `uri=true`) URL's query; anything
# else there is SQLite's own URI syntax, which only a URI opens (else silently dropped).
PLAIN_SQLITE_QUERY = {"timeout", "detect_types", "check_same_thread", "cached_statements", "uri"}


def parsed_url(url: str) -> URL:
    """A ledger URL, parsed, or LedgerError (never echoing it: it may hold a password) for one
    that cannot be read: not a URL, a port that is not a number (`$PGPORT` left unexpanded)
    or out of range (libpq's refusal of it was taken for a server away), a host holding `@`
    (a password's `@` unescaped: the rest of the password is taken for the host, and a
    driver's error would print it)."""
    try:
        found = make_url(url)
    except (ArgumentError, ValueError):
        raise LedgerError("not a ledger URL (is its port a number?)") from None
    try:  # SQLite's busy timeout, in seconds
        wait = float(str(found.query.get("timeout", 0)))
    except ValueError:
        wait = -1.0
    if not 0 <= wait * 1000 < 2**31:  # inf, nan, negative, past SQLite's 32-bit milliseconds
        raise LedgerError("the ledger URL's timeout= must be a number of seconds") from None
    if found.port is not None and not 0 < found.port < 65536:  # libpq: "invalid port number"
        raise LedgerError("the ledger URL's port must be from 1 to 65535")
    if "@" in (found.host or ""):
        raise LedgerError("the ledger URL's host holds an '@': write one in a password as %40")
    as_file = (found.database or "").startswith("file:")
    uri_only = as_file or bool(set(found.query) - PLAIN_SQLITE_QUERY)
    if found.get_backend_name() == "sqlite" and uri_only and not (as_file and _is_uri(found)):
        # without uri=true SQLite's options are dropped; without file: the path, query and
        # all, is taken for a file name (a new empty ledger beside the real one)
        raise LedgerError(
            "an SQLite URI needs both file: and uri=true: sqlite:///file:/path/ledger.db"
            "?mode=ro&uri=true"
        )
    return found


def file_ledger_url(path: Path) -> str:
    """The URL of an SQLite ledger file, whatever its path holds (`?`, `%`, spaces)."""
    return URL.create("sqlite", database=str(path)).render_as_string(hide_password=False)


def read_only(url: str) -> bool:
    """An SQLite URI that opens the ledger read-only (`mode=ro`, `immutable=1`)."""
    try:
        found = make_url(url)
    except (ArgumentError, ValueError):
        return False
    query = {k: str(v).lower() for k, v in found.query.items()}
    return _is_uri(found) and (query.get("mode") == "ro" or query.get("immutable") == "1")


def _at_rest_unwritable(path: Path) -> bool:
    """A WAL ledger that no process has open (no -wal, no -shm beside it) in a folder this
    process cannot write: SQLite cannot open it read-only without making a -shm there."""
    beside = [Path(f"{path}{suffix}") for suffix in ("-wal", "-shm")]
    at_rest = path.exists() and not any(p.exists() for p in beside)
    return at_rest and not os.access(path.parent, os.W_OK)


def _is_uri(found: URL) -> bool:
    return str(found.query.get("uri", "")).lower() in ("true", "1")


def home_expanded(url: str) -> str:
    """An SQLite URL whose path starts with `~` (`sqlite:///~/batch/ledger.db`), in the user's
    home: SQLite would make a folder named `~` in the working directory, a new empty ledger
    wherever the pipeline runs."""
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):  # not a URL: opening it says so
        return url
    database = parsed.database or ""
    if parsed.get_backend_name() != "sqlite" or not database.startswith("~"):
        return url
    return parsed.set(database=str(Path(database).expanduser())).render_as_string(False)


def ledger_file(url: str) -> tuple[Path, bool] | None:
    """The file an SQLite ledger URL names, and whether it is an SQLite URI
    (`sqlite:///file:/path?mode=ro&uri=true`, opened by SQLite as written: no folder of ours to
    create, and a read-only one must not be made); None for another database or for memory."""
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):  # not a URL: opening it says so
        return None
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    database = parsed.database
    uri = _is_uri(parsed)
    if uri and database.startswith("file:"):
        database = urlsplit(database).path
    return Path(database), uri


class Dialect:
    """The contract: each method is one thing the ledger needs that the databases do
    differently. The defaults are SQLite's."""

    name = "sqlite"

    def engine(self, url: str) -> Engine:
        """An engine for `url` that follows the ledger's transaction rules: a connection marked
        with WRITE_OPTION holds the write lock from its BEGIN; a read never waits for a writer."""
        file = ledger_file(url)
        if file is not None and not file[1]:
            folder = file[0].parent
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise LedgerError(
                    f"cannot create the ledger folder {folder}: {exc.strerror}"
                ) from None
        if file is not None and read_only(url) and _at_rest_unwritable(file[0]):
            # no -shm to share, and none can be made: read the file as it lies (no writer is
            # at work: it would have left its -wal and -shm beside it)
            url = make_url(url).update_query_dict({"immutable": "1"}).render_as_string(False)
        given = make_url(url).query.get("timeout")  # the URL's own busy timeout (s), or ours
        busy_ms = None if given is None else int(float(str(given)) * 1000)
        wait_s = (BUSY_TIMEOUT_MS if busy_ms is None else busy_ms) / 1000
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": wait_s})
        event.listen(engine, "connect", lambda conn, record: _sqlite_pragmas(conn, busy_ms))
        event.listen(engine, "begin", _sqlite_begin)
        return engine

    def now(self, conn: Connection) -> float:
        """The clock that leases and heartbeats are written in."""
        return time.time()

    def lock_job(self, conn: Connection, name: str) -> None:
        """Inside a write: lock the job before touching items that other workers may hold, so
        that joins, heartbeats and reclaims of one job never deadlock on each other's items."""
        # BEGIN IMMEDIATE already holds the database's write lock

    def claimable(self, query: Select[Any]) -> CTE:
        """`query` (the lines to claim, with a LIMIT) as a CTE that a claim's UPDATE reads."""
        return query.cte("claimable")

    def lock_migrations(self, conn: Connection) -> None:
        """Inside a write: serialise schema migrations across processes."""
        # BEGIN IMMEDIATE already holds the database's write lock

    def loaded(self, engine: Engine) -> None:
        """A job's lines were loaded (committed): bring the planner's picture of the table up
        to date (SQLite's planner goes by its indexes alone)."""

    def reclaim_space(self, engine: Engine) -> None:
        """Give the space of deleted rows back (to the filesystem on SQLite)."""
        raw = engine.raw_connection()  # the driver's own: VACUUM runs outside a transaction
        try:
            raw.cursor().execute("VACUUM")
        except engine.dialect.loaded_dbapi.Error as exc:  # outside SQLAlchemy's own errors
            reason = str(exc)
            raise LedgerError(
                f"ledger error while reclaiming space: {reason}", busy="locked" in reason
            ) from None
        finally:
            raw.close()

    def out_of_reach(self, exc: SQLAlchemyError) -> bool:
        """The database cannot be reached at the moment (a server restarting, a connection
        dropped): worth waiting for, unlike a full disk or a broken rule."""
        return False

    def as_text(self, conn: Connection, table: str, column: str) -> None:
        """Make a column unbounded text (SQLite's columns hold any length already)."""

    def conflict(self, exc: SQLAlchemyError) -> bool:
        """The transaction lost to another (a deadlock): it may simply run again. (SQLite's
        writers take turns at BEGIN IMMEDIATE; its busy lock says "locked".)"""
        return False


class Postgres(Dialect):
    name = "postgresql"

    def engine(self, url: str) -> Engine:
        try:  # pre_ping: a connection that a server restart closed is replaced, not used
            engine = create_engine(url, pool_pre_ping=True)
        except ImportError as exc:
            raise LedgerError(f"the ledger URL needs a database driver: {exc}") from None
        event.listen(engine, "begin", _postgres_begin)
        return engine

    def now(self, conn: Connection) -> float:
        clock = conn.execute(text("SELECT extract(epoch from clock_timestamp())")).scalar()
        return float(clock or 0.0)

    def lock_job(self, conn: Connection, name: str) -> None:
        conn.execute(select(jobs.c.name).where(jobs.c.name == name).with_for_update()).first()

    def claimable(self, query: Select[Any]) -> CTE:
        # Rows another worker is claiming now are passed over, not waited for; materialised,
        # or PostgreSQL may run the LIMIT subquery more than once and claim past it.
        locked = query.with_for_update(skip_locked=True)
        return locked.cte("claimable").prefix_with("MATERIALIZED")

    def lock_migrations(self, conn: Connection) -> None:
        conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK})

    def loaded(self, engine: Engine) -> None:
        # Autovacuum analyses a table long after a bulk load; until then the planner takes a
        # job's items for a few rows and joins them by nested loops: reuse's one UPDATE took
        # minutes for 20,000 lines (a review measured 71 s), holding the job's lock, where a
        # hash join takes milliseconds. A sample of the table: well under a second.
        with engine.begin() as conn:
            conn.exec_driver_sql("ANALYZE items")

    def reclaim_space(self, engine: Engine) -> None:
        # VACUUM cannot run in a transaction; plain VACUUM frees space for reuse in place
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("VACUUM items")

    def as_text(self, conn: Connection, table: str, column: str) -> None:
        conn.exec_driver_sql(f"ALTER TABLE {table} ALTER COLUMN {column} TYPE TEXT")

    def conflict(self, exc: SQLAlchemyError) -> bool:
        return _sqlstate(exc) in CONFLICT_STATES

    def out_of_reach(self, exc: SQLAlchemyError) -> bool:
        if getattr(exc, "connection_invalidated", False):
            return True
        orig = getattr(exc, "orig", None)
        state = _sqlstate(exc)
        if state:
            return str(state).startswith("08") or state in OUT_OF_REACH_STATES
        # No SQLSTATE: the driver failed while connecting. Refused, reset or timed out is a
        # server away; a refused login, an unknown database or host is a mistake to say now.
        said = str(orig or exc).lower()
        return isinstance(exc, OperationalError) and not any(m in said for m in REFUSALS)


def _sqlstate(exc: SQLAlchemyError) -> str | None:
    orig = getattr(exc, "orig", None)
    state = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)  # psycopg2
    return str(state) if state else None


SQLITE, POSTGRES = Dialect(), Postgres()
DIALECTS = {d.name: d for d in (SQLITE, POSTGRES)}


def dialect_for(url: str) -> Dialect:
    """The dialect of a ledger URL; a database other than these two is refused."""
    backend = parsed_url(url).get_backend_name()
    if backend not in DIALECTS:
        raise LedgerError(
            f"a ledger lives in SQLite or PostgreSQL, not {backend!r} "
            "(sqlite:///PATH or postgresql+psycopg://USER@HOST/DB)"
        )
    return DIALECTS[backend]


def dialect_of(bind: Connection | Engine) -> Dialect:
    return DIALECTS[bind.dialect.name]


def _sqlite_pragmas(dbapi_connection: Any, busy_ms: int | None) -> None:
    # Let SQLAlchemy's "begin" event, not the driver, decide how transactions start.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS if busy_ms is None else busy_ms}")
        cursor.execute("PRAGMA journal_mode = WAL")
        cursor.execute("PRAGMA synchronous = FULL")
        cursor.execute("PRAGMA foreign_keys = ON")
    finally:
        cursor.close()


def _postgres_begin(conn: Any) -> None:
    idle_ms = conn.get_execution_options().get(IDLE_OPTION)
    if idle_ms:  # this transaction's only (SET LOCAL): a load's gaps are its input's
        conn.exec_driver_sql(f"SET LOCAL idle_in_transaction_session_timeout = {int(idle_ms)}")


def _sqlite_begin(conn: Any) -> None:
    # Writers lock at BEGIN; readers start a deferred transaction and never wait in WAL.
    options = conn.get_execution_options()
    if options.get(HURRY_OPTION):  # the connection is the ending run's: not waited for again
        conn.exec_driver_sql(f"PRAGMA busy_timeout = {HURRIED_BUSY_MS}")
    conn.exec_driver_sql("BEGIN IMMEDIATE" if options.get(WRITE_OPTION) else "BEGIN")
