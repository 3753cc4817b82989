"""--concurrency auto through the real CLI against a simulated continuous-batching server."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration.helpers import CLI, write_prompts

pytestmark = pytest.mark.integration

SLOTS = 8


def test_auto_finds_the_knee_of_an_8_slot_server(
    cli: CLI, sim_server: Callable[..., str], tmp_path: Path
) -> None:
    shape = ["--slots", str(SLOTS), "--tpot-slope", "0.5"]
    url = sim_server("--ttft-ms", "20", "--tpot-ms", "2", "--min-output-tokens", "16",
                     "--max-output-tokens", "24", *shape)  # fmt: skip
    inp = tmp_path / "auto.jsonl"
    write_prompts(inp, 1200)
    result = cli.run("submit", str(inp), "--base-url", url, "--model", "sim-1",
                     "--concurrency", "auto", "--max-concurrency", "256", "--quiet")  # fmt: skip
    assert result.returncode == 0, result.stderr
    log = [json.loads(x) for x in (cli.home / "logs" / "auto.log").read_text().splitlines()]
    changes = [e for e in log if e["event"] == "concurrency"]
    reasons = [e["reason"] for e in changes]
    assert reasons[:2] == ["ramp", "ramp"] and "knee" in reasons  # it started low and ramped
    knee = next(e["limit"] for e in changes if e["reason"] == "knee")
    assert SLOTS <= knee <= 2 * SLOTS  # the documented band: from the slots to twice them
    limits_after_knee = [e["limit"] for e in changes[reasons.index("knee") :]]
    assert max(limits_after_knee) <= 4 * SLOTS  # probes stay near the knee, never run away
    stopped = next(e for e in log if e["event"] == "run_stopped")
    assert SLOTS <= stopped["limit"] <= 3 * SLOTS
    detail = json.loads(cli.run("status", "auto", "--json").stdout)
    history = detail["limit_history"]
    assert history and history[-1][1] == stopped["limit"]  # status shows where it ended
    assert {reason for _t, _limit, reason in history} <= {
        "ramp",
        "knee",
        "probe",
        "probe kept",
        "probe reverted",
        "latency",
        "back-off",
    }
    text = cli.run("status", "auto").stdout
    assert "limit      auto:" in text
