"""Three workers on one job, one of them killed with kill -9 at a random moment, ten times over
(a new worker taking its place each time), on SQLite (local processes sharing the file) and on
PostgreSQL: no item lost, no result committed twice, as counted by an audit trigger installed
from outside, and the results file in input order."""

from __future__ import annotations

import random
import signal
import sqlite3
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest

from tests.integration.helpers import CLI, write_prompts

pytestmark = pytest.mark.integration

SLOW = ("--ttft-ms", "20", "--tpot-ms", "2")  # ~100 ms a request
ITEMS, KILLS = 3000, 10

SQLITE_AUDIT = """
CREATE TABLE audit (job TEXT, line INTEGER);
CREATE TRIGGER audit_results AFTER UPDATE ON items
WHEN OLD.status = 'running' AND NEW.status IN ('done', 'failed', 'invalid')
BEGIN INSERT INTO audit VALUES (NEW.job, NEW.line); END;
"""
POSTGRES_AUDIT = """
CREATE TABLE audit (job text, line integer);
CREATE FUNCTION audit_result() RETURNS trigger AS $$
BEGIN
  IF OLD.status = 'running' AND NEW.status IN ('done', 'failed', 'invalid') THEN
    INSERT INTO audit VALUES (NEW.job, NEW.line);
  END IF;
  RETURN NEW;
END $$ LANGUAGE plpgsql;
CREATE TRIGGER audit_results AFTER UPDATE ON items
  FOR EACH ROW EXECUTE FUNCTION audit_result();
"""


class Outside:
    """The ledger as an operator sees it, with the database's own client."""

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

    def counts(self) -> dict[str, int]:
        rows = self.query("SELECT status, count(*) FROM items GROUP BY status")
        return {str(status): int(str(n)) for status, n in rows}


def joined(outside: Outside, workers: int, seed: int) -> None:
    deadline = time.monotonic() + 60
    while outside.query("SELECT count(*) FROM workers")[0][0] != workers:
        assert time.monotonic() < deadline, f"seed {seed}: {workers} workers never joined"
        time.sleep(0.05)


def test_ten_kill_9s_among_three_workers_lose_nothing_and_commit_nothing_twice(
    cli: CLI, sim_server: Callable[..., str], ledger_url: str, tmp_path: Path
) -> None:
    url = sim_server(*SLOW)
    inp = tmp_path / "night.jsonl"
    write_prompts(inp, ITEMS)
    ledger = ("--ledger", ledger_url)
    assert cli.run(*ledger, "submit", str(inp), "--no-run", "--quiet").returncode == 0
    outside = Outside(ledger_url)
    outside.install_audit()
    run = (*ledger, "resume", "night", "--base-url", url, "--concurrency", "4", "--lease", "3")
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)  # the moments, reproducible from the failure message
    workers = [cli.start(*run, "--quiet") for _ in range(3)]
    killed: list[subprocess.Popen[str]] = []
    for _ in range(KILLS):
        joined(outside, len(workers) + len(killed), seed)  # each victim is at work
        time.sleep(rng.uniform(0.0, 0.8))
        victim = workers.pop(rng.randrange(len(workers)))
        assert victim.poll() is None, f"seed {seed}: the job ended before {KILLS} kills"
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=10)  # reaped, as init would: a zombie still answers kill(pid, 0)
        killed.append(victim)
        workers.append(cli.start(*run, "--quiet"))
    codes = [w.wait(timeout=300) for w in workers]
    said = [w.stderr.read() if w.stderr else "" for w in workers]
    assert codes == [0, 0, 0], (seed, codes, said)
    assert all(k.returncode == -signal.SIGKILL for k in killed)
    assert outside.counts() == {"done": ITEMS}, seed
    per_line = dict(outside.query("SELECT line, count(*) FROM audit GROUP BY line"))
    assert sorted(per_line) == list(range(1, ITEMS + 1)), seed  # every item committed
    assert set(per_line.values()) == {1}, seed  # and none twice
    took_part = outside.query("SELECT count(*) FROM workers")[0][0]
    assert took_part == 3 + KILLS
    assert [o["id"] for o in cli.output("night")] == [f"item-{i}" for i in range(ITEMS)]
