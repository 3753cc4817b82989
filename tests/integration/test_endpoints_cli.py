"""The real CLI against several `batchrun sim` servers at once: one killed mid-run (its work
goes to the others, no item fails, no attempt is spent on it), `status` per endpoint, and an
endpoint with a wrong key taken out while the others finish the job."""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from tests.audit import Outside
from tests.integration.helpers import CLI, start_sim, write_prompts

pytestmark = pytest.mark.integration

SLOW = ("--ttft-ms", "20", "--tpot-ms", "2", "--slots", "8")  # ~100 ms a request


def stop(*servers: tuple[subprocess.Popen[str], str]) -> None:
    for proc, _url in servers:
        proc.kill()
        proc.wait()


def test_a_killed_endpoint_hands_its_work_to_the_others(cli: CLI, tmp_path: Path) -> None:
    servers = {name: start_sim("--port", "0", *SLOW) for name in ("a", "b", "c")}
    try:
        inp = tmp_path / "in.jsonl"
        write_prompts(inp, 600)
        assert cli.run("submit", str(inp), "--job", "j", "--no-run", "-q").returncode == 0
        outside = Outside(f"sqlite:///{cli.home / 'jobs' / 'ledger.db'}")
        outside.install_audit()
        flags = [f"--endpoint={name}={url}" for name, (_proc, url) in servers.items()]
        # one attempt per item: an attempt spent on the dead endpoint would fail its item
        job = cli.start("resume", "j", *flags, "--max-attempts", "1", "--concurrency", "4")
        cli.wait_for("j", 150, job)
        servers["c"][0].kill()
        _out, err = job.communicate(timeout=120)
        assert job.returncode == 0, err
    finally:
        stop(*servers.values())
    records = cli.output("j")
    assert [r["status"] for r in records] == ["done"] * 600
    assert [r["id"] for r in records] == [f"item-{i}" for i in range(600)]
    by = Counter(r["answered_by"] for r in records)
    assert set(by) == {"a", "b", "c"} and by["c"] < min(by["a"], by["b"])
    assert outside.committed_once(600)
    assert "endpoint c down" in err and "c " in err.splitlines()[-1]
    status = json.loads(cli.run("status", "j", "--json").stdout)
    shown = {e["name"]: e for e in status["endpoints"]}
    assert shown["c"]["state"] == "down" and shown["a"]["items"] == {"done": by["a"]}


def test_a_wrong_key_takes_one_endpoint_out(
    cli: CLI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SIM_LOCK", "right-key-123456")  # the locked server's own key
    good = start_sim("--port", "0", *SLOW)
    locked = start_sim("--port", "0", "--api-key-env", "SIM_LOCK", *SLOW)
    try:
        inp = tmp_path / "in.jsonl"
        write_prompts(inp, 100)
        got = cli.run(
            "submit",
            str(inp),
            "--job",
            "k",
            f"--endpoint=open={good[1]}",
            f"--endpoint=locked={locked[1]},key=WRONG_KEY,model=sim-1",
            env={"WRONG_KEY": "wrong-key-654321"},
        )
    finally:
        stop(good, locked)
    assert got.returncode == 0, got.stderr
    assert "endpoint locked out" in got.stderr
    assert "locked 0 answered (out: " in got.stderr.splitlines()[-1]
    assert "wrong-key" not in got.stderr + got.stdout
    assert Counter(r["answered_by"] for r in cli.output("k")) == {"open": 100}


def test_an_endpoint_with_a_wrong_path_is_drained_not_sent_every_line(
    cli: CLI, tmp_path: Path
) -> None:
    # Every line names its model, so a 404 could be the line's own (a model that endpoint
    # lacks) and takes nothing out; but an endpoint that 404s what another answers is drained.
    good = start_sim("--port", "0", *SLOW)
    wrong = start_sim("--port", "0", *SLOW)
    try:
        inp = tmp_path / "in.jsonl"
        write_prompts(inp, 200, extra=lambda i: {"model": "sim-1"})
        wrong_path = wrong[1].removesuffix("/v1") + "/v2"  # a typo in the endpoint's URL
        got = cli.run(
            "submit",
            str(inp),
            "--job",
            "w",
            f"--endpoint=good={good[1]}",
            f"--endpoint=typo={wrong_path},model=sim-1",
            "--max-attempts",
            "1",
        )
    finally:
        stop(good, wrong)
    assert got.returncode == 0, got.stderr
    assert "endpoint typo down: refused 4 lines in a row" in got.stderr
    records = cli.output("w")
    assert [r["status"] for r in records] == ["done"] * 200
    assert Counter(r["answered_by"] for r in records) == {"good": 200}
    status = json.loads(cli.run("status", "w", "--json").stdout)
    shown = {e["name"]: e for e in status["endpoints"]}
    assert shown["typo"]["state"] == "down" and 4 <= shown["typo"]["errors"] <= 40
