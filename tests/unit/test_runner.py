"""The runner end to end over the simulator transport: no sockets, no real waits."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from sqlalchemy import text

from batchrun import jobs, progress, reuse
from batchrun.backends import OpenAICompatBackend
from batchrun.cli_errors import EXIT_ABORTED, EXIT_INTERRUPTED, EXIT_SOME_FAILED
from batchrun.cli_report import exit_code
from batchrun.config import resolve
from batchrun.errors import LedgerError
from batchrun.jobs import Home
from batchrun.lanes import Route
from batchrun.ledger import ClaimedItem, Ledger, Recorded
from batchrun.progress import JobLog
from batchrun.report import JobReport
from batchrun.run_state import RunnerSettings, RunStats
from batchrun.runner import Runner
from batchrun.sim import SimModel, SimTransport, prompt_tag
from tests.fakes import FakeTime

Handler = Callable[[httpx.Request, int], httpx.Response | None]


class ScriptedTransport(httpx.AsyncBaseTransport):
    """Answers from `handler(request, call_number_for_this_prompt)`, else from the simulator."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.sim = SimTransport(SimModel())
        self.calls: dict[str, int] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method != "POST":
            return await self.sim.handle_async_request(request)
        body = json.loads(request.content)
        key = body["messages"][-1]["content"]
        self.calls[key] = self.calls.get(key, 0) + 1
        scripted = self.handler(request, self.calls[key])
        if scripted is not None:
            return scripted
        return await self.sim.handle_async_request(request)


def write_prompts(path: Path, n: int) -> list[str]:
    prompts = [f"prompt number {i}" for i in range(n)]
    path.write_text(
        "".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(prompts))
    )
    return prompts


async def run(
    tmp_path: Path,
    n: int,
    transport: httpx.AsyncBaseTransport | None = None,
    fake: FakeTime | None = None,
    ledger_type: type[Ledger] = Ledger,
    **options: Any,
) -> tuple[Ledger, RunStats, list[str]]:
    home = Home.at(tmp_path, None)
    ledger = ledger_type(home.ledger_url)
    prompts = write_prompts(tmp_path / "in.jsonl", n)
    spec = resolve({"backend": "sim", "concurrency": 4, "max_attempts": 3, **options})
    jobs.create_job(ledger, "j", tmp_path / "in.jsonl", spec)
    fake = fake or FakeTime()
    settings = RunnerSettings(sleep=fake.sleep, clock=fake.clock, drain_timeout=0.0)
    stats = await jobs.run_job(
        ledger,
        home,
        "j",
        spec,
        transport=transport or SimTransport(SimModel()),
        settings=settings,
        handle_signals=False,
    )
    return ledger, stats, prompts


def report(counts: dict[str, int], stats: RunStats | None = None) -> JobReport:
    """What the API would hand the CLI after this run (for its exit code and summary)."""
    return JobReport("j", counts, False, None, stats=stats or RunStats())


def rows(ledger: Ledger, job: str = "j") -> list[dict[str, Any]]:
    """The job's item rows as stored: every column, JSON columns as their text."""
    query = text("SELECT * FROM items WHERE job = :job ORDER BY line")
    with ledger.engine.begin() as conn:
        return [dict(row) for row in conn.execute(query, {"job": job}).mappings()]


@pytest.mark.anyio
async def test_every_item_done_once_with_its_own_output(tmp_path: Path) -> None:
    ledger, stats, prompts = await run(tmp_path, 60)
    result = rows(ledger)
    assert [r["status"] for r in result] == ["done"] * 60
    for r, prompt in zip(result, prompts, strict=True):
        assert r["output"].startswith(prompt_tag(prompt))
        assert r["attempts"] == 1 and r["completion_tokens"] > 0 and r["ttft_ms"] is not None
    assert stats.requests == 60 and stats.recorded == 60 and stats.retries == 0


