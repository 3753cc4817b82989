"""`--mode batch` against the simulator's Batch API (in-process): chunks within limits, results
mapped back by line, expired lines finished online, and a run killed at each point between the
ledger and the provider that resumes without a second batch for the same items."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from batchrun import hosted, jobs, retention
from batchrun.config import resolve
from batchrun.errors import UsageError
from batchrun.jobs import Home
from batchrun.ledger import Ledger, chunks
from batchrun.run_state import RunnerSettings, RunStats
from batchrun.sim import SimConfig, SimModel, SimTransport


class Killed(Exception):
    """Where a test's `kill -9` lands: nothing after it runs."""


def load(
    tmp_path: Path, n: int, url: str | None = None, **options: Any
) -> tuple[Ledger, Home, Any]:
    home = Home.at(tmp_path, url)
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
async def test_a_job_runs_as_batches_within_the_request_limit(
    tmp_path: Path, ledger_url: str
) -> None:
    ledger, home, spec = load(tmp_path, 20, ledger_url, batch_max_requests=7)
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
async def test_an_expired_batch_finishes_its_other_half_online(
    tmp_path: Path, ledger_url: str
) -> None:
    ledger, home, spec = load(tmp_path, 20, ledger_url, then="online")
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
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, point: str, ledger_url: str
) -> None:
    ledger, home, spec = load(tmp_path, 12, ledger_url)
    model = sim()

    def crash(name: str) -> None:
        if name == point:
            raise Killed(name)

    monkeypatch.setattr(hosted, "_crash_point", crash)
    with pytest.raises(Killed):
        await run(ledger, home, spec, model)
    assert ledger.counts("j")["batched"] == 12  # in the chunk, whatever the provider has
    monkeypatch.undo()
    monkeypatch.setattr(chunks, "_alive", lambda _owner: False)  # the killed run's process
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
    with pytest.raises(UsageError, match="not"):
        resolve({"mode": "batch", "model": "m", "endpoints": ["a=http://a", "b=http://b"]})


class Flaky(SimTransport):
    """The simulator, with scripted answers for some requests: `script(method, path, n)`
    returns a status to answer instead (n counts requests to that method and path)."""

    def __init__(self, model: SimModel, script: Any) -> None:
        super().__init__(model)
        self.script = script
        self.seen: dict[tuple[str, str], int] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        key = (request.method, request.url.path)
        self.seen[key] = self.seen.get(key, 0) + 1
        status = self.script(request.method, request.url.path, self.seen[key])
        if status is not None:
            return httpx.Response(status, json={"error": {"message": f"scripted {status}"}})
        return await super().handle_async_request(request)


async def run_with(ledger: Ledger, home: Home, spec: Any, transport: Any) -> RunStats:
    return await jobs.run_job(ledger, home, "j", spec, transport=transport, handle_signals=False)


@pytest.mark.anyio
async def test_a_transient_error_while_polling_is_waited_out(tmp_path: Path) -> None:
    ledger, home, spec = load(tmp_path, 10)

    def script(method: str, path: str, n: int) -> int | None:
        return 503 if method == "GET" and path.startswith("/v1/batches/") and n == 2 else None

    stats = await run_with(ledger, home, spec, Flaky(sim(), script))
    assert stats.aborted is None and ledger.counts("j")["done"] == 10


@pytest.mark.anyio
async def test_a_refused_upload_puts_the_lines_back_instead_of_holding_them(
    tmp_path: Path,
) -> None:
    ledger, home, spec = load(tmp_path, 10)

    def script(method: str, path: str, n: int) -> int | None:
        return 413 if path == "/v1/files" else None

    stats = await run_with(ledger, home, spec, Flaky(sim(), script))
    assert stats.aborted is not None and "413" in stats.aborted
    assert ledger.counts("j")["pending"] == 10  # not stuck in a chunk: online can take them
    online = await run_with(ledger, home, replace(spec, mode="online"), SimTransport(sim()))
    assert online.aborted is None and ledger.counts("j")["done"] == 10


@pytest.mark.anyio
async def test_a_batch_failed_at_validation_says_why(tmp_path: Path) -> None:
    ledger, home, spec = load(tmp_path, 10)
    stats = await run_with(ledger, home, spec, SimTransport(sim(batch_max_requests=3)))
    assert stats.aborted is not None and "over the limit of 3" in stats.aborted
    assert ledger.counts("j")["pending"] == 10


@pytest.mark.anyio
async def test_an_online_resume_collects_open_batches_and_makes_no_new_ones(
    tmp_path: Path,
) -> None:
    ledger, home, spec = load(tmp_path, 20, batch_max_requests=5)
    model = sim(batch_seconds=30.0)  # the batches will not be done for a while
    transport = SimTransport(model)

    def crash(name: str) -> None:
        if name == "created":
            raise Killed(name)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hosted, "_crash_point", crash)
        with pytest.raises(Killed):
            await run_with(ledger, home, spec, transport)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(chunks, "_alive", lambda _owner: False)
        stats = await run_with(ledger, home, replace(spec, mode="online"), transport)
    assert model.batches.created == 1  # the one the killed run made, adopted; no new ones
    counts = ledger.counts("j")
    assert counts["batched"] == 5 and counts["done"] == 15 and stats.aborted is None


@pytest.mark.anyio
async def test_an_invalid_batch_answer_is_repaired_online_as_a_follow_up(tmp_path: Path) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    ledger, home, spec = load(
        tmp_path, 10, then="online", schema=str(tmp_path / "schema.json"), guided=False
    )
    model = sim(json_schema=schema, json_styles={"broken": 1.0})  # every first answer broken
    stats = await run(ledger, home, spec, model)
    assert ledger.counts("j")["done"] == 10 and stats.batches == 1
    assert model.requests == 10 + 10  # the batch's lines, then one repair each: no re-sends
    stored = list(ledger.iter_results("j"))
    assert all(item.repairs == 1 and item.parsed for item in stored)
    assert all(item.completion_tokens for item in stored)  # the batch answer's tokens counted


@pytest.mark.anyio
async def test_gc_leaves_a_job_with_batches_at_the_provider_alone(tmp_path: Path) -> None:
    ledger, home, spec = load(tmp_path, 6)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hosted, "_crash_point", lambda name: _kill(name, "created"))
        with pytest.raises(Killed):
            await run(ledger, home, spec, sim())
    done = retention.gc("0m", everything=True, home=tmp_path)
    assert done.running == ["j"] and ledger.counts("j")["batched"] == 6


def _kill(name: str, at: str) -> None:
    if name == at:
        raise Killed(name)
