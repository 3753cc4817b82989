"""--concurrency auto through the real CLI against a simulated continuous-batching server."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration.helpers import CLI, write_prompts

pytestmark = pytest.mark.integration

SLOTS = 8


@pytest.mark.parametrize("metrics", [True, False], ids=["server-metrics", "ttft"])
def test_auto_finds_the_knee_of_an_8_slot_server(
    cli: CLI, sim_server: Callable[..., str], tmp_path: Path, metrics: bool
) -> None:
    shape = ["--slots", str(SLOTS), "--tpot-slope", "0.5", *([] if metrics else ["--no-metrics"])]
    url = sim_server(
        "--ttft-ms",
        "20",
        "--tpot-ms",
        "2",
        "--min-output-tokens",
        "16",
        "--max-output-tokens",
        "24",
        *shape,
    )
    inp = tmp_path / "auto.jsonl"
    write_prompts(inp, 1200)
    result = cli.run(
        "submit",
        str(inp),
        "--base-url",
        url,
        "--model",
        "sim-1",
        "--concurrency",
        "auto",
        "--max-concurrency",
        "256",
        "--quiet",
    )
    assert result.returncode == 0, result.stderr
    log = [json.loads(x) for x in (cli.home / "logs" / "auto.log").read_text().splitlines()]
    changes = [e for e in log if e["event"] == "concurrency"]
    reasons = [e["reason"] for e in changes]
    settle = "queue" if metrics else "knee"  # the server's waiting count, or first tokens
    assert reasons[:2] == ["ramp", "ramp"] and settle in reasons  # it started low and ramped
    first = changes[reasons.index(settle)]
    assert first["signal"] == ("server metrics" if metrics else "ttft")
    after = changes[reasons.index(settle) :]
    if not metrics:  # it settles where first tokens queued, then the curve acts on it
        moves = [(e["limit"], e["reason"]) for e in after]
        assert any(e["reason"] in ("move", "probe reverted") for e in after), moves
    else:  # the server said where its queue began; probes stay near it
        assert SLOTS <= first["limit"] <= 3 * SLOTS
        assert max(e["limit"] for e in after) <= 6 * SLOTS
    stopped = next(e for e in log if e["event"] == "run_stopped")
    # Where it settles, probes aside (a job may end mid-probe). On a busy 2-core machine (the
    # simulator and the client share it) this is noisy above the knee, where over-committing costs
    # latency but no throughput, so the bound is the median of the settled levels.
    trail = [(e["limit"], e["reason"]) for e in changes]
    settled = sorted(e["limit"] for e in after if e["reason"] != "probe")
    assert SLOTS <= settled[len(settled) // 2] <= 6 * SLOTS, trail
    detail = json.loads(cli.run("status", "auto", "--json").stdout)
    history = detail["limit_history"]
    assert history and history[-1][1] == stopped["limit"]  # status shows where it ended
    known = {"ramp", "knee", "queue", "room", "probe", "probe kept", "probe reverted", "move"}
    assert {reason for _t, _limit, reason in history} <= known
    text = cli.run("status", "auto").stdout
    assert "limit      auto:" in text