@pytest.mark.anyio
async def test_transient_errors_are_retried_until_done(tmp_path: Path) -> None:
    def flaky(_request: httpx.Request, call: int) -> httpx.Response | None:
        return httpx.Response(503, json={"error": {"message": "busy"}}) if call < 3 else None

    fake = FakeTime()
    ledger, stats, _ = await run(tmp_path, 10, ScriptedTransport(flaky), fake)
    assert [r["status"] for r in rows(ledger)] == ["done"] * 10
    assert [r["attempts"] for r in rows(ledger)] == [3] * 10
    assert stats.retries == 20 and len(fake.sleeps) == 20


@pytest.mark.anyio
async def test_retry_after_is_honoured(tmp_path: Path) -> None:
    def limited(_request: httpx.Request, call: int) -> httpx.Response | None:
        return httpx.Response(429, headers={"retry-after": "7"}) if call == 1 else None

    fake = FakeTime()
    ledger, _stats, _ = await run(tmp_path, 3, ScriptedTransport(limited), fake)
    assert fake.sleeps == [7.0, 7.0, 7.0]
    assert all(r["status"] == "done" for r in rows(ledger))


@pytest.mark.anyio
async def test_exhausted_attempts_fail_the_item_and_the_job_goes_on(tmp_path: Path) -> None:
    def one_broken(request: httpx.Request, _call: int) -> httpx.Response | None:
        if b"prompt number 2" in request.content:
            return httpx.Response(500, json={"error": {"message": "kaput"}})
        return None

    ledger, _stats, _ = await run(tmp_path, 5, ScriptedTransport(one_broken))
    result = rows(ledger)
    assert [r["status"] for r in result] == ["done", "done", "failed", "done", "done"]
    assert result[2]["attempts"] == 3 and "HTTP 500: kaput" in result[2]["error"]


@pytest.mark.anyio
async def test_bad_request_fails_at_once_with_the_servers_message(tmp_path: Path) -> None:
    def too_long(request: httpx.Request, _call: int) -> httpx.Response | None:
        if b"prompt number 1" in request.content:
            return httpx.Response(400, json={"error": {"message": "prompt exceeds context"}})
        return None

    ledger, _stats, _ = await run(tmp_path, 3, ScriptedTransport(too_long))
    failed = rows(ledger)[1]
    assert failed["status"] == "failed" and failed["attempts"] == 1
    assert "prompt exceeds context" in failed["error"]


@pytest.mark.anyio
async def test_auth_failure_aborts_and_leaves_items_pending(tmp_path: Path) -> None:
    def denied(_request: httpx.Request, _call: int) -> httpx.Response:
        return httpx.Response(401, json={"error": {"message": "bad key"}})

    ledger, stats, _ = await run(tmp_path, 20, ScriptedTransport(denied))
    assert stats.aborted is not None and "401" in stats.aborted
    counts = ledger.counts("j")
    assert counts["pending"] == 20 and counts["failed"] == 0 and counts["running"] == 0
    assert exit_code(report(counts, stats)) == EXIT_ABORTED


@pytest.mark.anyio
async def test_unreachable_endpoint_stops_after_grace_without_burning_items(
    tmp_path: Path,
) -> None:
    def down(_request: httpx.Request, _call: int) -> httpx.Response:
        raise httpx.ConnectError("connection refused")

    # Four workers fail at once: the watch sees several items failing, so none is burned.
    ledger, stats, _ = await run(
        tmp_path, 12, ScriptedTransport(down), outage_timeout=30.0, max_attempts=4
    )
    assert stats.aborted is not None and "unreachable" in stats.aborted
    counts = ledger.counts("j")
    assert counts["pending"] == 12 and counts["failed"] == 0


@pytest.mark.anyio
async def test_schema_marks_non_json_output_invalid(tmp_path: Path) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "required": ["name"]}))
    ledger, _stats, _ = await run(tmp_path, 3, schema=str(schema), guided=False)
    result = rows(ledger)
    assert [r["status"] for r in result] == ["invalid"] * 3
    assert all("no JSON" in r["error"] for r in result)
    assert exit_code(report(ledger.counts("j"))) == EXIT_SOME_FAILED


