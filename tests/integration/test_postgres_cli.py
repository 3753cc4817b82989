"""The real CLI with its ledger on a real PostgreSQL server (a throwaway cluster, see
tests/postgres.py): a job run, killed with kill -9 and resumed, audited from outside."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

from batchrun.sim import prompt_tag
from tests.integration.helpers import CLI, write_prompts
from tests.postgres import fresh_database

pytestmark = pytest.mark.integration

SLOW = ("--ttft-ms", "20", "--tpot-ms", "2")  # ~100 ms a request: long enough to interrupt

# Installed from outside, as an operator would: one row per result committed for an item.
AUDIT = """
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


@pytest.fixture
def pg_ledger(postgres_server: str) -> Iterator[str]:
    with fresh_database(postgres_server) as url:
        yield url


def plain(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


def counts(url: str, job: str) -> dict[str, int]:
    """Items by status, read from outside; {} while the ledger has no tables yet."""
    with psycopg.connect(plain(url)) as conn:
        try:
            rows = conn.execute(
                "SELECT status, count(*) FROM items WHERE job = %s GROUP BY status", (job,)
            ).fetchall()
        except psycopg.errors.UndefinedTable:
            return {}
    return {status: n for status, n in rows}


def test_kill_9_midway_then_resume_on_postgresql_commits_each_result_once(
    cli: CLI, sim_server: Callable[..., str], pg_ledger: str, tmp_path: Path
) -> None:
    url = sim_server(*SLOW)
    inp = tmp_path / "big.jsonl"
    prompts = write_prompts(inp, 300)
    ledger = ("--ledger", pg_ledger)
    loaded = cli.run(*ledger, "submit", str(inp), "--no-run", "--quiet")
    assert loaded.returncode == 0, loaded.stderr
    with psycopg.connect(plain(pg_ledger), autocommit=True) as conn:
        conn.execute(AUDIT)

    proc = cli.start(*ledger, "resume", "big", "--base-url", url, "--concurrency", "8", "--quiet")
    deadline = time.monotonic() + 60
    while counts(pg_ledger, "big").get("done", 0) < 60:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        assert time.monotonic() < deadline, counts(pg_ledger, "big")
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    before = counts(pg_ledger, "big")
    assert before.get("done", 0) < 300 and before.get("running", 0) > 0, before

    resumed = cli.run(*ledger, "resume", "big", "--base-url", url, "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    assert counts(pg_ledger, "big") == {"done": 300}
    with psycopg.connect(plain(pg_ledger)) as conn:
        per_line = conn.execute("SELECT line, count(*) FROM audit GROUP BY line").fetchall()
    assert sorted(line for line, _n in per_line) == list(range(1, 301))
    assert all(n == 1 for _line, n in per_line)  # no result committed twice
    output = cli.output("big")
    assert [o["id"] for o in output] == [f"item-{i}" for i in range(300)]
    for record, prompt in zip(output, prompts, strict=True):
        assert record["output"].startswith(prompt_tag(prompt)), (record, prompt)
    shown = cli.run(*ledger, "status", "big", "--json")
    assert shown.returncode == 0 and '"done": 300' in shown.stdout


def test_a_second_runner_of_a_live_job_on_postgresql_is_refused(
    cli: CLI, sim_server: Callable[..., str], pg_ledger: str, tmp_path: Path
) -> None:
    url = sim_server(*SLOW)
    inp = tmp_path / "busy.jsonl"
    write_prompts(inp, 200)
    ledger = ("--ledger", pg_ledger)
    first = cli.start(*ledger, "submit", str(inp), "--base-url", url, "--concurrency", "4", "-q")
    deadline = time.monotonic() + 60
    while counts(pg_ledger, "busy").get("done", 0) < 5:
        assert first.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    second = cli.run(*ledger, "resume", "busy", "--base-url", url, "--quiet")
    assert second.returncode == 2 and "is being run by process" in second.stderr
    first.send_signal(signal.SIGINT)
    assert first.wait(timeout=30) == 130
