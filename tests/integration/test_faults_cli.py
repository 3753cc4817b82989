"""Faults a nightly run meets, through the real CLI: chaos, crash loops, outages, bad storage."""

from __future__ import annotations

import json
import random
import resource
import signal
import socket
import sqlite3
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration.helpers import (
    CHAOS_FAULTS,
    CLI,
    audited_records,
    cli_command,
    fault_args,
    free_port,
    install_audit,
    sim_stats,
    start_sim,
    write_prompts,
)
from tests.integration.test_cli_sim import assert_exactly_once

pytestmark = pytest.mark.integration


def test_chaos_2000_items_with_a_fifth_of_responses_faulty(
    cli: CLI, sim_server: Callable[..., str], tmp_path: Path
) -> None:
    url = sim_server("--ttft-ms", "0", "--tpot-ms", "0", *fault_args(CHAOS_FAULTS))
    inp = tmp_path / "chaos.jsonl"
    prompts = write_prompts(inp, 2000)
    loaded = cli.run("submit", str(inp), "--base-url", url, "--model", "sim-1", "--no-run")
    assert loaded.returncode == 0, loaded.stderr
    install_audit(cli.home / "jobs" / "ledger.db")
    result = cli.run(
        "resume",
        "chaos",
        "--concurrency",
        "32",
        "--timeout",
        "3",
        "--max-attempts",
        "12",
        "--quiet",
    )
    assert result.returncode == 0, result.stderr
    assert_exactly_once(cli, "chaos", prompts)
    assert audited_records(cli.home / "jobs" / "ledger.db", "chaos") == (2000, 2000)
    stats = sim_stats(url)
    faults = stats["faults"]
    assert set(faults) == set(CHAOS_FAULTS), faults  # every kind was injected
    assert sum(faults.values()) / stats["requests"] >= 0.20
    assert stats["answered"] == 2000
    attempts = sum(r["attempts"] for r in cli.items("chaos"))
    # Every request the server saw is in the ledger, or was sent again at once on a new
    # connection because a reset came on a reused one before any answer (as a stale
    # keep-alive connection does; the job log counts those).
    log = [json.loads(line) for line in (cli.home / "logs" / "chaos.log").open()]
    resent = sum(e["stale_resends"] for e in log if e["event"] == "run_stopped")
    assert attempts + resent == stats["requests"]


def test_crash_loop_ten_kills_then_exact_results(
    cli: CLI, sim_server: Callable[..., str], tmp_path: Path
) -> None:
    url = sim_server("--ttft-ms", "10", "--tpot-ms", "1")
    inp = tmp_path / "loop.jsonl"
    prompts = write_prompts(inp, 1500)
    command = (
        "submit",
        str(inp),
        "--base-url",
        url,
        "--model",
        "sim-1",
        "--concurrency",
        "8",
        "--quiet",
    )
    assert cli.run(*command, "--no-run").returncode == 0
    db = cli.home / "jobs" / "ledger.db"
    install_audit(db)
    rng = random.Random(20261129)
    for kill in range(1, 11):
        proc = cli.start(*command)
        # Mid-run every time: wait until this run has committed new results, then a random
        # moment later (in flight, in the commit window, or in a commit) kill it.
        cli.wait_for("loop", 100 * kill, proc)
        time.sleep(rng.uniform(0.0, 0.3))
        assert proc.poll() is None, "the job finished before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert sum(cli.counts("loop").values()) == 1500
    final = cli.run(*command)
    assert final.returncode == 0, final.stderr
    assert_exactly_once(cli, "loop", prompts)
    committed, distinct = audited_records(db, "loop")
    assert (committed, distinct) == (1500, 1500)  # no result was ever committed twice
    stats = sim_stats(url)
    assert stats["answered"] == 1500
    # Re-sent answers are bounded by what was in flight or not yet committed at each kill:
    # 8 in flight plus ~0.2 s of results at a few hundred a second.
    assert stats["resent_after_success"] <= 10 * 120, stats


