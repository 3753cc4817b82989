"""Statements compiled once and run for many rows by the database driver itself.

SQLAlchemy's executemany builds each row's parameters in Python (a dict, a bind check per value),
and on a running job the ledger's thread holds the GIL that the sending thread needs for all of
it: recording a result took half again the CPU it takes this way (benchmarks/ledger_record.py).
A `Many` is compiled once for its database and hands the driver plain tuples, so its rows must
hold the driver's own types (str, int, float, None). Loading input lines (ingest.py) and
recording results (store.py) go through it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

from sqlalchemy import Connection, CursorResult, Insert
from sqlalchemy.engine import Dialect
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.elements import ClauseElement


@dataclass(frozen=True)
class Many:
    sql: str
    names: tuple[str, ...]  # what each row holds, in order
    order: tuple[int, ...] | None  # the driver's order of `names`, where it is not theirs
    positional: bool  # the driver takes tuples (SQLite); else dicts (psycopg)

    @classmethod
    def compile(cls, stmt: ClauseElement, dialect: Dialect, names: Sequence[str]) -> Many:
        """`stmt` compiled for `dialect`, run with rows of `names`' values: its parameters, or
        an insert's columns (all of them, in the row's order)."""
        names = tuple(names)
        keys = list(names) if isinstance(stmt, Insert) else None  # an insert's columns
        compiled = stmt.compile(dialect=dialect, column_keys=keys)
        assert isinstance(compiled, SQLCompiler)
        if sorted(compiled.binds) != sorted(names):  # a value set in the statement, a typo
            raise ValueError(f"the statement's parameters are {sorted(compiled.binds)}")
        driver = tuple(compiled.positiontup or ()) if compiled.positional else None
        order = None
        if driver is not None and driver != names:
            order = tuple(names.index(name) for name in driver)
        return cls(str(compiled), names, order, driver is not None)

    def run(self, conn: Connection, rows: Sequence[tuple[Any, ...]]) -> CursorResult[Any]:
        """Run it once for each row, in one call to the driver; the driver's result."""
        params: Any = rows
        if not self.positional:
            params = [dict(zip(self.names, row, strict=True)) for row in rows]
        elif self.order is not None:
            params = list(map(itemgetter(*self.order), rows))
        return conn.exec_driver_sql(self.sql, params)
