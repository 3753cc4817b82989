"""Engines and errors: an engine made by the URL's dialect, driver errors as LedgerError."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Engine
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from batchrun.errors import LedgerError
from batchrun.ledger.dialect import SQLITE, Dialect, dialect_for


def make_engine(url: str) -> Engine:
    try:
        dialect = dialect_for(url)
    except ArgumentError:
        raise LedgerError(f"not a ledger URL: {shown_url(url)}") from None
    return dialect.engine(url)


def shown_url(url: str) -> str:
    """The ledger URL as it may be shown: a password in it becomes ***."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return "(an unreadable ledger URL)"


@contextmanager
def storage_errors(action: str, dialect: Dialect = SQLITE) -> Iterator[None]:
    """Turn driver errors into one clear LedgerError (disk full, read-only, corrupt, a
    database server out of reach...)."""
    try:
        yield
    except SQLAlchemyError as exc:
        # The driver's own message only: SQLAlchemy's text would repeat the SQL and its
        # parameters, which hold prompts.
        reason = str(getattr(exc, "orig", None) or type(exc).__name__).strip()
        busy = "locked" in reason or "busy" in reason or dialect.conflict(exc)
        away = dialect.out_of_reach(exc)
        if "disk I/O error" in reason or "full" in reason:
            reason += " (is the disk full, or the file over a size limit?)"
        elif "unable to open database file" in reason:
            reason += " (does the folder exist, and is it writable? read-only filesystem?)"
        raise LedgerError(
            f"ledger error while {action}: {reason}", busy=busy, out_of_reach=away
        ) from None
