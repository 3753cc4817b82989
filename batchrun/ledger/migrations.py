"""Ordered, idempotent schema migrations.

Each migration has a version number and runs once, in its own transaction, recorded in
`schema_migrations`; running `migrate` again on an up-to-date ledger changes nothing. A new
column or index is a new entry at the end of MIGRATIONS, never an edit of an old one.

Opening an up-to-date ledger only reads (so `status` never waits behind a long ingest, and a
read-only ledger still opens). When a migration is due, each transaction takes the write lock
when it begins (BEGIN IMMEDIATE on SQLite, an advisory lock on PostgreSQL) and looks again: two
processes opening a brand-new ledger at once would otherwise both read that a migration is due,
and the second to write would fail (on SQLite "database is locked" at once, the busy timeout
never consulted: SQLite refuses to wait for a lock that a reader holding its own could deadlock
on).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from sqlalchemy import Connection, Engine, event, inspect, select, text

from batchrun.errors import LedgerError
from batchrun.ledger.dialect import WRITE_OPTION, dialect_of, read_only
from batchrun.ledger.engine import make_engine, shown_ledger, storage_errors
from batchrun.ledger.schema import (
    chunks,
    items,
    items_id_digest_unique,
    items_id_unique,
    items_reuse,
    items_sched,
    jobs,
    schema_migrations,
    waits,
    workers,
)

REPAIR_COLUMNS = ("repairs", "repair_prompt_tokens", "repair_completion_tokens")


def _v1_initial(conn: Connection) -> None:
    jobs.create(conn, checkfirst=True)
    items.create(conn, checkfirst=True)
    items_id_unique.create(conn, checkfirst=True)
    items_id_digest_unique.create(conn, checkfirst=True)


def _v2_limit_history(conn: Connection) -> None:
    _add_column(conn, "jobs", "limit_history", "TEXT")


def _add_column(conn: Connection, table: str, column: str, kind: str) -> None:
    """A column the table lacks (a blank ledger got it from the current table definition;
    an older one did not)."""
    if column not in {c["name"] for c in inspect(conn).get_columns(table)}:
        conn.execute(text(f"ALTER TABLE {table} ADD COLUMN {column} {kind}"))


def _v3_repair_costs(conn: Connection) -> None:
    _add_counts(conn, REPAIR_COLUMNS)


def _add_counts(conn: Connection, columns: tuple[str, ...]) -> None:
    """Count columns of items, 0 on every row."""
    for column in columns:
        _add_column(conn, "items", column, "INTEGER NOT NULL DEFAULT 0")


def _v4_workers(conn: Connection) -> None:
    workers.create(conn, checkfirst=True)


REUSE_COLUMNS = {
    "answer_spec": "VARCHAR(64)",
    "reused_job": "VARCHAR(200)",
    "reused_line": "INTEGER",
    "dup_of": "INTEGER",
}


def _v5_reuse(conn: Connection) -> None:
    have = {c["name"] for c in inspect(conn).get_columns("items")}
    for column, kind in REUSE_COLUMNS.items():
        if column not in have:
            conn.execute(text(f"ALTER TABLE items ADD COLUMN {column} {kind}"))
    items_reuse.create(conn, checkfirst=True)
    waits.create(conn, checkfirst=True)


def _v6_endpoints_and_order(conn: Connection) -> None:
    have = {c["name"] for c in inspect(conn).get_columns("items")}
    if "answered_by" not in have:
        conn.execute(text("ALTER TABLE items ADD COLUMN answered_by VARCHAR(200)"))
    if "sched" not in have:
        conn.execute(text("ALTER TABLE items ADD COLUMN sched BIGINT"))
        conn.execute(text("UPDATE items SET sched = line * 4294967296 + line"))  # input order
    if "endpoints" not in {c["name"] for c in inspect(conn).get_columns("workers")}:
        conn.execute(text("ALTER TABLE workers ADD COLUMN endpoints TEXT"))
    items_sched.create(conn, checkfirst=True)


def _v7_hosted_batches(conn: Connection) -> None:
    _add_column(conn, "items", "chunk", "INTEGER")
    _add_column(conn, "items", "followup", "TEXT")
    chunks.create(conn, checkfirst=True)


EXTRA_COLUMNS = ("extra_prompt_tokens", "extra_completion_tokens")


def _v8_extra_tokens(conn: Connection) -> None:
    _add_counts(conn, EXTRA_COLUMNS)


def _v9_worker_leases(conn: Connection) -> None:
    _add_column(conn, "workers", "lease", "FLOAT")


def _v10_collected_jobs(conn: Connection) -> None:
    _add_column(conn, "jobs", "collected_at", "FLOAT")


def _v11_long_ids(conn: Connection) -> None:
    """Ids unique by their md5, not their text, where the database limits an index entry
    (PostgreSQL: an id over 2,704 bytes refused the whole load; see schema.py). A ledger
    keeps one of the two indexes."""
    items_id_digest_unique.create(conn, checkfirst=True)  # made only where that is the kind
    if items_id_digest_unique.name in {i["name"] for i in inspect(conn).get_indexes("items")}:
        conn.execute(text(f"DROP INDEX IF EXISTS {items_id_unique.name}"))


def _v12_charged_attempts(conn: Connection) -> None:
    _add_counts(conn, ("charged",))


def _v13_answer_model(conn: Connection) -> None:
    _add_column(conn, "items", "answer_model", "TEXT")


def _v14_answer_model_text(conn: Connection) -> None:
    """Migration 13 made answer_model VARCHAR(200) for a day: a model named by its file path
    is longer, and PostgreSQL refused the whole group commit."""
    dialect_of(conn).as_text(conn, "items", "answer_model")


MIGRATIONS: list[tuple[int, str, Callable[[Connection], None]]] = [
    (1, "initial jobs and items", _v1_initial),
    (2, "jobs.limit_history for --concurrency auto", _v2_limit_history),
    (3, "items.repairs and repair token counts for --repair-attempts", _v3_repair_costs),
    (4, "workers: several processes on one job", _v4_workers),
    (5, "items: answer_spec, reused_job/line, dup_of; waits: for reuse and dedup", _v5_reuse),
    (
        6,
        "items.answered_by and sched, workers.endpoints: endpoints, prefix order",
        _v6_endpoints_and_order,
    ),
    (7, "items.chunk and chunks: hosted Batch API batches", _v7_hosted_batches),
    (8, "items.extra_*_tokens: paid tokens no answer shows, for budgets", _v8_extra_tokens),
    (9, "workers.lease: each worker judged by its own", _v9_worker_leases),
    (10, "jobs.collected_at: a job gc kept only answers of", _v10_collected_jobs),
    (11, "item ids unique by their md5 where index entries are limited", _v11_long_ids),
    (12, "items.charged: --max-attempts goes on across a stopped run", _v12_charged_attempts),
    (13, "items.answer_model: the model each answer was asked of", _v13_answer_model),
    (14, "items.answer_model as unbounded text", _v14_answer_model_text),
]


def migrate(engine: Engine) -> int:
    """Bring the ledger to the newest schema; returns how many migrations ran."""
    if not _due(engine):
        return 0
    with _writing(engine) as conn:
        schema_migrations.create(conn, checkfirst=True)
    ran = 0
    for version, name, apply in MIGRATIONS:
        with _writing(engine) as conn:
            done = conn.execute(
                select(schema_migrations.c.version).where(schema_migrations.c.version == version)
            ).first()
            if done:
                continue
            apply(conn)
            conn.execute(
                schema_migrations.insert().values(
                    version=version, name=name, applied_at=time.time()
                )
            )
            ran += 1
    return ran


def _due(engine: Engine) -> bool:
    """Whether any migration has yet to run (a read: no lock is taken). A ledger that a newer
    batchrun migrated is refused: this one does not know what its rows now mean."""
    with engine.connect() as conn:
        if not inspect(conn).has_table(schema_migrations.name):
            return True
        done = set(conn.execute(select(schema_migrations.c.version)).scalars())
    newest = MIGRATIONS[-1][0]
    if max(done, default=0) > newest:
        raise LedgerError(
            f"the ledger's schema (version {max(done)}) is newer than this batchrun's "
            f"({newest}): a newer batchrun made it; upgrade this one to use it"
        )
    return any(version not in done for version, _name, _apply in MIGRATIONS)


@contextmanager
def _writing(engine: Engine) -> Iterator[Connection]:
    """A transaction that holds the ledger's write lock from its start."""
    with engine.connect() as conn:
        conn.execution_options(**{WRITE_OPTION: True})
        with conn.begin():
            dialect_of(conn).lock_migrations(conn)
            yield conn


