"""Hostile review (workers4): the fixes of the workers reviews attacked: a worker frozen past its
lease and woken (Feeder.recheck, Ledger.rejoin, the grace a rejoin gives the others), the lines it
lost, leases of workers that run with other --lease values. Each test fails on the code as
reviewed and names the defect it shows."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest

from tests.audit import Outside
from tests.hostile.test_workers2 import finished
from tests.integration.conftest import cli, sim_server
from tests.integration.helpers import CLI, sim_stats, write_prompts
from tests.postgres import fresh_database

__all__ = ["cli", "sim_server"]  # the fixtures, shared with tests/integration

pytestmark = pytest.mark.integration


def loaded(cli: CLI, tmp_path: Path, job: str, items: int, *ledger: str) -> None:
    inp = tmp_path / f"{job}.jsonl"
    write_prompts(inp, items)
    done = cli.run(*ledger, "submit", str(inp), "--no-run", "--quiet")
    assert done.returncode == 0, done.stderr


def until(what: Callable[[], object], timeout: float = 60, every: float = 0.05) -> object:
    deadline = time.monotonic() + timeout
    while True:
        got = what()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every)


def sqlite_url(cli: CLI) -> str:
    return f"sqlite:///{cli.home / 'jobs' / 'ledger.db'}"


def worker_of(db: Outside, pid: int) -> str | None:
    rows = db.query(f"SELECT id FROM workers WHERE pid = {pid}")
    return str(rows[0][0]) if rows else None


def held_by(db: Outside, job: str, worker: str) -> int:
    rows = db.query(
        f"SELECT count(*) FROM items WHERE job = '{job}' AND owner = '{worker}' "
        "AND status = 'running'"
    )
    return int(str(rows[0][0]))


def test_lines_a_woken_worker_lost_and_claims_again_are_never_sent(
    cli: CLI, sim_server: Callable[..., str], tmp_path: Path
) -> None:
    """Feeder.recheck adds the lines a worker lost while frozen to `_lost` and never takes
    them out: when those lines come back to pending (the worker that took them stopped) and
    the woken worker claims them again, `still_held` says no and it never sends them; it ends
    with them leased to itself, and its release leaves them pending. Observed: the woken
    worker ended with 31 of 40 lines still pending (it sent none of them), though it was the
    only worker left."""
    url = sim_server("--ttft-ms", "1500", "--tpot-ms", "1")
    db = Outside(sqlite_url(cli))
    loaded(cli, tmp_path, "lost", 40)
    run = ("resume", "lost", "--base-url", url, "--concurrency", "1", "--lease", "2", "-q")
    frozen = cli.start(*run)
    taker: subprocess.Popen[str] | None = None
    try:
        a = str(until(lambda: worker_of(db, frozen.pid)))
        until(lambda: held_by(db, "lost", a) >= 32)  # one request in flight, the rest queued
        frozen.send_signal(signal.SIGSTOP)
        time.sleep(3)  # past its 2 s lease
        taker = cli.start(*run)  # its join reclaims the frozen worker's items
        until(lambda: held_by(db, "lost", a) == 0)
        b = str(until(lambda: worker_of(db, taker.pid)))
        until(lambda: held_by(db, "lost", b) > 0)
        taker.send_signal(signal.SIGTERM)  # it leaves: its claims go back to pending at once
        finished(taker, 90)
    finally:
        if taker is not None and taker.poll() is None:
            taker.kill()
        frozen.send_signal(signal.SIGCONT)
    code, _, _ = finished(frozen, 90)
    counts = db.counts("lost")
    assert counts == {"done": 40}, (
        f"the woken worker, alone on the job, ended (exit {code}) with {counts}: the lines it "
        f"lost while frozen came back to pending and it never sent them; {sim_stats(url)}"
    )


def test_a_rejoin_cuts_a_live_worker_s_longer_lease_to_its_own_and_then_takes_its_items(
    cli: CLI, sim_server: Callable[..., str], tmp_path: Path
) -> None:
    """workers.rejoin gives "every worker still running a lease's grace" by setting the
    leases of all their items to now + the REJOINER's --lease: a live worker running with a
    longer lease (120 s here, the rejoiner 2 s) has its leases cut to 2 s, and the rejoiner's
    next heartbeats reclaim them as expired while their owner is alive and waiting for the
    answers (README: a worker with a short lease never reclaims from a live one with a longer
    lease). Observed: the woken worker (lease 2 s) sent all 32 lines the live worker (lease
    120 s) had in flight again: 64 requests for 32 lines."""
    slow = sim_server("--ttft-ms", "20000", "--tpot-ms", "1")  # the long-lease worker's server
    fast = sim_server("--ttft-ms", "20", "--tpot-ms", "1")  # the short-lease worker's
    db = Outside(sqlite_url(cli))
    loaded(cli, tmp_path, "cut", 32)
    base = ("resume", "cut", "-q")
    live = cli.start(*base, "--base-url", slow, "--lease", "120", "--concurrency", "32")
    short: subprocess.Popen[str] | None = None
    try:
        b = str(until(lambda: worker_of(db, live.pid)))
        until(lambda: held_by(db, "cut", b) == 32)  # all 32 in flight, for 20 s
        short = cli.start(*base, "--base-url", fast, "--lease", "2", "--concurrency", "4")
        until(lambda: worker_of(db, short.pid))
        time.sleep(1)  # joined: nothing to claim, it waits for the live worker's items
        short.send_signal(signal.SIGSTOP)
        time.sleep(4)  # past its own 2 s lease (far inside the live worker's 120 s)
        short.send_signal(signal.SIGCONT)
        code, _, _ = finished(short, 90)
    finally:
        if short is not None and short.poll() is None:
            short.kill()
        live_code, _, _ = finished(live, 90)
    resent = sim_stats(fast)["requests"]
    assert resent == 0, (
        f"the worker back from its freeze (lease 2 s, exit {code}) sent {resent} of the 32 lines "
        f"a live worker with a 120 s lease had in flight (it exited {live_code}); "
        f"{sim_stats(slow)['requests']} requests there: paid twice"
    )


def test_a_worker_woken_after_gc_collected_its_job_does_not_say_it_finished_it(
    cli: CLI, sim_server: Callable[..., str], tmp_path: Path
) -> None:
    """A join of a job `gc` collected is refused (workers.join: "its rest and results are
    gone"); workers.rejoin does not look: a worker frozen past its lease while `gc` collected
    its job (no live worker runs it) wakes, rejoins (its worker row gone: `last` None), holds
    nothing, finds nothing to claim and ends as if the job were complete. Observed: of a
    40-line job, 3 answered before the freeze; after `gc --older-than 2s` removed 37 items,
    the woken worker exited 0 saying "job gone: 3 done" and wrote a results file of 3 lines
    where gc had removed the job's results."""
    url = sim_server("--ttft-ms", "300", "--tpot-ms", "1")
    db = Outside(sqlite_url(cli))
    loaded(cli, tmp_path, "gone", 40)
    run = ("resume", "gone", "--base-url", url, "--concurrency", "1", "--lease", "2", "-q")
    frozen = cli.start(*run)
    try:
        until(lambda: db.counts("gone").get("done", 0) >= 3)
        frozen.send_signal(signal.SIGSTOP)
        time.sleep(4)  # past its 2 s lease, and 2 s untouched
        collected = cli.run("gc", "--older-than", "2s")
        assert collected.returncode == 0 and "removed 1 job" in collected.stderr, collected
    finally:
        frozen.send_signal(signal.SIGCONT)
    code, _, err = finished(frozen, 90)
    results = cli.home / "outputs" / "gone.jsonl"
    written = len(results.read_text().splitlines()) if results.exists() else None
    assert code != 0 and written is None, (
        f"the worker woken in a job gc collected exited {code} ({err.strip()[-200:]!r}) and "
        f"wrote a results file of {written} of the 40 lines"
    )


def test_a_join_that_waited_past_the_lease_for_the_job_s_lock_lets_in_other_answers(
    cli: CLI, sim_server: Callable[..., str], tmp_path: Path, postgres_server: str
) -> None:
    """Ledger.join was taught that a wait for the job's lock past the lease judges nobody
    (reclaim_dead only when `fresh`), but the check of options (check_same) in the same
    transaction, and in prepare_reuse's join before it, still counts the live worker as gone
    by its heartbeat, kept away by the same lock: the joiner with another --max-tokens is let
    in and stores its options as the job's, and the worker that ran the job all along is then
    refused at its own rejoin. Observed (PostgreSQL, the job's row locked 23 s past a 21 s
    lease while a `resume --max-tokens 7` queued behind it), in 4 runs of 4: the joiner exited
    0 and answered 24-79 of 200 lines under max_tokens 7, the job's stored spec said 7, and in
    3 of them the worker that ran the job all along exited 2 ("--max-tokens (not set) here, 7
    there"): 2 answer specs in one job."""
    url = sim_server("--ttft-ms", "200", "--tpot-ms", "1")
    with fresh_database(postgres_server) as pg:
        db = Outside(pg)
        ledger = ("--ledger", pg)
        loaded(cli, tmp_path, "lk", 200, *ledger)
        run = (*ledger, "resume", "lk", "--base-url", url, "--concurrency", "2", "-q")
        live = cli.start(*run, "--lease", "21")  # beats every 7 s
        other: subprocess.Popen[str] | None = None
        try:
            b = str(until(lambda: worker_of(db, live.pid)))
            beat = db.query(f"SELECT heartbeat FROM workers WHERE id = '{b}'")[0][0]
            until(
                lambda: db.query(f"SELECT heartbeat FROM workers WHERE id = '{b}'")[0][0] != beat,
                timeout=30,
            )  # it just beat: its next beat is 7 s on, queued behind the joiner's
            lock = psycopg.connect(pg.replace("postgresql+psycopg://", "postgresql://"))
            lock.execute("SELECT name FROM jobs WHERE name = 'lk' FOR UPDATE").fetchall()
            held_from = time.monotonic()
            other = cli.start(*run, "--lease", "21", "--max-tokens", "7")
            time.sleep(max(0.0, 23 - (time.monotonic() - held_from)))  # past the lease
            lock.commit()
            lock.close()
            code, _, err = finished(other, 90)
        finally:
            if other is not None and other.poll() is None:
                other.kill()
            live_code, _, live_err = finished(live, 90)
        stored = db.query("SELECT spec FROM jobs WHERE name = 'lk'")[0][0]
        specs = db.query("SELECT answer_spec, count(*) FROM items GROUP BY answer_spec")
    assert code == 2, (
        f"the joiner with --max-tokens 7 that waited past the lease for the job's lock exited "
        f"{code} ({err.strip()[-150:]!r}); the worker running the job exited {live_code} "
        f"({live_err.strip()[-160:]!r}); answers by spec {[n for _, n in specs]}; the job's "
        f"stored max_tokens: {str(stored).split('max_tokens')[1][:8] if stored else None}"
    )