def test_outage_stops_with_3_and_resume_completes_when_the_server_is_back(
    cli: CLI, tmp_path: Path
) -> None:
    port = str(free_port())
    server, url = start_sim("--port", port, "--ttft-ms", "20", "--tpot-ms", "2")
    inp = tmp_path / "outage.jsonl"
    prompts = write_prompts(inp, 400)
    try:
        proc = cli.start(
            "submit",
            str(inp),
            "--base-url",
            url,
            "--model",
            "sim-1",
            "--concurrency",
            "8",
            "--outage-timeout",
            "2",
            "--quiet",
        )
        cli.wait_for("outage", 50, proc)
        server.terminate()
        server.wait(timeout=10)
        _out, err = proc.communicate(timeout=60)
        assert proc.returncode == 3, err
        assert "unreachable" in err
        counts = cli.counts("outage")
        assert counts.get("failed", 0) == 0 and counts.get("running", 0) == 0, counts
        assert counts.get("pending", 0) > 0, counts
    finally:
        server.kill()
    server, url = start_sim("--port", port)
    try:
        resumed = cli.run("resume", "outage")
        assert resumed.returncode == 0, resumed.stderr
        assert_exactly_once(cli, "outage", prompts)
    finally:
        server.kill()


def _limit_file_size(max_bytes: int) -> Callable[[], None]:
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, max_bytes))

    return apply


def test_full_disk_is_a_clear_error_and_resume_recovers(
    cli: CLI, sim_server: Callable[..., str], tmp_path: Path
) -> None:
    url = sim_server("--ttft-ms", "0", "--tpot-ms", "0")
    inp = tmp_path / "full.jsonl"
    prompts = write_prompts(inp, 3000)
    loaded = cli.run("submit", str(inp), "--base-url", url, "--model", "sim-1", "--no-run")
    assert loaded.returncode == 0, loaded.stderr
    # Every file the run writes may grow to 256 KiB: the ledger's WAL fills up mid-run, as on a
    # full disk (writes fail with EFBIG, which SQLite reports as "database or disk is full").
    full = subprocess.run(
        [*cli_command(cli.home), "resume", "full", "--quiet"],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_limit_file_size(256 * 1024),
    )
    assert full.returncode == 2, full.stderr
    assert "disk full" in full.stderr, full.stderr
    assert "Traceback" not in full.stderr
    assert not (cli.home / "outputs" / "full.jsonl").exists()
    assert not list((cli.home / "outputs").glob(".*tmp*"))
    resumed = cli.run("resume", "full")
    assert resumed.returncode == 0, resumed.stderr
    assert_exactly_once(cli, "full", prompts)


def test_full_disk_hitting_the_job_log_first_is_a_clear_error(cli: CLI, tmp_path: Path) -> None:
    inp = tmp_path / "logfull.jsonl"
    prompts = write_prompts(inp, 20)
    assert cli.run("submit", str(inp), "--backend", "sim", "--no-run").returncode == 0
    limit = 1024 * 1024
    log = cli.home / "logs" / "logfull.log"
    log.parent.mkdir(exist_ok=True)
    log.write_bytes(b"x" * (limit - 200))  # the log can take a line or two more, no more
    full = subprocess.run(
        [*cli_command(cli.home), "resume", "logfull"],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_limit_file_size(limit),
    )
    assert full.returncode == 2, full.stderr
    assert "cannot write the job log" in full.stderr and "Traceback" not in full.stderr
    log.write_bytes(b"")
    resumed = cli.run("resume", "logfull")
    assert resumed.returncode == 0, resumed.stderr
    assert_exactly_once(cli, "logfull", prompts)


def test_read_only_and_corrupt_ledgers_are_clear_errors(cli: CLI, tmp_path: Path) -> None:
    inp = tmp_path / "ro.jsonl"
    write_prompts(inp, 5)
    assert cli.run("submit", str(inp), "--backend", "sim", "--no-run").returncode == 0
    db = cli.home / "jobs" / "ledger.db"
    read_only = f"sqlite:///file:{db}?mode=ro&uri=true"
    result = cli.run("--ledger", read_only, "resume", "ro")
    assert result.returncode == 2, result.stderr
    assert "readonly" in result.stderr and "Traceback" not in result.stderr
    assert cli.counts("ro") == {"pending": 5}

    corrupt = tmp_path / "corrupt.db"
    corrupt.write_bytes(b"definitely not SQLite " * 500)
    for args in (("status",), ("resume", "ro"), ("submit", str(inp), "--backend", "sim")):
        result = cli.run("--ledger", f"sqlite:///{corrupt}", *args)
        assert result.returncode == 2, (args, result.stderr)
        assert "not a database" in result.stderr and "Traceback" not in result.stderr


