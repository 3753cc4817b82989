"""The ledger as an operator sees it from outside, with the database's own client: item counts,
and an audit trigger, installed from outside, that adds a row for every result committed (a
result committed twice would show as two rows for one line)."""

from __future__ import annotations

import sqlite3

import psycopg

SQLITE_AUDIT = """
CREATE TABLE audit (job TEXT, line INTEGER);
CREATE TRIGGER audit_results AFTER UPDATE ON items
WHEN OLD.status IN ('running', 'batched') AND NEW.status IN ('done', 'failed', 'invalid')
BEGIN INSERT INTO audit VALUES (NEW.job, NEW.line); END;
"""
POSTGRES_AUDIT = """
CREATE TABLE audit (job text, line integer);
CREATE FUNCTION audit_result() RETURNS trigger AS $$
BEGIN
  IF OLD.status IN ('running', 'batched') AND NEW.status IN ('done', 'failed', 'invalid') THEN
    INSERT INTO audit VALUES (NEW.job, NEW.line);
  END IF;
  RETURN NEW;
END $$ LANGUAGE plpgsql;
CREATE TRIGGER audit_results AFTER UPDATE ON items
  FOR EACH ROW EXECUTE FUNCTION audit_result();
"""


class Outside:
    """A ledger URL (sqlite:///PATH or postgresql+psycopg://...) read with the database's
    own client, not batchrun's."""

    def __init__(self, url: str) -> None:
        self.sqlite = url.startswith("sqlite:///")
        self.target = url.removeprefix("sqlite:///") if self.sqlite else url
        self.target = self.target.replace("postgresql+psycopg://", "postgresql://")

    def query(self, sql: str) -> list[tuple[object, ...]]:
        if self.sqlite:
            conn = sqlite3.connect(self.target, timeout=30)
            try:
                return conn.execute(sql).fetchall()
            finally:
                conn.close()
        with psycopg.connect(self.target) as pg:
            return list(pg.execute(sql).fetchall())

    def install_audit(self) -> None:
        if self.sqlite:
            with sqlite3.connect(self.target) as conn:
                conn.executescript(SQLITE_AUDIT)
        else:
            with psycopg.connect(self.target, autocommit=True) as pg:
                pg.execute(POSTGRES_AUDIT)

    def counts(self, job: str | None = None) -> dict[str, int]:
        """Items by status (of one job, or all); {} while the ledger has no tables yet."""
        where = f" WHERE job = '{job}'" if job else ""
        try:
            rows = self.query(f"SELECT status, count(*) FROM items{where} GROUP BY status")
        except (sqlite3.OperationalError, psycopg.errors.UndefinedTable):
            return {}
        return {str(status): int(str(n)) for status, n in rows}

    def committed_once(self, lines: int, job: str | None = None) -> bool:
        """Every line 1..lines committed exactly once (of one job, or all), by the audit."""
        where = f" WHERE job = '{job}'" if job else ""
        per_line = dict(self.query(f"SELECT line, count(*) FROM audit{where} GROUP BY line"))
        return sorted(per_line) == list(range(1, lines + 1)) and set(per_line.values()) == {1}
