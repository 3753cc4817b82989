"""`--mode batch` against providers that answer oddly, and runs that overlap: found by a hostile
review, each test failed before its fix. Nothing may be paid for twice, nothing lost, and an
answer batchrun cannot read stops the job saying so (never a traceback, never a poll forever)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from batchrun import batch_mode, hosted, jobs
from batchrun.config import resolve
from batchrun.errors import AuthFailed, FatalError
from batchrun.jobs import Home
from batchrun.ledger import Ledger, chunks
from batchrun.run_state import RunStats
from batchrun.sim import SimModel, SimTransport
from tests.unit.test_hosted import Killed, _kill, load, sim

# (method, path, n, the simulator's answer) -> an answer to give instead, or None
Rewrite = Callable[[str, str, int, httpx.Response], httpx.Response | None]


class Rewritten(SimTransport):
    """The simulator, some of whose answers are rewritten (n counts calls to a method+path)."""

    def __init__(self, model: SimModel, rewrite: Rewrite, *, upload_s: float = 0.0) -> None:
        super().__init__(model)
        self.rewrite, self.upload_s = rewrite, upload_s
        self.seen: dict[tuple[str, str], int] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        key = (request.method, request.url.path)
        self.seen[key] = self.seen.get(key, 0) + 1
        if key == ("POST", "/v1/files"):
            await anyio.sleep(self.upload_s)
        response = await super().handle_async_request(request)
        await response.aread()
        return self.rewrite(*key, self.seen[key], response) or response


def same(*_: Any) -> None:
    return None


async def run(ledger: Ledger, home: Home, spec: Any, transport: Any) -> RunStats:
    with anyio.fail_after(30):
        return await jobs.run_job(
            ledger, home, "j", spec, transport=transport, handle_signals=False
        )


def polled(method: str, path: str) -> bool:
    return method == "GET" and path.startswith("/v1/batches/")


@pytest.mark.anyio
async def test_a_batch_answer_awaiting_a_repair_is_not_batched_and_paid_again(
    tmp_path: Path,
) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    ledger, home, spec = load(tmp_path, 5, schema=str(tmp_path / "schema.json"), guided=False)
    model = sim(json_schema=schema, json_styles={"broken": 1.0})
    for _night in range(3):
        stats = await run(ledger, home, spec, SimTransport(model))
    assert model.requests == 5 and model.batches.created == 1  # not asked again each night
    assert ledger.counts("j")["pending"] == 5 and stats.followups == 5  # said, for online
    online = await run(ledger, home, replace(spec, mode="online"), SimTransport(model))
    assert online.aborted is None and model.requests == 10  # then one repair each, online
    assert all(item.repairs == 1 for item in ledger.iter_results("j"))


def _wrapped(method: str, path: str, n: int, r: httpx.Response) -> httpx.Response | None:
    """A provider whose batches come wrapped (`{"job": ...}`), and whose list holds none."""
    if path != "/v1/batches":
        return None
    return httpx.Response(200, json={"job": r.json()} if method == "POST" else {"data": []})


REWRITES: dict[str, tuple[Rewrite, str]] = {  # a provider's odd answer, where its lines stay
    "an upload that is not JSON": (
        lambda m, p, n, r: httpx.Response(200, text="<html>") if p == "/v1/files" else None,
        "pending",
    ),
    "a 200 with an error while polling": (
        lambda m, p, n, r: httpx.Response(200, json={"error": "x"}) if polled(m, p) else None,
        "batched",
    ),
    "a list while polling": (
        lambda m, p, n, r: httpx.Response(200, json=[r.json()]) if polled(m, p) else None,
        "batched",
    ),
    "a status batchrun does not know": (
        lambda m, p, n, r: (
            httpx.Response(200, json={**r.json(), "status": "paused"}) if polled(m, p) else None
        ),
        "batched",
    ),
    "a failed batch whose errors are a list": (
        lambda m, p, n, r: (
            httpx.Response(200, json={**r.json(), "status": "failed", "errors": ["x"]})
            if polled(m, p)
            else None
        ),
        "pending",
    ),
}


@pytest.mark.parametrize("case", sorted(REWRITES))
@pytest.mark.anyio
async def test_an_answer_not_in_openais_shape_stops_the_job_saying_so(
    tmp_path: Path, case: str
) -> None:
    rewrite, where = REWRITES[case]
    ledger, home, spec = load(tmp_path, 6)
    stats = await run(ledger, home, spec, Rewritten(sim(), rewrite))
    assert stats.aborted is not None and ledger.counts("j")[where] == 6


@pytest.mark.anyio
async def test_an_upper_case_status_is_read_as_openais(tmp_path: Path) -> None:
    def upper(m: str, p: str, n: int, r: httpx.Response) -> httpx.Response | None:
        return (
            httpx.Response(200, json={**r.json(), "status": r.json()["status"].upper()})
            if polled(m, p)
            else None
        )

    ledger, home, spec = load(tmp_path, 6)
    stats = await run(ledger, home, spec, Rewritten(sim(), upper))
    assert stats.aborted is None and ledger.counts("j")["done"] == 6


@pytest.mark.anyio
async def test_a_create_answer_it_cannot_read_is_never_created_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(chunks, "_alive", lambda _owner: False)  # each run a process of its own
    ledger, home, spec = load(tmp_path, 6)
    model = sim()
    for _run in range(2):  # the batch may exist, paid for: a second run makes no other
        stats = await run(ledger, home, spec, Rewritten(model, _wrapped))
        assert stats.aborted is not None and ledger.counts("j")["batched"] == 6
    assert model.batches.created == 1 and "may have made a batch" in stats.aborted
    online = await run(ledger, home, replace(spec, mode="online"), Rewritten(model, _wrapped))
    assert online.aborted is None and ledger.counts("j")["done"] == 6


@pytest.mark.anyio
async def test_a_404_while_polling_keeps_the_lines_until_the_user_says_the_batch_is_gone(
    tmp_path: Path,
) -> None:
    def gone(m: str, p: str, n: int, r: httpx.Response) -> httpx.Response | None:
        lost = polled(m, p) or p.endswith("/cancel")
        return httpx.Response(404, json={"error": {"message": "no such batch"}}) if lost else None

    ledger, home, spec = load(tmp_path, 6, then="online")
    model = sim(batch_seconds=5.0)
    stats = await run(ledger, home, spec, Rewritten(model, gone))
    assert stats.aborted is not None and "not found" in stats.aborted
    assert ledger.counts("j")["batched"] == 6 and model.requests == 0  # not sent a second time
    (chunk,) = ledger.chunks.listed("j")
    with pytest.raises(FatalError, match="--forget"):  # a wrong key says 404 too
        await batch_mode.cancel_batches(ledger, "j", spec, transport=Rewritten(model, gone))
    assert ledger.counts("j")["batched"] == 6
    cancelled = await batch_mode.cancel_batches(
        ledger, "j", spec, forget=True, transport=Rewritten(model, gone)
    )
    assert cancelled == [chunk.batch_id] and ledger.counts("j")["pending"] == 6


@pytest.mark.anyio
async def test_cancel_says_when_the_provider_refuses(tmp_path: Path) -> None:
    ledger, home, spec = load(tmp_path, 4)
    model = sim(batch_seconds=60.0)
    with anyio.move_on_after(0.5):  # stopped while polling: the batch runs on
        await run(ledger, home, spec, SimTransport(model))

    def refuse(status: int) -> Rewrite:
        def rewrite(m: str, p: str, n: int, r: httpx.Response) -> httpx.Response | None:
            refused = p.endswith("/cancel") and n == 1
            return httpx.Response(status, json={"error": {"message": "no"}}) if refused else None

        return rewrite

    with pytest.raises(AuthFailed):
        await batch_mode.cancel_batches(ledger, "j", spec, transport=Rewritten(model, refuse(401)))
    cancelled = await batch_mode.cancel_batches(
        ledger, "j", spec, transport=Rewritten(model, refuse(503))
    )
    assert len(cancelled) == 1  # the 503 waited out, then cancelled
    assert [b.status for b in model.batches.batches.values()] in (["cancelling"], ["cancelled"])


@pytest.mark.anyio
async def test_lines_of_two_endpoint_kinds_make_two_batches(tmp_path: Path) -> None:
    rows = [
        {
            "custom_id": f"c{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": f"hi {i}"}]},
        }
        if i % 2
        else {
            "custom_id": f"p{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": f"hi {i}"},
        }
        for i in range(20)
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    home = Home.at(tmp_path, None)
    ledger = Ledger(home.ledger_url)
    spec = resolve({"backend": "sim", "mode": "batch", "poll_interval": 0.02, "model": "sim-1"})
    jobs.create_job(ledger, "j", tmp_path / "in.jsonl", spec)
    stats = await run(ledger, home, spec, SimTransport(sim()))
    assert stats.batches == 2 and ledger.counts("j")["done"] == 20


@pytest.mark.anyio
async def test_a_line_answered_twice_in_the_output_keeps_its_first_answer(tmp_path: Path) -> None:
    (tmp_path / "in.jsonl").write_text(
        "".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate("aab"))
    )
    home = Home.at(tmp_path, None)
    ledger = Ledger(home.ledger_url)
    spec = resolve({"backend": "sim", "mode": "batch", "poll_interval": 0.02, "model": "sim-1"})
    jobs.create_job(ledger, "j", tmp_path / "in.jsonl", spec)

    def twice(m: str, p: str, n: int, r: httpx.Response) -> httpx.Response | None:
        records = [json.loads(x) for x in r.content.splitlines()]
        if not p.endswith("/content") or not records or not records[0].get("response"):
            return None
        again = json.loads(json.dumps(records[0]))
        again["response"]["body"]["choices"][0]["message"]["content"] = "ANOTHER"
        return httpx.Response(200, text="".join(json.dumps(x) + "\n" for x in [*records, again]))

    await run(ledger, home, spec, Rewritten(sim(), twice))
    outputs = [item.output for item in ledger.iter_results("j")]
    assert outputs[0] == outputs[1] != "ANOTHER"  # a line and its repeat: one answer


@pytest.mark.anyio
async def test_an_online_resume_makes_no_batch_of_a_chunk_killed_before_its_create(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger, home, spec = load(tmp_path, 6)
    model = sim()
    with monkeypatch.context() as patch:
        patch.setattr(hosted, "_crash_point", lambda name: _kill(name, "uploaded"))
        with pytest.raises(Killed):
            await run(ledger, home, spec, SimTransport(model))
    monkeypatch.setattr(chunks, "_alive", lambda _owner: False)
    stats = await run(ledger, home, replace(spec, mode="online"), SimTransport(model))
    assert stats.aborted is None and model.batches.created == 0
    assert ledger.counts("j")["done"] == 6


@pytest.mark.anyio
async def test_a_run_whose_lease_ran_out_while_uploading_makes_no_second_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hosted, "LEASE_S", 0.5)  # stands for 15 minutes
    ledger, home, spec = load(tmp_path, 6)
    model = sim(batch_seconds=0.2)

    async def later() -> None:
        await anyio.sleep(1.0)  # the first run's lease is over, its upload not
        await run(ledger, home, spec, SimTransport(model))

    async with anyio.create_task_group() as tg:
        tg.start_soon(later)
        await run(ledger, home, spec, Rewritten(model, same, upload_s=2.0))
    assert model.batches.created == 1 and ledger.counts("j")["done"] == 6


class Noticed(httpx.AsyncBaseTransport):
    """Another transport, calling `notice()` as a POST to `path` goes out to it."""

    def __init__(self, inner: httpx.AsyncBaseTransport, path: str, notice: Any) -> None:
        self.inner, self.path, self.notice = inner, path, notice

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if (request.method, request.url.path) == ("POST", self.path):
            self.notice()
        return await self.inner.handle_async_request(request)


@pytest.mark.anyio
async def test_a_chunk_a_live_run_is_submitting_is_left_to_it(tmp_path: Path) -> None:
    ledger, home, spec = load(tmp_path, 12)
    model = sim()
    uploading = anyio.Event()
    created_then: list[int] = []

    async def second() -> None:
        await uploading.wait()  # the first run uploads, its lease good
        await run(ledger, home, spec, SimTransport(model))
        created_then.append(model.batches.created)
        (chunk,) = ledger.chunks.listed("j")
        assert chunk.batch_id is None  # left alone, not created a second time

    slow = Rewritten(model, same, upload_s=3.0)
    async with anyio.create_task_group() as tg:
        tg.start_soon(second)
        await run(ledger, home, spec, Noticed(slow, "/v1/files", uploading.set))
    assert created_then == [0] and model.batches.created == 1
    assert ledger.counts("j")["done"] == 12


@pytest.mark.anyio
async def test_a_run_stopped_mid_upload_in_a_live_process_leaves_its_chunk_to_the_next(
    tmp_path: Path, ledger_url: str
) -> None:
    """A notebook's stopped cell: the run is cancelled while it uploads, its process lives on
    (so the chunk's holder looks alive), and the next run there must not wait out the lease."""
    ledger, home, spec = load(tmp_path, 6, ledger_url)
    model = sim(batch_seconds=0.2)
    with anyio.CancelScope() as cell:  # stopped as the upload (of 30 s) goes out
        slow = Rewritten(model, same, upload_s=30.0)
        await run(ledger, home, spec, Noticed(slow, "/v1/files", cell.cancel))
    assert ledger.counts("j")["batched"] == 6 and model.batches.created == 0
    stats = await run(ledger, home, spec, SimTransport(model))
    assert stats.aborted is None and model.batches.created == 1
    assert ledger.counts("j")["done"] == 6


class CommittedLater(SimTransport):
    """A provider that makes a batch 1 s after its create arrives, whether or not the client
    is still waiting for the answer (a client that goes away does not undo it); `arrived()`
    is called once the create is in its hands."""

    def __init__(self, model: SimModel, server: anyio.abc.TaskGroup, arrived: Any) -> None:
        super().__init__(model)
        self.server, self.arrived = server, arrived

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if (request.method, request.url.path) != ("POST", "/v1/batches"):
            return await super().handle_async_request(request)
        await request.aread()
        answered, made = anyio.Event(), []

        async def make() -> None:
            await anyio.sleep(1.0)
            made.append(await super(CommittedLater, self).handle_async_request(request))
            answered.set()

        self.server.start_soon(make)
        self.arrived()
        await answered.wait()
        return made[0]


@pytest.mark.anyio
async def test_a_run_stopped_while_its_create_is_on_the_way_keeps_its_lease(
    tmp_path: Path, ledger_url: str
) -> None:
    """Stopped after the create went out, a run cannot know whether the batch was made: the
    chunk stays leased to it (found by a review: letting it go made a second batch)."""
    ledger, home, spec = load(tmp_path, 6, ledger_url)
    model = sim(batch_seconds=0.2)
    async with anyio.create_task_group() as server:
        with anyio.CancelScope() as cell:  # stopped while the provider makes the batch
            await run(ledger, home, spec, CommittedLater(model, server, cell.cancel))
        await run(ledger, home, spec, SimTransport(model))  # run again at once
    assert model.batches.created == 1
    assert ledger.counts("j")["batched"] == 6  # left to the lease: the next run adopts it


@pytest.mark.parametrize("ledger_url", ["postgresql"], indirect=True)
def test_two_processes_taking_one_chunk_at_once_only_one_gets_it(
    tmp_path: Path, ledger_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between one run's read of a chunk's holder and its write, another process takes it:
    the first must not take it too (found by a review; PostgreSQL reads do not lock)."""
    ledger, _home, _spec = load(tmp_path, 4, ledger_url)
    lines = [item.line for item in ledger.chunks.pending("j", 10)]
    number, _ = ledger.chunks.start("j", lines, owner="gone", lease=900.0)
    other = Ledger(ledger_url).chunks  # another process's connections
    took: list[bool] = []

    def alive(_owner: str) -> bool:  # asked between the read and the write
        if not took:
            took.append(False)
            took[0] = other.take("j", number, owner="b", lease=900.0)
        return False  # the holder that was read is gone

    monkeypatch.setattr(chunks, "_alive", alive)
    assert not ledger.chunks.take("j", number, owner="a", lease=900.0)
    assert took == [True]


@pytest.mark.anyio
async def test_a_run_whose_lease_ran_out_never_reopens_a_chunk_another_run_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hosted, "LEASE_S", 0.5)  # stands for 15 minutes
    monkeypatch.setattr(chunks, "_alive", lambda _owner: False)  # the online run has ended
    ledger, home, spec = load(tmp_path, 6)
    model = sim(batch_seconds=0.2)

    async def online() -> None:
        await anyio.sleep(1.0)  # the uploading run's lease is over: it gives the lines back
        await run(ledger, home, replace(spec, mode="online"), SimTransport(model))

    async with anyio.create_task_group() as tg:
        tg.start_soon(online)
        await run(ledger, home, spec, Rewritten(model, same, upload_s=2.0))
    # each line answered once: online, or in a new batch of what online had not claimed yet
    assert model.requests == 6 and ledger.counts("j")["done"] == 6
    first = ledger.chunks.listed("j")[0]
    assert first.lines == 6 and first.batch_id is None  # the old chunk stays closed


@pytest.mark.parametrize("listed", ["not JSON", "404", "down"])
@pytest.mark.anyio
async def test_a_failed_look_after_an_uncertain_create_keeps_the_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, listed: str
) -> None:
    runs: list[int] = []

    def uncertain(m: str, p: str, n: int, r: httpx.Response) -> httpx.Response | None:
        if (m, p) == ("POST", "/v1/batches") and n == 1:  # made, but answered 502
            return httpx.Response(502, json={"error": {"message": "bad gateway"}})
        if (m, p) == ("GET", "/v1/batches"):
            if listed == "down" and len(runs) > 1:  # listed later, not yet (eventual)
                return httpx.Response(200, json={"data": [], "has_more": False})
            if listed == "down":  # past --outage-timeout
                return httpx.Response(503, json={"error": {"message": "down"}})
            if listed == "404":
                return httpx.Response(404, json={"error": {"message": "no"}})
            return httpx.Response(200, text="<html>")
        return None

    monkeypatch.setattr(chunks, "_alive", lambda _owner: False)  # each run a process of its own
    ledger, home, spec = load(tmp_path, 6, outage_timeout=0.5)
    model = sim()
    for run_number in (1, 2):
        runs.append(run_number)
        stats = await run(ledger, home, spec, Rewritten(model, uncertain))
        assert stats.aborted is not None and ledger.counts("j")["batched"] == 6
    assert model.batches.created == 1  # never a second one for the same lines
