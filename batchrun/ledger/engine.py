"""Engines and errors: an engine made by the URL's dialect, driver errors as LedgerError."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Engine
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from batchrun.errors import LedgerError
from batchrun.ledger.dialect import SQLITE, Dialect, dialect_for, ledger_file

SECRET_QUERY = ("password", "sslpassword")  # libpq reads a password from the query too


def make_engine(url: str) -> Engine:
    return dialect_for(url).engine(url)  # an unreadable URL is refused there, not echoed


def shown_url(url: str) -> str:
    """The ledger URL as it may be shown: a password in it (or in its query) becomes ***."""
    try:
        found = make_url(url)
    except (ArgumentError, ValueError):
        return "(an unreadable ledger URL)"
    hidden = {k: "***" for k in SECRET_QUERY if k in found.query}
    return found.update_query_dict(hidden).render_as_string(hide_password=True)


def shown_ledger(url: str) -> str:
    """Where a ledger is, as errors name it: an SQLite ledger's file, else its shown URL."""
    file = ledger_file(url)
    return str(file[0]) if file is not None else shown_url(url)


@contextmanager
def storage_errors(action: str, dialect: Dialect = SQLITE, where: str = "") -> Iterator[None]:
    """Turn driver errors into one clear LedgerError, on one line, naming the ledger (`where`)
    and the reason (disk full, read-only, corrupt, a database server out of reach...)."""
    try:
        yield
    except SQLAlchemyError as exc:
        # The driver's own message only: SQLAlchemy's text would repeat the SQL and its
        # parameters, which hold prompts. Its line breaks (psycopg's hints) become spaces.
        reason = " ".join(str(getattr(exc, "orig", None) or type(exc).__name__).split())
        busy = "locked" in reason or "busy" in reason or dialect.conflict(exc)
        away = dialect.out_of_reach(exc)
        if "disk I/O error" in reason or "full" in reason:
            reason += " (is the disk full, or the file over a size limit?)"
        elif "unable to open database file" in reason:
            reason += " (does the folder exist, and is it writable? read-only filesystem?)"
        elif "no such column" in reason or "UndefinedColumn" in reason:
            reason += (
                " (a ledger an older batchrun made, read-only: open it once with write access)"
            )
        at = f" ({where})" if where else ""
        raise LedgerError(
            f"ledger error while {action}{at}: {reason}", busy=busy, out_of_reach=away
        ) from None
