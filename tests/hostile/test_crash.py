"""The promise "never loses work", attacked through the real CLI in subprocesses against
`batchrun sim` on 127.0.0.1: kill -9 at many moments, SIGTERM, several resumes, PostgreSQL
workers. Each test fails on the code as reviewed and names the defect it shows."""

from __future__ import annotations

import json
import re
import signal
import sqlite3
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration.conftest import cli, sim_server
from tests.integration.helpers import CLI, sim_stats, write_prompts

__all__ = ["cli", "sim_server"]  # the fixtures, shared with tests/integration

pytestmark = pytest.mark.integration

SLOW = ("--ttft-ms", "10", "--tpot-ms", "1")


def _kill_when_done(cli: CLI, job: str, run: tuple[str, ...], done: int) -> None:
    """Start `run`, wait until the ledger shows `done` items done, then kill -9 it."""
    proc = cli.start(*run)
    try:
        cli.wait_for(job, done, proc)
        assert proc.poll() is None, "the run ended before the kill"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)


def test_one_resume_after_a_kill_9_is_not_said_to_be_two_workers(
    cli: CLI, sim_server: Callable[..., str], tmp_path: Path
) -> None:
    """The summary says how many workers took part; a lone `resume` after a crash counted the
    dead runner it reclaimed from (marked stopped by this run's join, so 'after the start')."""
    url = sim_server(*SLOW)
    inp = tmp_path / "alone.jsonl"
    write_prompts(inp, 300)
    run = ("submit", str(inp), "--base-url", url, "--model", "sim-1", "--concurrency", "4")
    assert cli.run(*run, "--no-run").returncode == 0
    _kill_when_done(cli, "alone", run, 40)
    resumed = cli.run("resume", "alone")
    assert resumed.returncode == 0, resumed.stderr
    summary = resumed.stderr.strip().splitlines()[-1]
    said = re.search(r"(\d+) workers", summary)
    assert said is None, f"one process ran the rest, the summary says: {summary}"


def test_ctrl_c_twice_stops_a_run_that_waits_for_a_busy_ledger(
    cli: CLI, sim_server: Callable[..., str], tmp_path: Path
) -> None:
    """Another process holds the SQLite write lock (a long ingest into the same ledger, an
    operator's open transaction, gc): the run waits for it, up to 10 minutes, as documented.
    Ctrl-C, then Ctrl-C again ("stop now"), must still end the process; the results it holds
    may be sent again by `resume`. It kept waiting for the lock (minutes) whatever was
    pressed: the last commit and the release after a stop wait out the lock like any other.
    After "stop now" they wait for it 1 s each (the call already waiting ends first: SQLite's
    busy timeout, 30 s)."""
    url = sim_server("--ttft-ms", "50", "--tpot-ms", "2")
    inp = tmp_path / "held.jsonl"
    write_prompts(inp, 2000)
    run = ("submit", str(inp), "--base-url", url, "--model", "sim-1", "--concurrency", "8")
    assert cli.run(*run, "--no-run").returncode == 0
    proc = cli.start(*run)
    lock = None
    try:
        cli.wait_for("held", 50, proc)
        lock = sqlite3.connect(cli.home / "jobs" / "ledger.db", timeout=30, isolation_level=None)
        lock.execute("BEGIN IMMEDIATE")  # the write lock, held as a long ingest holds it
        time.sleep(1.0)  # the run now waits on the lock (a commit or a claim)
        proc.send_signal(signal.SIGINT)
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)  # "Ctrl-C again to stop now"
        try:
            # generous: one SQLite call already waiting may take its 30 s busy timeout
            proc.wait(timeout=45)
        except subprocess.TimeoutExpired:
            pytest.fail("two Ctrl-Cs and 45 s later the run is still waiting for the ledger")
    finally:
        if lock is not None:
            lock.execute("ROLLBACK")
            lock.close()
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
    # ended, as told; the answers it held could not be committed (the ledger stayed locked):
    # exit 2, the code for a ledger that cannot be written, and `resume` sends them again
    assert proc.returncode == 2


def test_a_results_file_killed_mid_write_leaves_no_temp_file_behind(
    cli: CLI, tmp_path: Path
) -> None:
    """Results are written to a hidden temp file and renamed. A kill -9 (OOM killer, power
    cut) while a big results file is written left `.JOB.jsonl.tmp-PID-TID` in outputs/ for
    ever: the next write uses another name (its own pid) and nothing ever removes it, so each
    crash leaves a results file's worth of disk behind."""
    inp = tmp_path / "big.jsonl"
    write_prompts(inp, 100_000)
    assert cli.run("submit", str(inp), "--backend", "sim", "--no-run", "--quiet").returncode == 0
    outputs = cli.home / "outputs"
    proc = cli.start("export", "big")
    try:
        deadline = time.monotonic() + 60
        while not list(outputs.glob(".*tmp*")):
            assert proc.poll() is None, "the export ended before it could be killed"
            assert time.monotonic() < deadline, "no temp file was ever written"
            time.sleep(0.005)
        time.sleep(0.1)  # mid-write
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    again = cli.run("export", "big")  # the same file written again, as resume would
    assert again.returncode == 0, again.stderr
    assert len(cli.output("big")) == 100_000
    assert sorted(p.name for p in outputs.iterdir()) == ["big.jsonl"]


