"""Helpers for the integration tests: drive the real CLI, read the ledger and outputs."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
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
