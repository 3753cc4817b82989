"""Hostile review (workers2): one job run by several workers at once, on SQLite and PostgreSQL.
Each test fails on the code as reviewed and names the defect it shows."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

from batchrun import api
from batchrun import jobs as verbs
from batchrun.errors import LedgerError
from batchrun.ledger import Ledger
from tests.audit import Outside
from tests.integration.conftest import cli, sim_server
from tests.integration.helpers import CLI, sim_stats, write_prompts
from tests.postgres import Cluster, fresh_database, throwaway_cluster
from tests.unit.test_reuse import load

__all__ = ["cli", "sim_server"]  # the fixtures, shared with tests/integration

SLOW = ("--ttft-ms", "40", "--tpot-ms", "2")  # ~0.1 s a request


def loaded(cli: CLI, tmp_path: Path, job: str, items: int) -> None:
    inp = tmp_path / f"{job}.jsonl"
    write_prompts(inp, items)
    done = cli.run("submit", str(inp), "--no-run", "--quiet")
    assert done.returncode == 0, done.stderr


def finished(proc: subprocess.Popen[str], timeout: float = 60) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"worker still running after {timeout}s: {err[-2000:]}") from None
    return proc.returncode, out, err


@pytest.fixture(params=["sqlite", "postgresql"])
def engine_ledger(request: pytest.FixtureRequest, cli: CLI) -> Iterator[str]:
    """A ledger URL for the CLI's workers: the home's SQLite file, or a fresh PostgreSQL
    database on the session's server."""
    if request.param == "sqlite":
        yield f"sqlite:///{cli.home / 'jobs' / 'ledger.db'}"
        return
    with fresh_database(request.getfixturevalue("postgres_server")) as url:
        yield url