def test_two_workers_waiting_out_a_busy_ledger_do_not_take_each_others_answered_items(
    cli: CLI, sim_server: Callable[..., str], tmp_path: Path
) -> None:
    """Another process holds the SQLite write lock longer than the workers' lease (a big
    ingest into the same ledger, which the README says a run waits out). Neither worker could
    beat meanwhile; the first to get the lock took the other's heartbeat for a dead worker's
    and reclaimed its items, whose answers had come back and waited in memory: the other's
    commit was then turned away and those items were sent and paid for again. Nobody stalled
    but the ledger, and both workers saw it (their own heartbeats were just as old)."""
    url = sim_server("--ttft-ms", "50", "--tpot-ms", "2")
    inp = tmp_path / "pair.jsonl"
    write_prompts(inp, 600)
    assert cli.run("submit", str(inp), "--no-run", "--quiet").returncode == 0
    run: tuple[str, ...] = ("resume", "pair", "--base-url", url, "--model", "sim-1")
    run = (*run, "--concurrency", "8", "--lease", "3", "--quiet")
    workers = [cli.start(*run) for _ in range(2)]
    try:
        cli.wait_for("pair", 100, workers[0])
        lock = sqlite3.connect(cli.home / "jobs" / "ledger.db", timeout=30, isolation_level=None)
        lock.execute("BEGIN IMMEDIATE")  # held past the 3 s lease, as a big load holds it
        time.sleep(8)
        lock.execute("ROLLBACK")
        lock.close()
        codes = [w.wait(timeout=120) for w in workers]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait(timeout=10)
    assert codes == [0, 0]
    assert cli.counts("pair") == {"done": 600}
    stats = sim_stats(url)
    log = [json.loads(line) for line in (cli.home / "logs" / "pair.log").open()]
    taken = sum(e["items"] for e in log if e["event"] == "reclaimed")
    assert (stats["requests"], stats["resent_after_success"], taken) == (600, 0, 0), stats


def test_postgres_a_worker_whose_machine_dies_mid_transaction_does_not_stall_the_others(
    cli: CLI, sim_server: Callable[..., str], postgres_server: str, tmp_path: Path
) -> None:
    """A worker's machine that dies (power cut, network gone) mid-transaction leaves its
    PostgreSQL session open, 'idle in transaction', holding row locks, until the server's TCP
    keepalive gives up (over two hours by default). The worker is modelled by a process frozen
    with SIGSTOP at the moment the database shows it idle inside a transaction that wrote rows
    (a group commit, a heartbeat...). Its --lease is 3 s, so the live worker should take its
    items and finish. It hung instead, for as long as the session stays open: in the reclaim's
    UPDATE of the dead worker's items (row locks), or at the job's row lock that heartbeats,
    joins and the release take, with its ledger thread (claims, commits) queued behind; seen
    both with items left and with all 600 done (the job never ends, no results file). There is
    no lock_timeout, no idle_in_transaction_session_timeout, no TCP keepalive. Now a run's
    write transactions may sit idle no longer than its lease: the server ends the frozen one."""
    import psycopg

    from tests.postgres import fresh_database

    url = sim_server("--ttft-ms", "20", "--tpot-ms", "2")
    inp = tmp_path / "gone.jsonl"
    # enough that the victim is still running when a freeze catches it inside a write: the
    # victim sends 2 at a time, so 1,200 take it a minute or more between freezes (at 8 at a time,
    # it once did them all first in CI: the moments inside a write are short); the live worker
    # sends 16 at a time to finish what is left
    write_prompts(inp, 1200)
    with fresh_database(postgres_server) as db:
        ledger = ("--ledger", db)
        assert cli.run(*ledger, "submit", str(inp), "--no-run", "--quiet").returncode == 0

        def worker(name: str, concurrency: int) -> subprocess.Popen[str]:
            where = f"{db}?application_name={name}"  # to find its session from outside
            return cli.start(
                *("--ledger", where, "resume", "gone", "--base-url", url, "--model", "sim-1"),
                *("--concurrency", str(concurrency), "--lease", "3", "--quiet"),
            )

        plain = db.replace("postgresql+psycopg://", "postgresql://")
        victim = worker("victim", 2)
        live: subprocess.Popen[str] | None = None
        try:
            with psycopg.connect(plain, autocommit=True) as outside:

                def items() -> dict[str, int]:
                    rows = outside.execute(
                        "SELECT status, count(*) FROM items WHERE job = 'gone' GROUP BY status"
                    ).fetchall()
                    return {str(status): int(n) for status, n in rows}

                def in_a_writing_transaction() -> bool:
                    found = outside.execute(
                        "SELECT 1 FROM pg_stat_activity WHERE application_name = 'victim' "
                        "AND state LIKE 'idle in transaction%' AND backend_xid IS NOT NULL"
                    ).fetchall()
                    return bool(found)

                while items().get("done", 0) < 30:  # mid-run
                    assert victim.poll() is None, "the victim ended early"
                    time.sleep(0.05)
                deadline = time.monotonic() + 60
                while True:  # freeze it; keep it frozen once caught inside a transaction
                    assert victim.poll() is None, f"the victim ended first: {items()}"
                    assert time.monotonic() < deadline, "never caught inside a transaction"
                    victim.send_signal(signal.SIGSTOP)
                    time.sleep(0.05)
                    if in_a_writing_transaction():
                        break
                    victim.send_signal(signal.SIGCONT)
                    time.sleep(0.01)
                live = worker("live", 16)
                try:
                    live.wait(timeout=45)  # its lease is 3 s; 45 s is far past it
                except subprocess.TimeoutExpired:
                    counts = items()
                    pytest.fail(
                        "the live worker (lease 3 s) has not ended 45 s after joining, stuck "
                        f"behind the frozen worker's open transaction; items: {counts}"
                    )
                assert live.returncode == 0, live.stderr.read() if live.stderr else ""
        finally:
            for proc in (victim, live):
                if proc is not None and proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=10)