def test_unwritable_outputs_folder_fails_cleanly_and_export_recovers(
    cli: CLI, tmp_path: Path
) -> None:
    inp = tmp_path / "out.jsonl"
    prompts = write_prompts(inp, 20)
    (cli.home / "outputs").write_text("a file where the outputs folder should be")
    result = cli.run("submit", str(inp), "--backend", "sim")
    assert result.returncode == 2, result.stderr
    assert "cannot write results" in result.stderr and "Traceback" not in result.stderr
    assert cli.counts("out") == {"done": 20}  # the work itself is safe in the ledger
    (cli.home / "outputs").unlink()
    again = cli.run("submit", str(inp), "--backend", "sim")
    assert again.returncode == 0, again.stderr
    assert_exactly_once(cli, "out", prompts)


def test_input_changed_between_submit_and_resume_is_refused(cli: CLI, tmp_path: Path) -> None:
    inp = tmp_path / "changing.jsonl"
    write_prompts(inp, 10)
    assert cli.run("submit", str(inp), "--backend", "sim", "--no-run").returncode == 0
    with inp.open("a") as f:
        f.write(json.dumps({"id": "late", "prompt": "added after submit"}) + "\n")
    refused = cli.run("resume", "changing")
    assert refused.returncode == 2 and "changed since" in refused.stderr, refused.stderr
    assert cli.counts("changing") == {"pending": 10}
    allowed = cli.run("resume", "changing", "--allow-changed-input")
    assert allowed.returncode == 0, allowed.stderr
    assert len(cli.output("changing")) == 10  # the stored requests, as submitted
    inp.unlink()
    gone = cli.run("resume", "changing")
    assert gone.returncode == 0 and "is gone" in gone.stderr


def test_oversized_prompts_are_refused_before_anything_is_sent(
    cli: CLI, sim_server: Callable[..., str], tmp_path: Path
) -> None:
    url = sim_server()
    inp = tmp_path / "long.jsonl"
    with inp.open("w") as f:
        f.write(json.dumps({"id": "short", "prompt": "fine"}) + "\n")
        f.write(json.dumps({"id": "long", "prompt": "word " * 5000}) + "\n")
        f.write(json.dumps({"id": "nul", "prompt": "a\u0000b"}) + "\n")
    result = cli.run("submit", str(inp), "--base-url", url, "--max-input-tokens", "1000")
    assert result.returncode == 2, result.stderr
    assert "line 2: the prompt has about 6250 tokens" in result.stderr
    assert "line 3: the prompt contains a NUL character" in result.stderr
    assert sim_stats(url)["requests"] == 0


def test_stale_ledger_lock_from_a_dead_process_does_not_block(cli: CLI, tmp_path: Path) -> None:
    inp = tmp_path / "stale.jsonl"
    prompts = write_prompts(inp, 30)
    assert cli.run("submit", str(inp), "--backend", "sim", "--no-run").returncode == 0
    dead = subprocess.Popen(["true"])  # an exited process: its pid names nobody now
    dead.wait()
    conn = sqlite3.connect(cli.home / "jobs" / "ledger.db")
    with conn:  # what a runner killed mid-claim leaves behind
        conn.execute(
            "UPDATE jobs SET runner_owner='dead', runner_pid=?, runner_host=?, runner_heartbeat=?",
            (dead.pid, socket.gethostname(), time.time()),
        )
        conn.execute("UPDATE items SET status='running', owner='dead' WHERE line <= 10")
    conn.close()
    resumed = cli.run("resume", "stale")
    assert resumed.returncode == 0, resumed.stderr
    assert_exactly_once(cli, "stale", prompts)
