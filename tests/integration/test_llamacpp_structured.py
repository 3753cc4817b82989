"""Structured outputs against a real engine: llama.cpp's server with the tiny stories model.

The model writes children's stories and never JSON by itself, so what comes back as valid JSON
came from llama.cpp's grammar-constrained decoding, which batchrun asked for with the llamacpp
preset's `response_format: {"type": "json_object", "schema": ...}`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema

from tests.integration.helpers import CLI, write_prompts
from tests.integration.llamacpp import LlamaServer

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "happy": {"type": "boolean"},
    },
    "required": ["name", "age", "happy"],
}


def _job(
    cli: CLI, tmp_path: Path, server: LlamaServer, n: int, *flags: str
) -> list[dict[str, Any]]:
    inp = tmp_path / "in.jsonl"
    write_prompts(inp, n)
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    result = cli.run(
        "submit",
        str(inp),
        "--backend",
        "llamacpp",
        "--base-url",
        server.url,
        "--schema",
        str(schema),
        "--quiet",
        *flags,
    )
    assert result.returncode in (0, 1), result.stderr
    out = cli.home / "outputs" / "in.jsonl"
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_constrained_decoding_gives_schema_valid_answers(
    cli: CLI, tmp_path: Path, llama_server: LlamaServer
) -> None:
    rows = _job(cli, tmp_path, llama_server, 60, "--max-tokens", "120")
    assert len(rows) == 60
    done = [r for r in rows if r["status"] == "done"]
    assert len(done) >= 40, [r["error"] for r in rows if r["status"] != "done"]
    validator = jsonschema.Draft202012Validator(SCHEMA)
    for row in done:
        assert not list(validator.iter_errors(row["parsed"])), row
        assert row["parsed"] == json.loads(row["output"])
        assert row["finish_reason"] == "stop"
    # With a grammar, the only way to fail the schema is to run out of tokens.
    for row in rows:
        if row["status"] != "done":
            assert row["status"] == "invalid" and row["error"].startswith("truncated"), row
            assert row["finish_reason"] == "length"


def test_without_guidance_the_same_model_gives_no_json(
    cli: CLI, tmp_path: Path, llama_server: LlamaServer
) -> None:
    rows = _job(
        cli,
        tmp_path,
        llama_server,
        15,
        "--max-tokens",
        "60",
        "--no-guided",
        "--repair-attempts",
        "0",
    )
    assert [r["status"] for r in rows] == ["invalid"] * 15
    assert all(r["parsed"] is None for r in rows)


def test_answers_cut_by_a_tiny_max_tokens_are_invalid_not_done(
    cli: CLI, tmp_path: Path, llama_server: LlamaServer
) -> None:
    rows = _job(cli, tmp_path, llama_server, 20, "--max-tokens", "4")
    assert [r["status"] for r in rows] == ["invalid"] * 20
    assert all(r["finish_reason"] == "length" for r in rows)
    assert all(r["error"].startswith("truncated") for r in rows)
    status = cli.run("status", "in")
    assert "20 invalid" in status.stdout and "truncated" in status.stdout


def test_retry_longer_turns_truncated_answers_into_valid_ones(
    cli: CLI, tmp_path: Path, llama_server: LlamaServer
) -> None:
    rows = _job(
        cli,
        tmp_path,
        llama_server,
        20,
        "--max-tokens",
        "8",
        "--on-truncate",
        "retry-longer",
        "--max-tokens-cap",
        "256",
    )
    done = [r for r in rows if r["status"] == "done"]
    assert len(done) >= 15
    assert all(r["attempts"] >= 2 for r in done)  # 8 tokens never hold the whole object
