"""The throttle: one owner of the slots, fed by each request; and the runner wired to it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from batchrun import jobs
from batchrun.backends.build import metrics_reader
from batchrun.config import resolve
from batchrun.controller import Change, ConcurrencyController
from batchrun.errors import (
    AuthFailed,
    ConnectionFailed,
    Overloaded,
    RateLimited,
    RequestTimeout,
    StreamCut,
)
from batchrun.jobs import Home
from batchrun.ledger import Ledger
from batchrun.limiter import Pacer
from batchrun.run_state import RunnerSettings
from batchrun.server_metrics import ServerLoad
from batchrun.sim import SimConfig, SimModel, SimTransport
from batchrun.throttle import Throttle, failure_kind


async def hold(throttle: Throttle, release: anyio.Event, seen: list[Any], ttft: float) -> None:
    """One request: take a slot, note what it saw, say its first token came, wait."""
    async with throttle.slot(10) as slot:
        seen.append((slot.sent_in_flight, slot.sent_at_limit, throttle.in_flight))
        slot.first_token(ttft)
        await release.wait()


@pytest.mark.anyio
async def test_a_slot_counts_a_request_on_the_wire_and_frees_itself() -> None:
    throttle = Throttle(Pacer(), fixed=2, clock=lambda: 0.0)
    seen: list[Any] = []
    release = anyio.Event()
    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(hold, throttle, release, seen, 0.05)
        await anyio.wait_all_tasks_blocked()
        assert seen == [(1, 2, 1), (2, 2, 2)]  # the third waits for a slot
        release.set()
    assert len(seen) == 3 and throttle.in_flight == 0
    with pytest.raises(RuntimeError):
        async with throttle.slot(10):
            raise RuntimeError("a failed request still gives its slot back")
    assert throttle.in_flight == 0


@pytest.mark.anyio
async def test_streaming_counts_answers_begun_and_not_yet_ended() -> None:
    controller = ConcurrencyController(initial=4)
    throttle = Throttle(Pacer(), controller=controller, clock=lambda: 0.0, sleep=no_sleep)
    async with throttle.slot(10) as slot:
        assert throttle.streaming == 0  # sent, nothing back yet
        slot.first_token(0.01)
        slot.first_token(0.02)  # said twice: counted once
        assert throttle.streaming == 1
    assert throttle.streaming == 0
    with pytest.raises(RuntimeError):
        async with throttle.slot(10) as slot:
            slot.first_token(0.01)
            raise RuntimeError("cut mid-answer")
    assert throttle.streaming == 0 and throttle.in_flight == 0
    told: list[int] = []

    class Recording(ConcurrencyController):
        def server_load(
            self, now: float, load: ServerLoad, *, in_flight: int, streaming: int = 0
        ) -> Change | None:
            told.append(streaming)
            return super().server_load(now, load, in_flight=in_flight, streaming=streaming)

    watched = Throttle(Pacer(), controller=Recording(), clock=lambda: 0.0, sleep=no_sleep)
    loads = [ServerLoad(4, None, None, "llamacpp-slots", 4)]

    async def read() -> ServerLoad | None:
        if not loads:
            raise Stop
        return loads.pop()

    async with watched.slot(10) as slot:
        slot.first_token(0.01)
        with pytest.raises(Stop):
            await watched.watch_server(read)
    assert told == [1]  # what the balancer rule weighs


@pytest.mark.anyio
async def test_the_controllers_limit_is_the_slots_limit() -> None:
    ctl = ConcurrencyController(initial=2, maximum=64)
    changes: list[Any] = []
    throttle = Throttle(Pacer(), controller=ctl, clock=lambda: 1.0, on_change=changes.append)
    assert throttle.limit == 2
    seen: list[Any] = []
    release = anyio.Event()
    async with anyio.create_task_group() as tg:
        for _ in range(8):
            tg.start_soon(hold, throttle, release, seen, 0.05)
        await anyio.wait_all_tasks_blocked()
        # Each unqueued first token opened two more slots, until the eight were all sent.
        assert throttle.in_flight == 8 and throttle.limit == ctl.limit >= 8
        assert throttle.pacer.in_flight == throttle.limit
        release.set()
    assert changes and changes[0].reason == "ramp"


async def held(throttle: Throttle, accept: anyio.Event, sent: list[int]) -> None:
    """One request that the server takes (a success status) when `accept` is set."""
    async with throttle.slot(10) as slot:
        sent.append(slot.sent_in_flight)
        await accept.wait()
        slot.accepted()
        await anyio.sleep_forever()


@pytest.mark.anyio
async def test_slots_open_above_what_the_server_accepted_only_a_few_at_a_time() -> None:
    ctl = ConcurrencyController(initial=2, maximum=64)
    ctl.limit = 40  # a ramp got here on first tokens that came together
    throttle = Throttle(Pacer(), controller=ctl, clock=lambda: 1.0)
    accept = anyio.Event()
    sent: list[int] = []
    async with anyio.create_task_group() as tg:
        for _ in range(40):
            tg.start_soon(held, throttle, accept, sent)
        await anyio.wait_all_tasks_blocked()
        assert throttle.limit == 40 and throttle.in_flight == 2  # none accepted yet
        accept.set()  # each acceptance opens the next few slots, up to the limit
        await anyio.wait_all_tasks_blocked()
        assert throttle.in_flight == 40 and sorted(sent) == list(range(1, 41))
        tg.cancel_scope.cancel()


def test_failures_are_named_by_what_they_say_of_capacity() -> None:
    assert failure_kind(RateLimited("429")) == "refused"
    assert failure_kind(Overloaded("503", status=503)) == "refused"
    assert failure_kind(Overloaded("500", status=500)) == "error"
    assert failure_kind(RequestTimeout("slow")) == "timeout"
    assert failure_kind(StreamCut("cut")) == "cut"
    assert failure_kind(ConnectionFailed("reset")) == "reset"
    assert failure_kind(AuthFailed("401")) is None  # configuration, not capacity


async def run_sim(
    tmp_path: Path, n: int, config: SimConfig, **options: Any
) -> list[dict[str, Any]]:
    """A job over the in-process simulator in real (short) time; the job log's events."""
    home = Home.at(tmp_path, None)
    ledger = Ledger(home.ledger_url)
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p {i}"}) + "\n" for i in range(n)))
    spec = resolve({"backend": "sim", **options})
    jobs.create_job(ledger, "j", path, spec)
    stats = await jobs.run_job(
        ledger,
        home,
        "j",
        spec,
        transport=SimTransport(SimModel(config)),
        settings=RunnerSettings(drain_timeout=0.0),
        handle_signals=False,
    )
    assert stats.by_status == {"done": n}
    return [json.loads(line) for line in (tmp_path / "logs" / "j.log").read_text().splitlines()]