def wait_done(url: str, job: str, done: int, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 60
    while Outside(url).counts(job).get("done", 0) < done:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        assert time.monotonic() < deadline, Outside(url).counts(job)
        time.sleep(0.05)


def test_a_worker_woken_after_its_lease_sends_nothing_for_items_it_lost(
    cli: CLI, sim_server: Callable[..., str], tmp_path: Path, engine_ledger: str
) -> None:
    """README: "A worker that stalls past its lease loses its items to the live ones and
    commits nothing for them when it wakes." A worker at --concurrency 1 leases 32 items (four
    limits, at least 32) and has one request in flight; frozen (SIGSTOP) past its lease, its
    items go to a live worker that answers every line. Woken (SIGCONT), it still sends a
    request for every item it had queued: paid twice for ~30 lines beyond what it had in
    flight, though the ledger throws each answer away (and no budget or `status` counts
    them: the ledger's paid tokens are those of committed answers)."""
    url = sim_server(*SLOW)
    ledger = ("--ledger", engine_ledger)
    inp = tmp_path / "frozen.jsonl"
    write_prompts(inp, 80)
    assert cli.run(*ledger, "submit", str(inp), "--no-run", "-q").returncode == 0
    run = (*ledger, "resume", "frozen", "--base-url", url, "--lease", "2", "-q")
    frozen = cli.start(*run, "--concurrency", "1")
    try:
        wait_done(engine_ledger, "frozen", 2, frozen)
        frozen.send_signal(signal.SIGSTOP)
        held = Outside(engine_ledger).counts("frozen").get("running", 0)
        assert held > 2  # it leased a backlog beyond its one request in flight
        live = cli.run(*run, "--concurrency", "8", timeout=120)
        assert live.returncode == 0, live.stderr
        assert Outside(engine_ledger).counts("frozen") == {"done": 80}
        before = sim_stats(url)
    finally:
        frozen.send_signal(signal.SIGCONT)
    code, _, err = finished(frozen)
    assert code == 0, err
    after = sim_stats(url)
    sent_after_wake = after["requests"] - before["requests"]
    # paid twice: only what it had in flight or answered and not committed when frozen
    # (sent again by the live worker before it woke); nothing sent once it woke
    assert sent_after_wake == 0, (
        f"the woken worker sent {sent_after_wake} requests for lines already answered "
        f"(it held {held}); lines sent again after an answer: "
        f"{before['resent_after_success']} before it woke, {after['resent_after_success']} after"
    )


def test_a_worker_on_the_in_process_simulator_cannot_join_a_job_a_real_server_answers(
    cli: CLI, sim_server: Callable[..., str], tmp_path: Path
) -> None:
    """README: a worker that would ask for other answers is refused while others run the job,
    and synthetic answers are never a real server's (reuse.answer_spec files them apart,
    "whatever the model"). Yet a `resume --backend sim` (a dry run typed on the wrong job, or a
    cron line left from testing) joins a job whose worker sends to a real server under the same
    model name, and writes the simulator's made-up answers into its results beside the real
    ones: the same-answers check compares the model and sampling options, not the backend."""
    url = sim_server(*SLOW)  # stands for the real server (an HTTP endpoint, model sim-1)
    loaded(cli, tmp_path, "night", 60)
    real = cli.start("resume", "night", "--base-url", url, "--concurrency", "1", "-q")
    try:
        cli.wait_for("night", 2, real)
        fake = cli.run("resume", "night", "--backend", "sim", "--model", "sim-1", "-q", timeout=60)
    finally:
        code, _, err = finished(real, timeout=90)
    assert code == 0, err
    synthetic = [i for i in cli.items("night") if i["status"] == "done"]
    assert fake.returncode == 2, (
        f"--backend sim joined a job answered by {url} (exit {fake.returncode}); "
        f"{len(synthetic)} done, some by the in-process simulator: {fake.stderr[-500:]}"
    )


def test_a_join_that_waited_out_a_locked_ledger_past_the_lease_takes_no_live_workers_items(
    tmp_path: Path,
) -> None:
    """README ("Many workers per job"): a worker whose own heartbeat was kept away past the
    lease (the ledger locked by a big load, say) judges no other by its heartbeat, since
    "taking their items, answers already in hand, would have paid for them twice". A worker
    that *joins* just then (a cron `resume` queued behind the same lock; on PostgreSQL, one
    started while the server restarts) has no such rule: its join finds the running worker's
    heartbeat, kept away as long, older than the lease and puts its items back to pending,
    answers in hand. (End to end, with two `resume`s and a lock held 3.5 s past a 2 s lease,
    2 runs of 3 sent 23 answered lines again: whichever took the lock first after it.)"""
    db = tmp_path / "ledger.db"
    ledger = Ledger(f"sqlite:///{db}")
    try:
        load(ledger, "j", [f"q{n}" for n in range(10)])
        ledger.join("j", "running", ttl=1)
        held = ledger.claim("j", "running", 5, lease_ttl=1)  # in flight: answers coming
        assert len(held) == 5
        lock = sqlite3.connect(db, timeout=30, isolation_level=None)
        lock.execute("BEGIN IMMEDIATE")  # a big load: every writer waits, heartbeats too
        back: list[int] = []
        joining = threading.Thread(target=lambda: back.append(ledger.join("j", "new", ttl=1)))
        joining.start()  # the new worker's join waits for the lock, as the heartbeat does
        time.sleep(1.6)  # past the 1 s lease
        lock.execute("COMMIT")
        lock.close()
        joining.join(timeout=30)
        running = [w for w in ledger.iter_results("j") if w.status == "running"]
    finally:
        ledger.close()
    assert back == [0] and len(running) == 5, (
        f"the join that waited {1.6} s for the lock put back {back} items of a worker "
        f"kept away only as long as itself; {len(running)} still held"
    )


def test_a_worker_whose_endpoints_name_another_model_is_refused_while_the_job_runs(
    cli: CLI, sim_server: Callable[..., str], tmp_path: Path
) -> None:
    """README: "one that joins with another --model ... than the job's ... is refused (exit
    2, naming each option with both values)". With endpoints given by name the model rides in
    each `--endpoint NAME=URL,model=M`: the job's spec keeps model None, the check compares
    only `model` (None = None) and never the endpoints' models, so a worker sending to
    model big-2 joins a job that a worker answers with small-1, and the results mix them."""
    url = sim_server(*SLOW, "--model", "small-1", "--model", "big-2", "--strict-models")
    loaded(cli, tmp_path, "mix", 60)
    run = ("resume", "mix", "--concurrency", "1", "-q")
    first = cli.start(*run, "--endpoint", f"a={url},model=small-1")
    try:
        cli.wait_for("mix", 2, first)
        other = cli.run(*run, "--endpoint", f"a={url},model=big-2", timeout=90)
    finally:
        code, _, err = finished(first, timeout=90)
    assert code == 0, err
    made_under = sorted({str(i["answer_spec"])[:8] for i in cli.items("mix")})
    assert other.returncode == 2, (
        f"joined with model=big-2 (exit {other.returncode}); the job's answers were made under "
        f"{len(made_under)} answer specs {made_under}: {other.stderr[-300:]}"
    )


@pytest.fixture
def own_cluster(postgres_server: str) -> Iterator[Cluster]:
    """A PostgreSQL cluster of this test's own, to stop and start (postgres_server first: a
    machine without PostgreSQL skips or fails as the suite says)."""
    with throwaway_cluster() as cluster:
        yield cluster


def test_a_worker_started_while_postgresql_restarts_waits_for_it(
    cli: CLI, sim_server: Callable[..., str], own_cluster: Cluster, tmp_path: Path
) -> None:
    """README ("The database restarting"): a worker that finds PostgreSQL out of reach waits
    and tries again every second, "so does a run as it starts (joining the job, looking for
    answers to reuse). Past --outage-timeout (... 60 s) it stops with exit 3". A `resume`
    started by cron on a second host while the database restarts (down 4 s here) does not
    wait at all: it stops at once, exit 3, "ledger error while opening the ledger ...
    Connection refused", and that host does no work that night."""
    url = sim_server(*SLOW)
    inp = tmp_path / "night.jsonl"
    write_prompts(inp, 20)
    ledger = ("--ledger", own_cluster.url)
    assert cli.run(*ledger, "submit", str(inp), "--no-run", "-q").returncode == 0
    own_cluster.stop("fast")  # an operator's restart, under way
    worker = cli.start(*ledger, "resume", "night", "--base-url", url, "-q")
    try:
        time.sleep(4)
        gave_up = worker.poll()
    finally:
        own_cluster.start()
    code, _, err = finished(worker, timeout=90)
    assert gave_up is None and code == 0, (
        f"exit {code} {'during' if gave_up is not None else 'after'} a 4 s restart "
        f"(--outage-timeout 60 s): {err.strip()[-300:]}"
    )


def test_a_no_reuse_worker_refused_for_other_options_changes_nothing_in_the_job(
    cli: CLI, sim_server: Callable[..., str], tmp_path: Path
) -> None:
    """README: a worker that asks for other answers "is refused (exit 2 ...) before it changes
    anything". With --no-reuse, reuse.prepare first tells every repeated line of the job to
    stop waiting for its first line's answer (ledger.forget_duplicates, no check), and only
    the runner's join then refuses the worker. The running worker, which loaded the job to
    answer each repeated prompt once, now pays for every repeat as well."""
    url = sim_server(*SLOW)
    inp = tmp_path / "twice.jsonl"
    with inp.open("w") as f:  # 30 prompts, each on two lines: 30 requests are enough
        for n in range(60):
            f.write(f'{{"id": "i{n}", "prompt": "Describe product {n % 30}."}}\n')
    assert cli.run("submit", str(inp), "--no-run", "-q").returncode == 0
    run = ("resume", "twice", "--base-url", url, "--concurrency", "1", "-q")
    first = cli.start(*run)
    try:
        cli.wait_for("twice", 2, first)
        other = cli.run(*run, "--no-reuse", "--temperature", "0.9", timeout=60)
    finally:
        code, _, err = finished(first, timeout=90)
    assert other.returncode == 2, other.stderr  # refused, as it should be
    assert code == 0 and cli.counts("twice") == {"done": 60}, err
    sent = sim_stats(url)["requests"]
    assert sent == 30, f"{sent} requests for 30 distinct prompts after a refused worker"


def test_the_last_worker_waits_out_a_postgresql_restart_as_it_writes_the_results(
    own_cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README: a worker whose ledger call finds PostgreSQL out of reach waits (up to
    --outage-timeout, 60 s) and goes on. The worker that answers a job's last line then
    reads the job back to write the results file and mark it finished (jobs.finish), outside
    the calls that wait: a restart at that moment (2 s here) fails the whole `resume` with a
    ledger error, though every line is answered, and leaves no results file behind."""
    inp = tmp_path / "end.jsonl"
    write_prompts(inp, 6)
    home = tmp_path / "home"
    api.submit(inp, home=home, ledger=own_cluster.url, run=False, backend="sim", model="sim-1")
    real_finish = verbs.finish
    restarted: list[float] = []

    def finish_during_a_restart(*args: object, **kwargs: object) -> object:
        if not restarted:  # the operator's restart, just as the last worker writes the file
            own_cluster.stop("fast")
            restarted.append(time.monotonic())
            threading.Timer(2.0, own_cluster.start).start()
        return real_finish(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(verbs, "finish", finish_during_a_restart)
    try:
        report = api.resume("end", home=home, ledger=own_cluster.url, backend="sim", model="sim-1")
    except LedgerError as exc:
        raise AssertionError(
            f"the run failed in a 2 s restart after its last answer: {exc}"
        ) from None
    finally:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the cluster is up again for the teardown
            try:
                psycopg.connect(own_cluster.url.replace("+psycopg", ""), connect_timeout=2).close()
                break
            except psycopg.OperationalError:
                time.sleep(0.2)
    assert report.complete and report.output is not None and report.output.exists()


def test_a_worker_stopped_while_another_runs_the_job_says_two_workers_took_part(
    cli: CLI, sim_server: Callable[..., str], tmp_path: Path
) -> None:
    """README: "the summary line says how many workers took part". A second worker joins a
    job a first one is running and is stopped (SIGTERM) a few seconds later: its summary says
    nothing of the other ("48 done, 32 pending, 20 running ... interrupted; run `batchrun
    resume s` to continue"), as if it had run alone and the job were waiting for a resume,
    while the first worker is still at it. Workers are counted by a heartbeat since this run
    started (api._run), and the first one's last beat was its join, before it (beats come
    every 20 s)."""
    url = sim_server(*SLOW)
    loaded(cli, tmp_path, "s", 100)
    run = ("resume", "s", "--base-url", url, "--concurrency", "1")
    first = cli.start(*run)
    try:
        cli.wait_for("s", 2, first)
        second = cli.start(*run)
        cli.wait_for("s", 12, second)
        # running: it holds items (claimed after its signal handlers are set; a SIGTERM that
        # came first killed it outright once in CI, when the first alone reached 12 done)
        db, pid = Outside(f"sqlite:///{cli.home / 'jobs' / 'ledger.db'}"), second.pid
        held = "SELECT count(*) FROM items JOIN workers ON items.owner = workers.id "
        held += f"WHERE items.status = 'running' AND workers.pid = {pid}"
        deadline = time.monotonic() + 60
        while not int(str(db.query(held)[0][0])):
            assert second.poll() is None and time.monotonic() < deadline, db.counts("s")
            time.sleep(0.05)
        second.send_signal(signal.SIGTERM)
        code, _, said = finished(second, timeout=60)
    finally:
        first_code, _, first_said = finished(first, timeout=90)
    assert code == 130 and first_code == 0, (said, first_said)
    summary = said.strip().splitlines()[-1]
    assert "2 workers" in summary, summary
