"""Two first submits of one file on a brand-new ledger, at the same moment (issue 13 item 9).

Both end well: one makes the job, the other finds it made and joins it as a second worker
(issue 15), never a bare "database is locked" or "job already exists"; each item is done once."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.integration.helpers import CLI, write_prompts

pytestmark = pytest.mark.integration

ROUNDS = 8  # before the fix, 2 of 16 rounds failed (and 5 of 15 in the issue)
SLOW_SIM = 'backend = "sim"\nconcurrency = 1\nsim_options = { ttft_ms = 150 }\n'


def both(home: Path, inp: Path, spec: Path) -> list[subprocess.CompletedProcess[str]]:
    cli = CLI(home)
    procs = [cli.start("submit", str(inp), "--spec", str(spec), "--quiet") for _ in range(2)]
    return [
        subprocess.CompletedProcess(p.args, p.wait(timeout=120), *p.communicate()) for p in procs
    ]


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_two_first_submits_both_run_the_one_job(tmp_path: Path, round_: int) -> None:
    inp = tmp_path / "p.jsonl"
    write_prompts(inp, 40)  # ~6 s at one request of 150 ms at a time: the loser meets it running
    (tmp_path / "home").mkdir()
    spec = tmp_path / "spec.toml"
    spec.write_text(SLOW_SIM)
    results = both(tmp_path / "home", inp, spec)
    assert [r.returncode for r in results] == [0, 0], [r.stderr for r in results]
    assert all("Traceback" not in r.stderr and "locked" not in r.stderr for r in results)
    assert CLI(tmp_path / "home").counts("p") == {"done": 40}
    items = CLI(tmp_path / "home").items("p")
    assert [i["line"] for i in items] == list(range(1, 41))
