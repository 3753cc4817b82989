"""The real CLI with its ledger on a real PostgreSQL server (a throwaway cluster, see
tests/postgres.py): a job run, killed with kill -9 and resumed, audited from outside."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from batchrun.sim import prompt_tag
from tests.audit import Outside
from tests.integration.helpers import CLI, write_prompts
from tests.postgres import Cluster, fresh_database, throwaway_cluster

pytestmark = pytest.mark.integration

SLOW = ("--ttft-ms", "20", "--tpot-ms", "2")  # ~100 ms a request: long enough to interrupt


@pytest.fixture
def pg_ledger(postgres_server: str) -> Iterator[str]:
    with fresh_database(postgres_server) as url:
        yield url


def counts(url: str, job: str) -> dict[str, int]:
    return Outside(url).counts(job)


def test_kill_9_midway_then_resume_on_postgresql_commits_each_result_once(
    cli: CLI, sim_server: Callable[..., str], pg_ledger: str, tmp_path: Path
) -> None:
    url = sim_server(*SLOW)
    inp = tmp_path / "big.jsonl"
    prompts = write_prompts(inp, 300)
    ledger = ("--ledger", pg_ledger)
    loaded = cli.run(*ledger, "submit", str(inp), "--no-run", "--quiet")
    assert loaded.returncode == 0, loaded.stderr
    Outside(pg_ledger).install_audit()

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
    assert Outside(pg_ledger).committed_once(300)  # each once, none twice
    output = cli.output("big")
    assert [o["id"] for o in output] == [f"item-{i}" for i in range(300)]
    for record, prompt in zip(output, prompts, strict=True):
        assert record["output"].startswith(prompt_tag(prompt)), (record, prompt)
    shown = cli.run(*ledger, "status", "big", "--json")
    assert shown.returncode == 0 and '"done": 300' in shown.stdout


def test_three_workers_on_postgresql_one_killed_finish_every_item_once(
    cli: CLI, sim_server: Callable[..., str], pg_ledger: str, tmp_path: Path
) -> None:
    url = sim_server(*SLOW)
    inp = tmp_path / "many.jsonl"
    write_prompts(inp, 400)
    ledger = ("--ledger", pg_ledger)
    assert cli.run(*ledger, "submit", str(inp), "--no-run", "--quiet").returncode == 0
    Outside(pg_ledger).install_audit()
    run = (*ledger, "resume", "many", "--base-url", url, "--concurrency", "4", "--quiet")
    workers = [cli.start(*run) for _ in range(3)]
    deadline = time.monotonic() + 60
    while counts(pg_ledger, "many").get("done", 0) < 80:
        assert time.monotonic() < deadline, counts(pg_ledger, "many")
        time.sleep(0.05)
    workers[1].send_signal(signal.SIGKILL)  # its items come back to the others
    workers[1].wait(timeout=10)  # reaped, as init would: a zombie still answers kill(pid, 0)
    codes = [w.wait(timeout=180) for w in workers]
    said = [w.stderr.read() if w.stderr else "" for w in workers]
    assert codes[1] == -signal.SIGKILL and codes[0] == codes[2] == 0, (codes, said)
    assert counts(pg_ledger, "many") == {"done": 400}
    outside = Outside(pg_ledger)
    assert outside.committed_once(400)
    assert outside.query("SELECT count(*) FROM workers") == [(3,)]
    assert any(" workers" in text for text in said), said  # the summary says how many
    assert [o["id"] for o in cli.output("many")] == [f"item-{i}" for i in range(400)]


@pytest.fixture
def own_cluster(postgres_server: str) -> Iterator[Cluster]:
    """A cluster of this test's own, to stop and start while a run uses it (the session's
    server, which other tests share, is left alone; `postgres_server` is asked for first so
    that a machine without PostgreSQL skips or fails as it says)."""
    with throwaway_cluster() as cluster:
        yield cluster


def events(cli: CLI, job: str) -> list[str]:
    path = cli.home / "logs" / f"{job}.log"
    return [json.loads(line)["event"] for line in path.read_text().splitlines() if line]


def night_under_way(
    cli: CLI, cluster: Cluster, url: str, tmp_path: Path, *flags: str
) -> tuple[subprocess.Popen[str], tuple[str, ...]]:
    """A 300-item job on `cluster`, audited, run by one worker until 60 items are done: the
    worker, and the command that runs it."""
    inp = tmp_path / "night.jsonl"
    write_prompts(inp, 300)
    ledger = ("--ledger", cluster.url)
    assert cli.run(*ledger, "submit", str(inp), "--no-run", "--quiet").returncode == 0
    Outside(cluster.url).install_audit()
    run = (*ledger, "resume", "night", "--base-url", url, "--concurrency", "8")
    proc = cli.start(*run, *flags)
    deadline = time.monotonic() + 60
    while counts(cluster.url, "night").get("done", 0) < 60:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    return proc, run


def test_a_postgresql_restart_mid_run_is_waited_out(
    cli: CLI, sim_server: Callable[..., str], own_cluster: Cluster, tmp_path: Path
) -> None:
    url = sim_server(*SLOW)
    proc, _run = night_under_way(cli, own_cluster, url, tmp_path, "--outage-timeout", "60", "-q")
    own_cluster.stop("fast")  # every session ended, as an operator's restart does
    time.sleep(3)  # requests finish meanwhile; their results wait in memory
    assert proc.poll() is None  # still there, waiting
    own_cluster.start()
    assert proc.wait(timeout=120) == 0, proc.stderr.read() if proc.stderr else ""
    assert counts(own_cluster.url, "night") == {"done": 300}
    assert Outside(own_cluster.url).committed_once(300)
    said = events(cli, "night")
    assert "ledger_unreachable" in said and "ledger_back" in said
    assert [o["id"] for o in cli.output("night")] == [f"item-{i}" for i in range(300)]


def test_a_database_away_past_the_outage_timeout_stops_with_exit_3_then_resumes(
    cli: CLI, sim_server: Callable[..., str], own_cluster: Cluster, tmp_path: Path
) -> None:
    url = sim_server(*SLOW)
    proc, run = night_under_way(cli, own_cluster, url, tmp_path, "--outage-timeout", "2")
    own_cluster.stop("immediate")  # a crash
    code = proc.wait(timeout=60)
    said = proc.stderr.read() if proc.stderr else ""
    assert code == 3, said
    assert "out of reach" in said and "--outage-timeout" in said
    own_cluster.start()
    again = cli.run(*run, "--quiet")  # what it had not committed is sent again
    assert again.returncode == 0, again.stderr
    assert counts(own_cluster.url, "night") == {"done": 300}
    assert Outside(own_cluster.url).committed_once(300)
