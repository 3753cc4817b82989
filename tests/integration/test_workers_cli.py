"""Several CLI workers on one SQLite ledger (processes on one machine): a worker frozen with
SIGSTOP past its lease loses its items to the live one, and when it wakes it commits nothing
for them; an audit trigger installed from outside counts every result committed."""

from __future__ import annotations

import signal
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.audit import Outside
from tests.integration.helpers import CLI, write_prompts

pytestmark = pytest.mark.integration

SLOW = ("--ttft-ms", "20", "--tpot-ms", "2")  # ~100 ms a request


def loaded(cli: CLI, tmp_path: Path, job: str, items: int) -> None:
    """A job of `items` prompts, loaded and not run."""
    inp = tmp_path / f"{job}.jsonl"
    write_prompts(inp, items)
    assert cli.run("submit", str(inp), "--no-run", "--quiet").returncode == 0


def test_a_frozen_worker_loses_its_items_and_commits_nothing_for_them(
    cli: CLI, sim_server: Callable[..., str], tmp_path: Path
) -> None:
    url = sim_server(*SLOW)
    loaded(cli, tmp_path, "frozen", 200)
    db = cli.home / "jobs" / "ledger.db"
    outside = Outside(f"sqlite:///{db}")
    outside.install_audit()
    run = ("resume", "frozen", "--base-url", url, "--concurrency", "4", "--lease", "2", "-q")
    frozen = cli.start(*run)
    cli.wait_for("frozen", 10, frozen)
    frozen.send_signal(signal.SIGSTOP)  # mid-run, its claims in hand
    try:
        held = cli.counts("frozen").get("running", 0)
        assert held > 0
        live = cli.run(*run)  # joins, and takes the frozen worker's items once its lease is out
        assert live.returncode == 0, live.stderr
        assert cli.counts("frozen") == {"done": 200}
    finally:
        frozen.send_signal(signal.SIGCONT)
    assert frozen.wait(timeout=60) == 0  # it wakes, finds the job done, commits nothing more
    time.sleep(0.2)
    assert outside.committed_once(200)  # every item, and no result committed twice


def test_a_worker_with_other_answer_options_is_refused_while_the_job_runs(
    cli: CLI, sim_server: Callable[..., str], tmp_path: Path
) -> None:
    url = sim_server(*SLOW)
    loaded(cli, tmp_path, "night", 150)
    run = ("resume", "night", "--base-url", url, "--concurrency", "4", "-q")
    first = cli.start(*run)
    cli.wait_for("night", 10, first)
    other = cli.run(*run, "--temperature", "0.9")
    assert other.returncode == 2, other.stderr
    assert "--temperature 0.9 here, (not set) there" in other.stderr
    assert "other worker" in other.stderr
    assert first.wait(timeout=120) == 0
    assert cli.counts("night") == {"done": 150}


def test_gc_leaves_a_running_job_alone_and_collects_it_once_finished(
    cli: CLI, sim_server: Callable[..., str], tmp_path: Path
) -> None:
    url = sim_server(*SLOW)
    loaded(cli, tmp_path, "night", 120)
    worker = cli.start("resume", "night", "--base-url", url, "--concurrency", "4", "-q")
    cli.wait_for("night", 10, worker)
    db = cli.home / "jobs" / "ledger.db"
    outside = Outside(f"sqlite:///{db}")

    def age() -> None:  # as if untouched for a year
        with sqlite3.connect(db, timeout=30) as conn:
            conn.execute("UPDATE jobs SET updated_at = updated_at - 365 * 86400")

    age()
    busy = cli.run("gc", "--older-than", "30d")
    assert busy.returncode == 0 and "left night alone: a worker is running it" in busy.stderr
    assert worker.wait(timeout=120) == 0
    assert outside.counts("night") == {"done": 120}
    age()
    done = cli.run("gc", "--older-than", "30d")
    assert "removed 1 job(s): 0 items, kept 120 answers for reuse" in done.stderr
    assert not (cli.home / "outputs" / "night.jsonl").exists()
