"""Two first submits of one file on a brand-new ledger, at the same moment (issue 13 item 9).

One runs the job; the other gets the message it would get on an existing ledger (exit 2,
"being run by process N"), never a bare "database is locked" or "job already exists"."""

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
def test_one_of_two_first_submits_runs_and_the_other_is_told_why(
    tmp_path: Path, round_: int
) -> None:
    inp = tmp_path / "p.jsonl"
    write_prompts(inp, 40)  # ~6 s at one request of 150 ms at a time: the loser meets it running
    (tmp_path / "home").mkdir()
    spec = tmp_path / "spec.toml"
    spec.write_text(SLOW_SIM)
    results = sorted(both(tmp_path / "home", inp, spec), key=lambda r: r.returncode)
    assert [r.returncode for r in results] == [0, 2], [r.stderr for r in results]
    loser = results[1].stderr
    assert "is being run by process" in loser, loser
    assert CLI(tmp_path / "home").counts("p") == {"done": 40}
