"""Real jobs against a real engine: llama.cpp's server with the tiny stories model, through both
endpoints, streamed and not; truncation, a prompt over the context window, and a server that
dies midway and comes back."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.helpers import CLI, write_prompts
from tests.integration.llamacpp import LlamaServer, require_llamacpp


def _results(cli: CLI, job: str) -> list[dict[str, Any]]:
    path = cli.home / "outputs" / f"{job}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize(
    ("endpoint", "stream"),
    [("chat", True), ("chat", False), ("completions", True), ("completions", False)],
)
def test_a_200_item_job_completes_on_each_endpoint_streamed_or_not(
    cli: CLI, tmp_path: Path, llama_server: LlamaServer, endpoint: str, stream: bool
) -> None:
    inp = tmp_path / "in.jsonl"
    write_prompts(inp, 200)
    result = cli.run(
        "submit",
        str(inp),
        "--backend",
        "llamacpp",
        "--base-url",
        llama_server.url,
        "--endpoint",
        endpoint,
        "--stream" if stream else "--no-stream",
        "--max-tokens",
        "12",
        "--quiet",
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    rows = _results(cli, "in")
    assert [r["status"] for r in rows] == ["done"] * 200
    assert all(r["output"] for r in rows)
    reasons = {r["finish_reason"] for r in rows}
    assert reasons <= {"stop", "length"} and "length" in reasons  # 12 tokens cut most stories
    for row in rows:
        if row["finish_reason"] == "length":
            assert row["status"] == "done"  # no schema: a cut answer is still an answer
    if stream:
        assert all(r["ttft_ms"] is not None for r in rows)
        # llama-cpp-python ignores stream_options.include_usage: none is invented
        assert all(r["usage"] is None for r in rows)
    else:
        assert all(r["usage"]["completion_tokens"] >= 1 for r in rows)
        assert all(r["usage"]["prompt_tokens"] >= 1 for r in rows)
        lengths = [r for r in rows if r["finish_reason"] == "length"]
        assert all(r["usage"]["completion_tokens"] == 12 for r in lengths)


def test_a_prompt_over_the_context_window_fails_alone_with_the_servers_message(
    cli: CLI, tmp_path: Path, llama_server: LlamaServer
) -> None:
    inp = tmp_path / "in.jsonl"
    write_prompts(inp, 20, extra=lambda i: {"prompt": "word " * 900} if i == 7 else {})
    result = cli.run(
        "submit",
        str(inp),
        "--backend",
        "llamacpp",
        "--base-url",
        llama_server.url,
        "--max-tokens",
        "8",
        "--quiet",
    )
    assert result.returncode == 1, result.stderr
    rows = _results(cli, "in")
    assert [r["status"] for r in rows] == ["done"] * 7 + ["failed"] + ["done"] * 12
    assert "maximum context length is 512 tokens" in rows[7]["error"]
    # the empty stream, then the plain ask that says why (a 400): two requests, each counted
    # (README: `attempts` counts every request sent), and the 400 is not retried
    assert rows[7]["attempts"] == 2


def test_the_server_dies_midway_comes_back_and_resume_completes_the_job(
    cli: CLI, tmp_path: Path
) -> None:
    require_llamacpp()
    server = LlamaServer(tmp_path / "server.log")
    server.start()
    try:
        inp = tmp_path / "in.jsonl"
        write_prompts(inp, 200)
        run = cli.start(
            "submit",
            str(inp),
            "--backend",
            "llamacpp",
            "--base-url",
            server.url,
            "--max-tokens",
            "24",
            "--concurrency",
            "2",
            "--outage-timeout",
            "3",
            "--quiet",
        )
        deadline = time.monotonic() + 120
        while cli.counts("in").get("done", 0) < 40 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert cli.counts("in").get("done", 0) >= 40
        server.kill()
        _out, err = run.communicate(timeout=120)
        assert run.returncode == 3, err  # the endpoint stayed down past --outage-timeout
        counts = cli.counts("in")
        assert counts.get("failed", 0) == 0 and counts.get("pending", 0) > 0
        done_before = counts["done"]
        server.start()
        result = cli.run("resume", "in", "--quiet", timeout=300)
        assert result.returncode == 0, result.stderr
        rows = _results(cli, "in")
        assert [r["status"] for r in rows] == ["done"] * 200
        assert len({r["id"] for r in rows}) == 200
        log = [json.loads(x) for x in (cli.home / "logs" / "in.log").read_text().splitlines()]
        answered = [e["line"] for e in log if e["event"] == "attempt" and e["status"] == "ok"]
        # what was committed before the crash was not asked again
        assert len(answered) - len(set(answered)) <= 2
        assert done_before < 200
    finally:
        server.kill()


def test_auto_settles_at_one_on_a_server_that_cuts_a_running_answer_for_a_new_one(
    cli: CLI, tmp_path: Path
) -> None:
    """llama-cpp-python's server as it ships: a new request interrupts the stream in progress.
    The default `--concurrency auto` must read the cuts as "one at a time" and lose nothing."""
    require_llamacpp()
    server = LlamaServer(tmp_path / "server.log", interrupt=True)
    server.start()
    try:
        inp = tmp_path / "in.jsonl"
        write_prompts(inp, 150)
        result = cli.run(
            "submit",
            str(inp),
            "--backend",
            "llamacpp",
            "--base-url",
            server.url,
            "--max-tokens",
            "16",
            "--quiet",
            timeout=300,
        )
    finally:
        server.kill()
    assert result.returncode == 0, result.stderr
    rows = _results(cli, "in")
    assert [r["status"] for r in rows] == ["done"] * 150  # no item failed
    log = [json.loads(x) for x in (cli.home / "logs" / "in.log").read_text().splitlines()]
    stopped = next(e for e in log if e["event"] == "run_stopped")
    assert stopped["limit"] == 1
    moves = [e for e in log if e["event"] == "concurrency"]
    assert any(e["signal"] == "failures (cut)" and e["limit"] == 1 for e in moves)
