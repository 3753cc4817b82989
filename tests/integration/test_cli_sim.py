"""The real CLI in a subprocess against `batchrun sim` on 127.0.0.1."""

from __future__ import annotations

import json
import re
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from batchrun.sim import prompt_tag
from tests.integration.helpers import CLI, write_prompts

pytestmark = pytest.mark.integration

SLOW = ("--ttft-ms", "20", "--tpot-ms", "2")  # ~100 ms a request: long enough to interrupt


def assert_exactly_once(cli: CLI, job: str, prompts: list[str]) -> None:
    """Every input line has one final record, in order, holding its own prompt's answer."""
    items = cli.items(job)
    assert [r["line"] for r in items] == list(range(1, len(prompts) + 1))
    assert all(r["status"] == "done" for r in items), cli.counts(job)
    output = cli.output(job)
    assert [o["id"] for o in output] == [f"item-{i}" for i in range(len(prompts))]
    for record, prompt in zip(output, prompts, strict=True):
        assert record["status"] == "done"
        assert record["output"].startswith(prompt_tag(prompt)), (record, prompt)


def test_submit_status_export_and_resubmit(
    cli: CLI, sim_server: Callable[..., str], tmp_path: Path
) -> None:
    url = sim_server()
    inp = tmp_path / "prompts.jsonl"
    prompts = write_prompts(inp, 40, extra=lambda i: {"sku": i})
    first = cli.run("submit", str(inp), "--base-url", url, "--concurrency", "8")
    assert first.returncode == 0, first.stderr
    assert "40 done" in first.stderr and "results:" in first.stderr
    assert_exactly_once(cli, "prompts", prompts)
    assert cli.output("prompts")[7]["meta"] == {"sku": 7}

    status = cli.run("status", "prompts", "--json")
    detail = json.loads(status.stdout)
    assert detail["counts"]["done"] == 40 and detail["state"] == "complete"
    assert detail["endpoint"]["model"] == "sim-1"  # picked from /v1/models
    table = cli.run("status")
    assert "prompts" in table.stdout and "complete" in table.stdout

    again = cli.run("submit", str(inp), "--base-url", url)
    assert again.returncode == 0
    assert "exists for this file" in again.stderr and "nothing left to do" in again.stderr
    assert len(cli.items("prompts")) == 40  # no second job, no duplicated items

    other = tmp_path / "other.jsonl"
    write_prompts(other, 3)
    clash = cli.run("submit", str(other), "--job", "prompts", "--base-url", url)
    assert clash.returncode == 2 and "different input" in clash.stderr

    openai = tmp_path / "openai.jsonl"
    exported = cli.run("export", "prompts", "--format", "openai", "-o", str(openai))
    assert exported.returncode == 0, exported.stderr
    lines = [json.loads(x) for x in openai.read_text().splitlines()]
    assert lines[0]["custom_id"] == "item-0" and lines[0]["error"] is None
    assert lines[0]["response"]["status_code"] == 200
    body = lines[0]["response"]["body"]
    assert body["choices"][0]["message"]["content"].startswith(prompt_tag(prompts[0]))


def test_in_process_sim_backend_runs_the_readme_example(cli: CLI) -> None:
    example = Path(__file__).resolve().parents[2] / "inputs" / "example.jsonl"
    result = cli.run("submit", str(example), "--backend", "sim")
    assert result.returncode == 0, result.stderr
    output = cli.output("example")
    assert len(output) == len(example.read_text().splitlines())
    assert all(o["status"] == "done" and "[sim:" in o["output"] for o in output)


def test_bad_lines_refuse_the_submit_and_name_each_line(cli: CLI, tmp_path: Path) -> None:
    inp = tmp_path / "bad.jsonl"
    inp.write_bytes(
        b'{"id": "a", "prompt": "ok"}\n'
        b"{not json}\n"
        b'{"id": "c"}\n'
        b'{"id": "a", "prompt": "dup"}\n'
        b'{"prompt": "\xff\xfe"}\n'
    )
    result = cli.run("submit", str(inp), "--backend", "sim")
    assert result.returncode == 2
    for expected in (
        "line 2: invalid JSON",
        "line 3: no 'prompt'",
        "line 4: duplicate id 'a'",
        "line 5: not valid UTF-8",
        "nothing was sent",
    ):
        assert expected in result.stderr, result.stderr
    assert cli.counts("bad") == {}

    skipped = cli.run("submit", str(inp), "--backend", "sim", "--skip-invalid")
    assert skipped.returncode == 1, skipped.stderr
    output = cli.output("bad")
    assert [o["status"] for o in output] == ["done", "rejected", "rejected", "rejected", "rejected"]
    assert "duplicate id" in output[3]["error"]