@pytest.mark.anyio
async def test_stop_request_commits_finished_work_and_releases_the_rest(tmp_path: Path) -> None:
    home = Home.at(tmp_path, None)
    ledger = Ledger(home.ledger_url)
    write_prompts(tmp_path / "in.jsonl", 40)
    spec = resolve({"backend": "sim", "concurrency": 2})
    jobs.create_job(ledger, "j", tmp_path / "in.jsonl", spec)
    release = anyio.Event()
    runner_box: list[Any] = []

    def gate(_request: httpx.Request, call: int) -> httpx.Response | None:
        return None

    class Gated(ScriptedTransport):
        entered = 0

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            if request.method == "POST":
                Gated.entered += 1
            if Gated.entered > 5:
                runner_box[0].request_stop()
                await release.wait()  # hangs until the drain timeout cancels it
            return await super().handle_async_request(request)

    backend = OpenAICompatBackend(spec.base_url, transport=Gated(gate))
    log = JobLog(home.log_path("j"), "j")
    spec = dataclasses.replace(spec, model="sim-1")
    runner = Runner(
        ledger,
        [Route("sim", spec, backend)],
        "j",
        spec,
        log=log,
        settings=RunnerSettings(drain_timeout=0.0),
    )
    runner_box.append(runner)
    stats = await runner.run()
    log.close()
    await backend.aclose()
    counts = ledger.counts("j")
    assert stats.interrupted
    assert counts["done"] == 5 and counts["running"] == 0 and counts["pending"] == 35
    assert exit_code(report(counts, stats)) == EXIT_INTERRUPTED


@pytest.mark.anyio
async def test_a_stop_sends_nothing_that_waited_for_a_slot_or_a_retry(tmp_path: Path) -> None:
    # Before: a worker waiting for the one slot sent its item once the request in flight at
    # the stop had ended, and the item answered 503 was sent again after its Retry-After.
    home = Home.at(tmp_path, None)
    ledger = Ledger(home.ledger_url)
    write_prompts(tmp_path / "in.jsonl", 40)
    spec = dataclasses.replace(resolve({"backend": "sim", "concurrency": 1}), model="sim-1")
    jobs.create_job(ledger, "j", tmp_path / "in.jsonl", spec)
    runner_box: list[Runner] = []

    def stop_then_busy(_request: httpx.Request, _call: int) -> httpx.Response:
        runner_box[0].request_stop()
        return httpx.Response(503, headers={"retry-after": "5"}, json={"error": "busy"})

    class Slow(ScriptedTransport):  # meanwhile the other workers wait for the slot
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            await anyio.sleep(0.1)
            return await super().handle_async_request(request)

    transport = Slow(stop_then_busy)
    backend = OpenAICompatBackend(spec.base_url, transport=transport)
    log = JobLog(home.log_path("j"), "j")
    settings = RunnerSettings(drain_timeout=30.0)
    runner = Runner(ledger, [Route("sim", spec, backend)], "j", spec, log=log, settings=settings)
    runner_box.append(runner)
    stats = await runner.run()
    log.close()
    await backend.aclose()
    assert stats.interrupted
    assert sum(transport.calls.values()) == 1  # the request in flight at the stop, alone
    assert ledger.counts("j")["pending"] == 40  # nothing failed, nothing lost


@pytest.mark.anyio
async def test_one_poison_item_behind_a_504_fails_and_the_rest_complete(tmp_path: Path) -> None:
    def poison(request: httpx.Request, _call: int) -> httpx.Response | None:
        if b"prompt number 3" in request.content:
            return httpx.Response(504, text="upstream timed out")
        return None

    ledger, stats, _ = await run(tmp_path, 8, ScriptedTransport(poison))
    statuses = [r["status"] for r in rows(ledger)]
    assert statuses == ["done"] * 3 + ["failed"] + ["done"] * 4
    assert stats.aborted is None
    assert exit_code(report(ledger.counts("j"), stats)) == EXIT_SOME_FAILED