def current_version(engine: Engine) -> int:
    with engine.connect() as conn:
        versions = conn.execute(select(schema_migrations.c.version)).scalars().all()
    return max(versions, default=0)


def _read_as_current(engine: Engine) -> None:
    """A ledger an older batchrun made, opened read-only (migrating would write): each table
    it lacks columns of is read, on every connection, through a temporary view of the same
    name that adds them (0 for a count, else null); temporary objects need no write access."""
    seen, views = inspect(engine), []
    for table in (jobs, items, workers, chunks, waits):
        if not seen.has_table(table.name):
            continue
        have = {c["name"] for c in seen.get_columns(table.name)}
        added = [
            f"{0 if c.server_default else 'NULL'} AS {c.name}"
            for c in table.c
            if c.name not in have
        ]
        if added:
            shape = f"SELECT *, {', '.join(added)} FROM main.{table.name}"
            views.append(f"CREATE TEMP VIEW {table.name} AS {shape}")
    if views:
        event.listen(engine, "connect", lambda conn, _record: [conn.execute(v) for v in views])
        engine.dispose()  # connections made before have no views


OPEN_PATIENCE_S = 30.0  # how long opening waits out another process making the ledger


def ready_engine(url: str, engine: Engine | None = None, *, patience: float = 0.0) -> Engine:
    """The ledger's engine, its schema up to date. A ledger that another process is making at
    this moment (two first submits) can refuse us at once, busy timeout or not (SQLite does
    not wait while a new file turns to WAL): opening tries again for a while. A database out
    of reach (a PostgreSQL restart) is waited out for `patience` seconds, a try a second."""
    where = shown_ledger(url)
    with storage_errors("opening the ledger", where=where):
        engine = engine or make_engine(url)
    dialect = dialect_of(engine)
    began = time.monotonic()
    while True:
        try:
            with storage_errors("opening the ledger", dialect, where):
                if _due(engine):  # read-only: read as it is, through views of today's shape
                    _read_as_current(engine) if read_only(url) else migrate(engine)
            return engine
        except LedgerError as exc:
            waited = time.monotonic() - began
            if exc.busy and waited <= OPEN_PATIENCE_S:
                time.sleep(0.05)
            elif exc.out_of_reach and waited <= patience:
                time.sleep(1.0)
            else:
                raise
