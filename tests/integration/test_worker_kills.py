"""Three workers on one job, one of them killed with kill -9 at a random moment, ten times over
(a new worker taking its place each time), on SQLite (local processes sharing the file) and on
PostgreSQL: no item lost, no result committed twice, as counted by an audit trigger installed
from outside, and the results file in input order."""

from __future__ import annotations

import random
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.audit import Outside
from tests.integration.helpers import CLI, write_prompts

pytestmark = pytest.mark.integration

SLOW = ("--ttft-ms", "20", "--tpot-ms", "2")  # ~100 ms a request
ITEMS, KILLS = 3000, 10


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
    assert outside.committed_once(ITEMS), seed  # every item committed, and none twice
    took_part = outside.query("SELECT count(*) FROM workers")[0][0]
    assert took_part == 3 + KILLS
    assert [o["id"] for o in cli.output("night")] == [f"item-{i}" for i in range(ITEMS)]