class LostAnswers(Ledger):
    """A database restart at the worst moments: the first claim and the first commit reach
    the database, and their answers are lost with the connection."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.losing = {"claim", "record"}

    def _lose(self, call: str) -> None:
        if call in self.losing:
            self.losing.discard(call)
            raise LedgerError(f"ledger error while {call}: server closed", out_of_reach=True)

    def claim(self, *args: Any, **kwargs: Any) -> list[ClaimedItem]:
        claimed = super().claim(*args, **kwargs)
        self._lose("claim")
        return claimed

    def record(self, *args: Any, **kwargs: Any) -> Recorded:
        changed = super().record(*args, **kwargs)
        self._lose("record")
        return changed


@pytest.mark.anyio
async def test_claims_and_commits_whose_answers_were_lost_are_neither_lost_nor_doubled(
    tmp_path: Path,
) -> None:
    ledger, _stats, prompts = await run(tmp_path, 60, ledger_type=LostAnswers)
    result = rows(ledger)
    assert [r["status"] for r in result] == ["done"] * 60  # the unseen claim was put back
    assert all(r["attempts"] == 1 and r["owner"] is None for r in result)
    for r, prompt in zip(result, prompts, strict=True):
        assert r["output"].startswith(prompt_tag(prompt))
    said = [json.loads(line) for line in (tmp_path / "logs" / "j.log").read_text().splitlines()]
    strays = [e for e in said if e["event"] == "strays_put_back"]
    assert len(strays) == 1 and strays[0]["items"] > 0
    assert [e["event"] for e in said].count("ledger_back") == 2


class Gate(httpx.AsyncBaseTransport):
    """Holds every request until `open` is set; then the simulator answers."""

    def __init__(self) -> None:
        self.open = anyio.Event()
        self.sim = SimTransport(SimModel())
        self.held = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            self.held += 1
            await self.open.wait()
        return await self.sim.handle_async_request(request)


@pytest.mark.anyio
async def test_a_worker_leases_a_few_limits_of_items_not_its_whole_reach(tmp_path: Path) -> None:
    """--concurrency auto may reach 256, but a worker sending 2 requests leases a few dozen
    items, not hundreds: what it cannot send soon stays claimable by other workers."""
    gate = Gate()
    async with anyio.create_task_group() as tg:
        # (no /metrics watch: under the fake clock its polling would never rest)
        job = partial(run, tmp_path, 500, gate, concurrency="auto", server_metrics="off")
        tg.start_soon(job)
        with anyio.fail_after(10):
            while gate.held < 2:
                await anyio.sleep(0.01)
        await anyio.sleep(0.2)  # the feeder claims what it wants meanwhile
        watcher = Ledger(Home.at(tmp_path, None).ledger_url)
        held = watcher.counts("j").get("running", 0)
        gate.open.set()
    assert 2 <= held <= 32, held
    assert watcher.counts("j").get("done") == 500
    watcher.close()


def test_log_times_are_utc_to_the_millisecond_and_follow_the_clock() -> None:
    before = datetime.now(UTC)
    stamp = progress._now_iso()
    after = datetime.now(UTC)
    parsed = datetime.fromisoformat(stamp)
    assert stamp.endswith("+00:00") and len(stamp.split(".")[1]) == len("123+00:00")
    assert before.replace(microsecond=before.microsecond // 1000 * 1000) <= parsed <= after


class GoneLedger(Ledger):
    """A PostgreSQL server that goes away when told to: its records fail, counted."""

    gone = False
    tries = 0

    def record(self, *args: Any, **kwargs: Any) -> Any:
        if self.gone:
            self.tries += 1
            raise LedgerError("server closed the connection", out_of_reach=True)
        return super().record(*args, **kwargs)


async def cancelled_in_an_outage(
    tmp_path: Path, *, commit_interval: float, failed_first: int
) -> tuple[GoneLedger, FakeTime, float, int]:
    """A job run until 10 answers came; then the ledger goes away and, once `failed_first`
    records have failed, the caller cancels the run (a notebook's stop). The ledger, the
    runner's clock, and that clock and the failed records at the cancel."""
    home = Home.at(tmp_path, None)
    ledger = GoneLedger(home.ledger_url)
    write_prompts(tmp_path / "in.jsonl", 200)
    spec = resolve({"backend": "sim", "concurrency": 2, "outage_timeout": 3600.0})
    jobs.create_job(ledger, "j", tmp_path / "in.jsonl", spec)
    fake = FakeTime()
    settings = RunnerSettings(sleep=fake.sleep, clock=fake.clock, commit_interval=commit_interval)
    sim = SimTransport(SimModel())
    answered, at_cancel = 0, []

    async def counted(request: httpx.Request) -> httpx.Response:
        nonlocal answered
        response = await sim.handle_async_request(request)
        answered += request.method == "POST"
        return response

    async def stop_in_the_outage(scope: anyio.CancelScope) -> None:
        while answered < 10:
            await anyio.sleep(0.001)
        ledger.gone = True
        while ledger.tries < failed_first:
            await anyio.sleep(0.001)
        at_cancel.append((fake.now, ledger.tries))
        scope.cancel()

    transport = httpx.MockTransport(counted)
    async with anyio.create_task_group() as tg:
        tg.start_soon(stop_in_the_outage, tg.cancel_scope)
        await jobs.run_job(
            ledger, home, "j", spec, transport=transport, settings=settings, handle_signals=False
        )
        raise AssertionError("not cancelled")
    ((now, tries),) = at_cancel
    return ledger, fake, now, tries


@pytest.mark.parametrize(
    ("commit_interval", "failed_first"),
    [(1e6, 0), (0.0, 2)],
    ids=["between commits", "during a commit"],
)
@pytest.mark.anyio
async def test_a_cancel_while_the_ledger_is_out_of_reach_is_not_held_for_the_outage_grace(
    tmp_path: Path, commit_interval: float, failed_first: int
) -> None:
    # the cancel tries its commit once, and stops a commit that was waiting the outage out
    # (the usual case, with a commit every moment): the answers are sent again at resume, not
    # held for --outage-timeout (an hour here); nor does a claim that was in its thread at the
    # cancel raise BrokenResourceError out of the run (hostile reviews of 4 December)
    ledger, fake, now, tries = await cancelled_in_an_outage(
        tmp_path, commit_interval=commit_interval, failed_first=failed_first
    )
    assert fake.now - now < 60.0  # the clock the runner waits by
    assert ledger.tries - tries <= 2  # one more try, not an hour of them


@pytest.mark.anyio
async def test_a_worker_takes_its_turn_of_a_shared_rpm_before_its_first_request(
    tmp_path: Path,
) -> None:
    # Another worker started on the job first: this one has the second turn of --rpm 6 shared
    # by two (3 a minute each), so its first request waits 20 s (fake time), where both waited
    # 10 s and sent at one moment. (The heartbeat takes the part before the first claim: the
    # ledger's calls go through one thread, in turn.)
    home = Home.at(tmp_path, None)
    ledger = Ledger(home.ledger_url)
    write_prompts(tmp_path / "in.jsonl", 1)
    spec = resolve({"backend": "sim", "model": "sim-1", "rpm": 6, "server_metrics": "off"})
    jobs.create_job(ledger, "j", tmp_path / "in.jsonl", spec)
    ledger.join("j", "started-first", ttl=600, spec=reuse.joined(spec), same=reuse.SAME)
    fake, sent = FakeTime(), []
    sim = SimTransport(SimModel())

    async def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/completions"):
            sent.append(fake.now)
        return await sim.handle_async_request(request)

    settings = RunnerSettings(sleep=fake.sleep, clock=fake.clock, drain_timeout=0.0)
    transport = httpx.MockTransport(handle)
    await jobs.run_job(
        ledger, home, "j", spec, transport=transport, settings=settings, handle_signals=False
    )
    assert ledger.counts("j")["done"] == 1
    assert len(sent) == 1 and sent[0] - 1000.0 == pytest.approx(20.0, abs=0.5), sent
