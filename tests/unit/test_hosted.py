"""`--mode batch` against the simulator's Batch API (in-process): chunks within limits, results
mapped back by line, expired lines finished online, and a run killed at each point between the
ledger and the provider that resumes without a second batch for the same items."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from batchrun import hosted, jobs
from batchrun.config import resolve
from batchrun.errors import UsageError
from batchrun.jobs import Home
from batchrun.ledger import Ledger
from batchrun.run_state import RunnerSettings, RunStats
from batchrun.sim import SimConfig, SimModel, SimTransport


class Killed(Exception):
    """Where a test's `kill -9` lands: nothing after it runs."""


def load(tmp_path: Path, n: int, **options: Any) -> tuple[Ledger, Home, Any]:
    home = Home.at(tmp_path, None)
    ledger = Ledger(home.ledger_url)
    lines = [{"id": f"p{i}", "prompt": f"prompt number {i}"} for i in range(n)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    spec = resolve(
        {"backend": "sim", "mode": "batch", "poll_interval": 0.02, "model": "sim-1", **options}
    )
    jobs.create_job(ledger, "j", tmp_path / "in.jsonl", spec)
    return ledger, home, spec


async def run(ledger: Ledger, home: Home, spec: Any, model: SimModel) -> RunStats:
    stats = await jobs.run_job(
        ledger,
        home,
        "j",
        spec,
        transport=SimTransport(model),
        settings=RunnerSettings(drain_timeout=0.0),
        handle_signals=False,
    )
    jobs.finish(ledger, home, "j", spec)
    return stats


def sim(**config: Any) -> SimModel:
    return SimModel(SimConfig(**{"batch_seconds": 0.05, **config}))


def output(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (tmp_path / "outputs" / "j.jsonl").read_text().splitlines()]


@pytest.mark.anyio
async def test_a_job_runs_as_batches_within_the_request_limit(tmp_path: Path) -> None:
    ledger, home, spec = load(tmp_path, 20, batch_max_requests=7)
    model = sim()
    stats = await run(ledger, home, spec, model)
    assert ledger.counts("j")["done"] == 20 and stats.batches == 3 == model.batches.created
    assert model.requests == 20  # every line answered once, inside the batches
    records = output(tmp_path)
    assert [r["id"] for r in records] == [f"p{i}" for i in range(20)]
    assert {r["answered_by"] for r in records} == {"batch"}
    assert stats.batch_tokens > 0
    assert [c.state for c in ledger.chunks.listed("j")] == ["collected"] * 3


@pytest.mark.anyio
async def test_an_expired_batch_finishes_its_other_half_online(tmp_path: Path) -> None:
    ledger, home, spec = load(tmp_path, 20, then="online")
    model = sim(batch_seconds=1.0, batch_window_s=0.5)
    stats = await run(ledger, home, spec, model)
    assert ledger.counts("j")["done"] == 20 and stats.batches == 1
    by = [r.get("answered_by") for r in output(tmp_path)]
    assert 0 < by.count("batch") < 20 and by.count(None) == 20 - by.count("batch")


@pytest.mark.anyio
async def test_without_then_online_the_rest_waits_pending(tmp_path: Path) -> None:
    ledger, home, spec = load(tmp_path, 20)
    stats = await run(ledger, home, spec, sim(faults={"500": 0.3}, fault_seed=5))
    counts = ledger.counts("j")
    assert counts["done"] + counts["pending"] == 20 and counts["pending"] > 0
    assert stats.aborted is None


@pytest.mark.parametrize("point", hosted.CRASH_POINTS)
@pytest.mark.anyio
async def test_a_run_killed_at_each_point_resumes_without_a_second_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, point: str
) -> None:
    ledger, home, spec = load(tmp_path, 12)
    model = sim()

    def crash(name: str) -> None:
        if name == point:
            raise Killed(name)

    monkeypatch.setattr(hosted, "_crash_point", crash)
    with pytest.raises(Killed):
        await run(ledger, home, spec, model)
    assert ledger.counts("j")["batched"] == 12  # in the chunk, whatever the provider has
    monkeypatch.undo()
    stats = await run(ledger, home, spec, model)
    assert ledger.counts("j")["done"] == 12
    assert model.batches.created == 1  # adopted or created once, never twice
    assert model.requests == 12
    assert stats.aborted is None


@pytest.mark.anyio
async def test_the_error_file_says_why_lines_went_back(tmp_path: Path) -> None:
    ledger, home, spec = load(tmp_path, 30)
    await run(ledger, home, spec, sim(faults={"503": 0.3}, fault_seed=2))
    events = [json.loads(x) for x in (tmp_path / "logs" / "j.log").read_text().splitlines()]
    (collected,) = [e for e in events if e["event"] == "batch_collected"]
    assert collected["failures"] == {"HTTP 503": collected["back_to_pending"]}
    assert collected["recorded"] + collected["back_to_pending"] == 30


@pytest.mark.anyio
async def test_a_nightly_rerun_in_batch_mode_sends_only_what_changed(tmp_path: Path) -> None:
    ledger, home, spec = load(tmp_path, 20)
    model = sim()
    await run(ledger, home, spec, model)
    lines = [{"id": f"p{i}", "prompt": f"prompt number {i}"} for i in range(25)]  # 5 new
    (tmp_path / "night2.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    jobs.create_job(ledger, "n2", tmp_path / "night2.jsonl", spec)
    stats = await jobs.run_job(
        ledger, home, "n2", spec, transport=SimTransport(model), handle_signals=False
    )
    assert ledger.counts("n2")["done"] == 25 and stats.batches == 1
    assert model.requests == 20 + 5  # the 20 unchanged lines reused, not sent again


def test_batch_mode_needs_a_model_and_one_endpoint() -> None:
    with pytest.raises(UsageError, match="needs"):
        resolve({"backend": "sim", "mode": "batch"})
    with pytest.raises(UsageError, match="one endpoint"):
        resolve({"mode": "batch", "model": "m", "endpoints": ["a=http://a", "b=http://b"]})
