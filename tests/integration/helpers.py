"""Helpers for the integration tests: drive the real CLI, read the ledger and outputs."""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

CLI_TIMEOUT = 120


def cli_command(home: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "batchrun", "--home", str(home), *args]


class CLI:
    def __init__(self, home: Path) -> None:
        self.home = home

    def run(
        self, *args: str, env: dict[str, str] | None = None, timeout: float = CLI_TIMEOUT
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            cli_command(self.home, *args),
            capture_output=True,
            text=True,
            env={**os.environ, **(env or {})},
            timeout=timeout,
        )

    def start(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        return subprocess.Popen(
            cli_command(self.home, *args),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )

    def counts(self, job: str) -> dict[str, int]:
        """Read the ledger the way an operator would: a read-only SQLite connection."""
        db = self.home / "jobs" / "ledger.db"
        if not db.exists():
            return {}
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
        try:
            rows = conn.execute(
                "SELECT status, count(*) FROM items WHERE job = ? GROUP BY status", (job,)
            ).fetchall()
        except sqlite3.OperationalError:
            return {}
        finally:
            conn.close()
        return dict(rows)

    def items(self, job: str) -> list[dict[str, Any]]:
        conn = sqlite3.connect(self.home / "jobs" / "ledger.db")
        conn.row_factory = sqlite3.Row
        try:
            rows = conn.execute("SELECT * FROM items WHERE job = ? ORDER BY line", (job,))
            return [dict(r) for r in rows]
        finally:
            conn.close()

    def output(self, job: str) -> list[dict[str, Any]]:
        path = self.home / "outputs" / f"{job}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()]

    def wait_for(
        self, job: str, done: int, proc: subprocess.Popen[str], timeout: float = 60
    ) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.counts(job).get("done", 0) >= done:
                return
            if proc.poll() is not None:
                raise AssertionError(f"CLI exited early: {proc.returncode} {proc.stderr.read()}")
            time.sleep(0.05)
        raise AssertionError(f"{job} never reached {done} done items: {self.counts(job)}")


def write_prompts(
    path: Path, n: int, *, extra: Callable[[int], dict[str, Any]] | None = None
) -> list[str]:
    prompts = [f"Rewrite product description number {i}." for i in range(n)]
    with path.open("w") as f:
        for i, prompt in enumerate(prompts):
            record = {"id": f"item-{i}", "prompt": prompt, **(extra(i) if extra else {})}
            f.write(json.dumps(record) + "\n")
    return prompts


def sim_stats(url: str) -> dict[str, Any]:
    """The simulator's own count of requests, faults and re-sent prompts."""
    base = url.removesuffix("/v1")
    with urllib.request.urlopen(f"{base}/sim/stats", timeout=10) as response:
        stats: dict[str, Any] = json.loads(response.read())
    return stats


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def start_sim(*args: str) -> tuple[subprocess.Popen[str], str]:
    """A `batchrun sim` process on 127.0.0.1 the test manages itself (to kill and restart it)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchrun", "sim", "--host", "127.0.0.1", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "serving" not in line:
        proc.kill()
        raise AssertionError(
            f"sim did not start: {line!r} {proc.stderr.read() if proc.stderr else ''}"
        )
    return proc, line.split()[3]


# ~23% of requests fail, across every kind the simulator can inject.
CHAOS_FAULTS = {
    "429": 0.03,
    "500": 0.02,
    "502": 0.02,
    "503": 0.03,
    "504": 0.02,
    "reset": 0.03,
    "hang": 0.01,
    "cut": 0.03,
    "nonjson": 0.02,
    "empty": 0.02,
}


def fault_args(rates: dict[str, float], seed: int = 7) -> list[str]:
    args = [f"--fault={kind}={rate}" for kind, rate in rates.items()]
    return [*args, "--fault-seed", str(seed), "--retry-after-ms", "50"]


def install_audit(db: Path) -> None:
    """Record every transition of an item to a final status, from outside batchrun, so a test
    can prove no result was committed twice (the ledger's guard is what is under test)."""
    conn = sqlite3.connect(db)
    with conn:
        conn.executescript(
            """
            CREATE TABLE IF NOT EXISTS audit_final (job TEXT, line INTEGER, status TEXT);
            CREATE TRIGGER IF NOT EXISTS audit_final_trigger AFTER UPDATE OF status ON items
            WHEN NEW.status IN ('done', 'failed', 'invalid') AND OLD.status = 'running'
            BEGIN INSERT INTO audit_final VALUES (NEW.job, NEW.line, NEW.status); END;
            """
        )
    conn.close()


def audited_records(db: Path, job: str) -> tuple[int, int]:
    """(results committed, distinct items they were for)."""
    conn = sqlite3.connect(db)
    try:
        total, distinct = conn.execute(
            "SELECT count(*), count(DISTINCT line) FROM audit_final WHERE job = ?", (job,)
        ).fetchone()
    finally:
        conn.close()
    return int(total), int(distinct)
