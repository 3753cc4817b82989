"""`--mode batch` with the real CLI against `batchrun sim`'s Batch API: the OpenAI SDK's own
batches client talks to the simulator; `kill -9` (BATCHRUN_CRASH_AT, the test mode) between the
upload and the create, between the create and its record, and after the download before
anything is recorded, ten times each: no second batch for the same items at the provider,
nothing lost, nothing recorded twice; an expired batch finishes online; `cancel`."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest

from batchrun.hosted import CRASH_POINTS
from tests.audit import Outside
from tests.integration.helpers import CLI, write_prompts

pytestmark = pytest.mark.integration

FAST = ("--ttft-ms", "1", "--tpot-ms", "0", "--batch-seconds", "0.3")
# --no-reuse: every job here asks the same prompts, which reuse would answer from the first
BATCH = ("--mode", "batch", "--poll-interval", "0.05", "--model", "sim-1", "--no-reuse", "-q")


def batches_of(url: str, job: str) -> list[dict[str, Any]]:
    """The provider's batches whose metadata names the job."""
    with urllib.request.urlopen(f"{url}/batches?limit=100", timeout=10) as response:
        data = json.loads(response.read())["data"]
    return [b for b in data if (b.get("metadata") or {}).get("batchrun_job") == job]


def test_the_sdk_batches_client_runs_a_batch_on_the_simulator(
    sim_server: Callable[..., str], tmp_path: Path
) -> None:
    url = sim_server(*FAST)
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    line = {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "sim-1", "messages": [{"role": "user", "content": "hi"}]},
    }
    uploaded = client.files.create(file=("in.jsonl", json.dumps(line).encode()), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    for _ in range(100):
        batch = client.batches.retrieve(batch.id)
        if batch.status == "completed":
            break
        time.sleep(0.05)
    assert batch.status == "completed" and batch.output_file_id
    (answer,) = client.files.content(batch.output_file_id).text.splitlines()
    assert json.loads(answer)["custom_id"] == "a"


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_kill_9_at_each_point_ten_times_never_makes_a_second_batch(
    cli: CLI, sim_server: Callable[..., str], tmp_path: Path, point: str
) -> None:
    url = sim_server(*FAST)
    outside: Outside | None = None
    for round_ in range(10):
        job = f"{point}-{round_}"
        inp = tmp_path / f"{job}.jsonl"
        write_prompts(inp, 30)
        assert cli.run("submit", str(inp), "--job", job, "--no-run", "-q").returncode == 0
        if outside is None:
            outside = Outside(f"sqlite:///{cli.home / 'jobs' / 'ledger.db'}")
            outside.install_audit()
        flags = ("--base-url", url, "--batch-max-requests", "10", *BATCH)
        killed = cli.run("resume", job, *flags, env={"BATCHRUN_CRASH_AT": point})
        assert killed.returncode == -9, killed.stderr
        done = cli.run("resume", job, *flags)
        assert done.returncode == 0, done.stderr
        assert cli.counts(job) == {"done": 30}
        assert [r["id"] for r in cli.output(job)] == [f"item-{i}" for i in range(30)]
        assert len(batches_of(url, job)) == 3  # one per chunk of 10, whatever the kill hit
        assert outside.committed_once(30, job)


def test_an_expired_batch_finishes_online_and_cancel_stops_one(
    cli: CLI, sim_server: Callable[..., str], tmp_path: Path
) -> None:
    url = sim_server(
        "--ttft-ms", "1", "--tpot-ms", "0", "--batch-seconds", "4", "--batch-window-s", "1"
    )
    inp = tmp_path / "late.jsonl"
    write_prompts(inp, 40)
    got = cli.run("submit", str(inp), "--base-url", url, *BATCH, "--then", "online")
    assert got.returncode == 0, got.stderr
    by = [r.get("answered_by") for r in cli.output("late")]
    assert 0 < by.count("batch") < 40 and by.count(None) == 40 - by.count("batch")
    status = json.loads(cli.run("status", "late", "--json").stdout)
    assert [b["state"] for b in status["batches"]] == ["collected"]

    slow = sim_server("--ttft-ms", "1", "--tpot-ms", "0", "--batch-seconds", "60")
    inp = tmp_path / "slow.jsonl"
    write_prompts(inp, 10)
    job = cli.start("submit", str(inp), "--base-url", slow, *BATCH)
    for _ in range(200):
        if batches_of(slow, "slow"):
            break
        time.sleep(0.05)
    cancelled = cli.run("cancel", "slow")
    assert cancelled.returncode == 0 and "cancelled 1 batch" in cancelled.stdout + cancelled.stderr
    _out, err = job.communicate(timeout=60)
    assert job.returncode == 1, err  # it collected what the batch answered; the rest is pending
    assert "not finished: `batchrun resume slow` sends or collects the rest" in err
    counts = cli.counts("slow")
    assert counts.get("pending", 0) + counts.get("done", 0) == 10 and counts.get("pending", 0) > 0
