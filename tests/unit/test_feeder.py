"""What a worker leases: four limits of items, or a quarter second of its answers when that is
more, so that its workers never wait while a claim goes through the ledger's thread."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

import anyio
import pytest

from batchrun.feeder import BACKLOG_S, MOST_LIMITS, Feeder
from batchrun.ledger import ClaimedItem, Ledger
from batchrun.ledger_calls import LedgerCalls
from batchrun.progress import JobLog
from batchrun.run_state import RunnerSettings
from tests.fakes import FakeTime
from tests.unit.test_ledger import make_job

pytestmark = pytest.mark.anyio
T = TypeVar("T")


class InLoop:
    """Ledger calls made in the event loop's own thread: a claim is over before the feeder
    yields, so what it holds is known after every answer."""

    outages = 0

    async def __call__(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return fn(*args, **kwargs)


async def held_while_answering(
    tmp_path: Path, *, limit: int, every_s: float, answers: int
) -> list[int]:
    """Answer `answers` items one every `every_s` (a fake clock's seconds) as a feeder with a
    concurrency limit of `limit` hands them over; how many it held unanswered (claimed, not
    answered) after each answer."""
    fake = FakeTime()
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    make_job(ledger, 3000)
    settings = RunnerSettings(clock=fake.clock, sleep=fake.sleep)
    log = JobLog(tmp_path / "j.log", "j")
    db = cast(LedgerCalls, InLoop())
    feeder = Feeder(ledger, db, job="j", owner="w", limit=lambda: limit, settings=settings, log=log)
    send, receive = anyio.create_memory_object_stream[ClaimedItem](math.inf)
    held: list[int] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(feeder.run, send)
        async with receive:
            for answered in range(1, answers + 1):
                await receive.receive()
                fake.now += every_s
                feeder.answered()
                await anyio.lowlevel.checkpoint()  # it looks at its backlog, claims if it must
                held.append(ledger.counts("j").get("running", 0) - answered)
        feeder.stopping.set()
        tg.cancel_scope.cancel()
    ledger.close()
    return held


async def test_a_worker_answering_fast_holds_a_quarter_second_of_its_answers(
    tmp_path: Path,
) -> None:
    """2,000 answers a second at 32 in flight: with four limits (128) it would claim when 64
    are left, 32 of them in flight: 16 ms of answers queued, less than a claim takes on a busy
    ledger. It holds about a quarter second's answers instead (500), and claims again while
    half of them are left."""
    held = await held_while_answering(tmp_path, limit=32, every_s=0.0005, answers=1200)
    quarter = int(BACKLOG_S / 0.0005)
    assert max(held[:400]) <= 4 * 32  # the first quarter second: no rate known yet
    assert quarter <= max(held[600:]) <= quarter + 2  # float rounding of the rate
    assert min(held[600:]) > quarter // 2  # claimed again as soon as only half are left


async def test_what_a_worker_holds_for_its_pace_is_at_most_sixteen_limits(
    tmp_path: Path,
) -> None:
    """2,000 answers a second at 8 in flight: a quarter second's answers (500) would be 62
    limits; if its endpoint then slowed, the other workers could not have them. It holds 16."""
    held = await held_while_answering(tmp_path, limit=8, every_s=0.0005, answers=900)
    assert max(held) == MOST_LIMITS * 8
    assert min(held[600:]) > MOST_LIMITS * 8 // 2


async def test_a_worker_answering_slowly_holds_four_limits(tmp_path: Path) -> None:
    """Ten answers a second: a quarter second of them is fewer than four limits, which hold."""
    held = await held_while_answering(tmp_path, limit=8, every_s=0.1, answers=120)
    assert max(held) == 4 * 8
    assert min(held) > 2 * 8