@pytest.mark.anyio
async def test_auto_follows_the_servers_own_queue_when_it_publishes_one(tmp_path: Path) -> None:
    config = SimConfig(slots=4, ttft_ms=5, tpot_ms=2, max_output_tokens=24)
    events = await run_sim(tmp_path, 300, config)
    moves = [e for e in events if e["event"] == "concurrency"]
    assert any(e["signal"] == "server metrics" for e in moves)
    ended = next(e for e in events if e["event"] == "run_stopped")
    assert 4 <= ended["limit"] <= 12  # four slots, a small queue at most


@pytest.mark.anyio
async def test_without_server_metrics_auto_says_so_and_reads_time_to_first_token(
    tmp_path: Path,
) -> None:
    config = SimConfig(slots=4, ttft_ms=5, tpot_ms=2, max_output_tokens=24, metrics=False)
    events = await run_sim(tmp_path, 300, config)
    assert {"event": "server_metrics", "available": False}.items() <= next(
        e for e in events if e["event"] == "server_metrics"
    ).items()
    moves = [e for e in events if e["event"] == "concurrency"]
    assert moves and all(e["signal"] != "server metrics" for e in moves)


class Stop(Exception):
    pass


async def no_sleep(_seconds: float) -> None:
    pass


@pytest.mark.anyio
async def test_a_server_that_stops_saying_hands_back_to_first_tokens_until_it_speaks() -> None:
    loads: list[ServerLoad | None] = [ServerLoad(4, 0), None, None, None, ServerLoad(4, 0)]
    controller = ConcurrencyController()
    throttle = Throttle(Pacer(), controller=controller, clock=lambda: 0.0, sleep=no_sleep)
    seen: list[bool] = []

    async def read() -> ServerLoad | None:
        seen.append(controller.metrics)
        if not loads:
            raise Stop
        return loads.pop(0)

    with pytest.raises(Stop):
        await throttle.watch_server(read)
    # metrics on after the first load; off after three reads without; on again with the next
    assert seen == [False, True, True, True, False, True]


@pytest.mark.anyio
async def test_server_metrics_off_is_not_read(tmp_path: Path) -> None:
    reads: list[str] = []

    class Counting(SimTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            reads.append(request.url.path)
            return await super().handle_async_request(request)

    config = SimConfig(slots=4, ttft_ms=1, tpot_ms=1, max_output_tokens=8)
    home = Home.at(tmp_path, None)
    ledger = Ledger(home.ledger_url)
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p {i}"}) + "\n" for i in range(20)))
    spec = resolve({"backend": "sim", "server_metrics": "off"})
    jobs.create_job(ledger, "j", path, spec)
    with anyio.fail_after(30):
        await jobs.run_job(
            ledger,
            home,
            "j",
            spec,
            transport=Counting(SimModel(config)),
            settings=RunnerSettings(drain_timeout=0.0),
            handle_signals=False,
        )
    assert "/metrics" not in reads and len(reads) >= 20


@pytest.mark.anyio
async def test_the_key_goes_to_a_metrics_url_only_on_the_endpoints_own_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SECRET_KEY_VAR", "sk-test-1234567890")
    base = {"base_url": "http://127.0.0.1:9/v1", "api_key_env": "SECRET_KEY_VAR"}
    own = metrics_reader(resolve(base))
    other = metrics_reader(
        resolve({**base, "server_metrics": "http://metrics.batchrun.invalid/metrics"})
    )
    assert own is not None and other is not None
    assert own.url == "http://127.0.0.1:9/metrics"
    assert own._client.headers["authorization"] == "Bearer sk-test-1234567890"
    assert "authorization" not in other._client.headers  # never to another host
    assert metrics_reader(resolve({**base, "server_metrics": "off"})) is None
    assert metrics_reader(resolve({**base, "concurrency": 8})) is None  # fixed: not read
    await own.aclose()
    await other.aclose()
