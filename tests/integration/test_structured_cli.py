"""Structured outputs through the real CLI against `batchrun sim` on 127.0.0.1."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from tests.integration.helpers import CLI, write_prompts

SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string"}, "price": {"type": "number", "minimum": 0}},
    "required": ["title", "price"],
}


def test_refused_guidance_falls_back_and_repairs_fix_broken_answers(
    cli: CLI, tmp_path: Path, sim_server: Callable[..., str]
) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    url = sim_server(
        "--ttft-ms",
        "1",
        "--tpot-ms",
        "0",
        "--json-schema",
        str(schema),
        "--refuse-response-format",
        "--json-style",
        "fenced=0.3",
        "--json-style",
        "broken=0.3",
    )
    inp = tmp_path / "in.jsonl"
    write_prompts(inp, 40)
    result = cli.run("submit", str(inp), "--base-url", url, "--schema", str(schema), "--quiet")
    assert result.returncode == 0, result.stderr
    assert "refused response_format" in result.stderr
    assert "repairs (" in result.stderr
    rows = [json.loads(x) for x in (cli.home / "outputs" / "in.jsonl").read_text().splitlines()]
    assert [r["status"] for r in rows] == ["done"] * 40
    assert all(set(r["parsed"]) == {"title", "price"} for r in rows)
    repaired = [r for r in rows if r["repairs"]]
    assert 0 < len(repaired) < 40
    assert all(
        r["repairs"]["requests"] == 1 and r["repairs"]["completion_tokens"] > 0 for r in repaired
    )
    status = cli.run("status", "in")
    assert "repairs    " in status.stdout and f"{len(repaired)} requests" in status.stdout
    log = (cli.home / "logs" / "in.log").read_text().splitlines()
    assert sum(json.loads(x)["event"] == "guided_refused" for x in log) == 1


def test_a_schema_violation_left_after_repairs_is_reported_by_status(
    cli: CLI, tmp_path: Path, sim_server: Callable[..., str]
) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    url = sim_server(
        "--ttft-ms",
        "1",
        "--tpot-ms",
        "0",
        "--json-schema",
        str(schema),
        "--json-style",
        "violating=1",
        "--repair-fails",
    )
    inp = tmp_path / "in.jsonl"
    write_prompts(inp, 10)
    result = cli.run(
        "submit", str(inp), "--base-url", url, "--schema", str(schema), "--no-guided", "--quiet"
    )
    assert result.returncode == 1, result.stderr
    assert "10 invalid" in result.stderr
    status = cli.run("status", "in")
    assert "invalid    10 x " in status.stdout
    assert cli.run("retry", "in").returncode == 0
    assert cli.counts("in") == {"pending": 10}