def test_kill_9_midway_then_resume_records_everything_exactly_once(
    cli: CLI, sim_server: Callable[..., str], tmp_path: Path
) -> None:
    url = sim_server(*SLOW)
    inp = tmp_path / "big.jsonl"
    prompts = write_prompts(inp, 300)
    proc = cli.start("submit", str(inp), "--base-url", url, "--concurrency", "8", "--quiet")
    cli.wait_for("big", 60, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    counts = cli.counts("big")
    assert counts.get("done", 0) < 300 and counts.get("running", 0) > 0, counts

    resumed = cli.run("resume", "big")
    assert resumed.returncode == 0, resumed.stderr
    assert_exactly_once(cli, "big", prompts)
    log = [json.loads(x) for x in (cli.home / "logs" / "big.log").read_text().splitlines()]
    restarted = [e for e in log if e["event"] == "run_started"]
    assert len(restarted) == 2 and restarted[1]["reclaimed"] == counts["running"]


def test_sigint_stops_with_130_and_resume_completes(
    cli: CLI, sim_server: Callable[..., str], tmp_path: Path
) -> None:
    url = sim_server(*SLOW)
    inp = tmp_path / "big.jsonl"
    prompts = write_prompts(inp, 300)
    proc = cli.start("submit", str(inp), "--base-url", url, "--concurrency", "8")
    cli.wait_for("big", 40, proc)
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert re.search(r"stopping: waiting up to 10 s for \d+ request\(s\) in flight", err), err
    assert "Ctrl-C again to stop now" in err
    counts = cli.counts("big")
    assert counts.get("running", 0) == 0 and counts.get("pending", 0) > 0, counts
    assert not (cli.home / "outputs" / "big.jsonl").exists()  # written when the job finishes

    resumed = cli.run("resume", "big")
    assert resumed.returncode == 0, resumed.stderr
    assert_exactly_once(cli, "big", prompts)


def test_a_second_ctrl_c_stops_at_once_and_every_request_sent_has_its_log_line(
    cli: CLI, sim_server: Callable[..., str], tmp_path: Path
) -> None:
    url = sim_server("--ttft-ms", "3000")  # every request is still in flight when it stops
    inp = tmp_path / "cut.jsonl"
    write_prompts(inp, 40)
    proc = cli.start("submit", str(inp), "--base-url", url, "--concurrency", "8")
    log = cli.home / "logs" / "cut.log"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and "run_started" not in _text(log):
        time.sleep(0.05)
    time.sleep(0.5)  # requests on the wire
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    events = [json.loads(line) for line in log.read_text().splitlines()]
    (stopped,) = [e for e in events if e["event"] == "run_stopped"]
    attempts = [e for e in events if e["event"] == "attempt"]
    assert stopped["requests"] == len(attempts) > 0
    assert {a["status"] for a in attempts} == {"cancelled"}
    assert cli.counts("cut") == {"pending": 40}


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def test_sigterm_behaves_like_ctrl_c(
    cli: CLI, sim_server: Callable[..., str], tmp_path: Path
) -> None:
    url = sim_server(*SLOW)
    inp = tmp_path / "big.jsonl"
    write_prompts(inp, 300)
    proc = cli.start("submit", str(inp), "--base-url", url, "--concurrency", "8")
    cli.wait_for("big", 20, proc)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == 130
    assert cli.counts("big").get("running", 0) == 0


def test_wrong_key_aborts_with_3_and_the_key_never_reaches_disk(
    cli: CLI, sim_server: Callable[..., str], tmp_path: Path
) -> None:
    secret, wrong = "sk-right-0123456789abcdef", "sk-wrong-fedcba9876543210"
    url = sim_server("--api-key-env", "SIM_KEY", env={"SIM_KEY": secret})
    inp = tmp_path / "keyed.jsonl"
    prompts = write_prompts(inp, 30)
    denied = cli.run(
        "submit",
        str(inp),
        "--base-url",
        url,
        "--model",
        "sim-1",
        "--api-key-env",
        "MY_KEY",
        env={"MY_KEY": wrong},
    )
    assert denied.returncode == 3, denied.stderr
    assert "401" in denied.stderr and wrong not in denied.stderr
    assert cli.counts("keyed") == {"pending": 30}

    fixed = cli.run("resume", "keyed", env={"MY_KEY": secret})
    assert fixed.returncode == 0, fixed.stderr
    assert_exactly_once(cli, "keyed", prompts)
    for path in [
        *(cli.home / "jobs").iterdir(),
        *(cli.home / "logs").iterdir(),
        *(cli.home / "outputs").iterdir(),
    ]:
        data = path.read_bytes()
        assert secret.encode() not in data and wrong.encode() not in data, path


def test_unreachable_endpoint_aborts_with_items_pending(cli: CLI, tmp_path: Path) -> None:
    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    inp = tmp_path / "down.jsonl"
    write_prompts(inp, 10)
    result = cli.run(
        "submit",
        str(inp),
        "--base-url",
        f"http://127.0.0.1:{port}/v1",
        "--model",
        "m",
        "--outage-timeout",
        "1",
        "--max-attempts",
        "2",
    )
    assert result.returncode == 3, result.stderr
    assert "unreachable" in result.stderr
    assert cli.counts("down") == {"pending": 10}


def test_unknown_model_aborts_with_3(
    cli: CLI, sim_server: Callable[..., str], tmp_path: Path
) -> None:
    url = sim_server("--strict-models")
    inp = tmp_path / "m.jsonl"
    write_prompts(inp, 5)
    result = cli.run("submit", str(inp), "--base-url", url, "--model", "no-such-model")
    assert result.returncode == 3 and "404" in result.stderr
    assert cli.counts("m") == {"pending": 5}
    fixed = cli.run("resume", "m", "--model", "sim-1")
    assert fixed.returncode == 0, fixed.stderr


def test_a_second_process_on_a_live_job_joins_it_as_a_worker(
    cli: CLI, sim_server: Callable[..., str], tmp_path: Path
) -> None:
    url = sim_server(*SLOW)
    inp = tmp_path / "big.jsonl"
    prompts = write_prompts(inp, 300)
    pace = ("--concurrency", "4", "--rpm", "12000", "--quiet")  # the job's budget, shared
    first = cli.start("submit", str(inp), "--base-url", url, *pace)
    try:
        cli.wait_for("big", 10, first)
        second = cli.run("resume", "big", "--base-url", url, *pace)
        assert second.returncode in (0, 1), second.stderr  # 1: it ended while first still ran
        assert "Traceback" not in second.stderr
    finally:
        first.wait(timeout=60)
    assert first.returncode == 0
    assert_exactly_once(cli, "big", prompts)
    log = [json.loads(x) for x in (cli.home / "logs" / "big.log").read_text().splitlines()]
    owners = {e["owner"] for e in log if e["event"] == "run_started"}
    assert len(owners) == 2  # two workers took part
    shares = [(e["workers"], e["rank"]) for e in log if e["event"] == "budget_share"]
    assert (2, 1) in shares, shares  # the second took half of --rpm, and the second turn


def test_local_problems_are_clear_errors_not_tracebacks(cli: CLI, tmp_path: Path) -> None:
    inp = tmp_path / "in.jsonl"
    write_prompts(inp, 3)
    cases = [
        (["submit", str(tmp_path / "missing.jsonl"), "--backend", "sim"], "input file not found"),
        (["submit", str(tmp_path), "--backend", "sim"], "directory"),
        (["submit", str(inp), "--backend", "sim", "--schema", "nope.json"], "schema file"),
        (["submit", str(inp), "--backend", "sim", "--spec", str(inp)], "not valid TOML"),
        (["submit", str(inp)], "no endpoint chosen"),
        (["resume", "nosuchjob"], "no job named"),
        (["status", "nosuchjob"], "no job named"),
    ]
    for args, expected in cases:
        result = cli.run(*args)
        assert result.returncode == 2, (args, result.stderr)
        assert expected in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr, (args, result.stderr)
    assert cli.counts("in") == {}  # the bad schema refused the job before loading anything

    blocked = tmp_path / "file-not-folder"
    blocked.write_text("x")
    result = cli.run("--home", str(blocked / "home"), "submit", str(inp), "--backend", "sim")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr


def test_a_key_with_a_trailing_newline_is_refused_without_showing_it(
    cli: CLI, sim_server: Callable[..., str], tmp_path: Path
) -> None:
    url = sim_server()
    inp = tmp_path / "k.jsonl"
    write_prompts(inp, 3)
    secret = "sk-newline-0123456789"
    result = cli.run(
        "submit",
        str(inp),
        "--base-url",
        url,
        "--api-key-env",
        "NL_KEY",
        env={"NL_KEY": secret + "\n"},
    )
    assert result.returncode == 2, result.stderr
    assert "$NL_KEY" in result.stderr and secret not in result.stderr
    assert cli.counts("k") == {"pending": 3}
    for path in (cli.home / "logs").glob("*"):  # refused before the log is even opened
        assert secret not in path.read_text()


def test_no_run_needs_no_endpoint_and_says_what_a_second_one_does(cli: CLI, tmp_path: Path) -> None:
    inp = tmp_path / "later.jsonl"
    write_prompts(inp, 3)
    loaded = cli.run("submit", str(inp), "--no-run")
    assert loaded.returncode == 0, loaded.stderr
    assert "loaded 3 items" in loaded.stderr
    again = cli.run("submit", str(inp), "--no-run")
    assert again.returncode == 0 and "resuming" not in again.stderr
    assert "nothing loaded (--no-run); 3 item(s) still to send" in again.stderr
    assert json.loads(cli.run("status", "later", "--json").stdout)["state"] == "not started"
    assert "not started" in cli.run("status").stdout

    nowhere = cli.run("resume", "later")
    assert nowhere.returncode == 2 and "no endpoint chosen" in nowhere.stderr
    ran = cli.run("resume", "later", "--backend", "sim")
    assert ran.returncode == 0, ran.stderr
    assert cli.counts("later") == {"done": 3}
    assert json.loads(cli.run("status", "later", "--json").stdout)["state"] == "complete"

    # a hosted preset's key is needed when the job runs, not when it is loaded
    keyless = {"GROQ_API_KEY": ""}
    load = ("submit", str(inp), "--job", "hosted", "--backend", "groq", "--no-run")
    hosted = cli.run(*load, env=keyless)
    assert hosted.returncode == 0, hosted.stderr
    refused = cli.run("resume", "hosted", env=keyless)
    assert refused.returncode == 2 and "GROQ_API_KEY" in refused.stderr
