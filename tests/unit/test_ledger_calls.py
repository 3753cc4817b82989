"""Ledger calls from a run: a database out of reach is waited out for the outage timeout, a
busy one for the busy patience; anything else is raised at once. And which driver errors mean
"out of reach", by dialect."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError

from batchrun.errors import LedgerError
from batchrun.ledger import Ledger
from batchrun.ledger.dialect import POSTGRES, SQLITE
from batchrun.ledger.engine import storage_errors
from batchrun.ledger_calls import RETRY_S, LedgerCalls
from batchrun.progress import JobLog
from batchrun.run_state import RunnerSettings
from tests.fakes import FakeTime

pytestmark = pytest.mark.anyio


class Failing:
    """Raises `error` for the first `times` calls, then answers 7."""

    def __init__(self, error: LedgerError, times: int) -> None:
        self.error, self.times, self.calls = error, times, 0

    def __call__(self) -> int:
        self.calls += 1
        if self.calls <= self.times:
            raise self.error
        return 7


def calls(
    tmp_path: Path, fake: FakeTime, said: list[str], busy_patience: float = 600.0
) -> LedgerCalls:
    log = JobLog(tmp_path / "j.log", "j")
    patient = RunnerSettings(clock=fake.clock, sleep=fake.sleep, busy_patience=busy_patience)
    return LedgerCalls(patient, outage_timeout=30.0, log=log, say=said.append)


def events(tmp_path: Path) -> list[str]:
    lines = (tmp_path / "j.log").read_text().splitlines()
    return [json.loads(line)["event"] for line in lines]


AWAY = LedgerError("ledger error while claiming items: connection refused", out_of_reach=True)


async def test_a_database_out_of_reach_is_waited_out_and_its_return_said(tmp_path: Path) -> None:
    fake, said = FakeTime(), []
    db = calls(tmp_path, fake, said)
    flaky = Failing(AWAY, times=5)
    assert await db(flaky) == 7
    assert flaky.calls == 6 and db.outages == 5 and fake.sleeps == [RETRY_S] * 5
    assert events(tmp_path) == ["ledger_unreachable", "ledger_back"]
    assert "out of reach" in said[0] and "30 s" in said[0] and "back after 5 s" in said[1]


async def test_past_the_outage_timeout_the_call_fails_saying_so(tmp_path: Path) -> None:
    fake, said = FakeTime(), []
    db = calls(tmp_path, fake, said)
    with pytest.raises(LedgerError) as raised:
        await db(Failing(AWAY, times=1000))
    assert raised.value.out_of_reach
    assert "more than 30 s (--outage-timeout)" in str(raised.value)
    assert 30 <= sum(fake.sleeps) <= 30 + 2 * RETRY_S


async def test_a_failing_run_does_not_wait_and_other_errors_are_raised_at_once(
    tmp_path: Path,
) -> None:
    fake, said = FakeTime(), []
    db = calls(tmp_path, fake, said)
    full = LedgerError("ledger error while recording results: database or disk is full")
    with pytest.raises(LedgerError, match="disk is full"):
        await db(Failing(full, times=1))
    db.no_waiting = True
    with pytest.raises(LedgerError, match="connection refused"):
        await db(Failing(AWAY, times=1))
    assert fake.sleeps == [] and said == []


async def test_a_busy_ledger_is_waited_out_for_the_busy_patience(tmp_path: Path) -> None:
    fake, said = FakeTime(), []
    db = calls(tmp_path, fake, said, busy_patience=5.0)
    busy = LedgerError("ledger error while claiming items: database is locked", busy=True)
    assert await db(Failing(busy, times=3)) == 7
    with pytest.raises(LedgerError, match="locked"):
        await db(Failing(busy, times=1000))
    assert 3 + 5 <= sum(fake.sleeps) <= 3 + 5 + 2 * RETRY_S


def statement_error(kind: type[DBAPIError], orig: Exception) -> DBAPIError:
    return kind("UPDATE items ...", {}, orig)


def test_which_errors_mean_the_database_is_out_of_reach() -> None:
    shut_down = statement_error(OperationalError, psycopg.errors.AdminShutdown())
    starting = statement_error(OperationalError, psycopg.errors.CannotConnectNow())
    refused = statement_error(OperationalError, psycopg.OperationalError("connection refused"))
    lost = statement_error(OperationalError, psycopg.errors.ConnectionFailure())
    full = statement_error(OperationalError, psycopg.errors.DiskFull())
    login = psycopg.OperationalError(
        'connection failed: FATAL:  password authentication failed for user "batch"'
    )
    refused_login = statement_error(OperationalError, login)
    no_db = statement_error(
        OperationalError, psycopg.OperationalError('FATAL:  database "nightly" does not exist')
    )
    twice = statement_error(IntegrityError, psycopg.errors.UniqueViolation())
    for error in (shut_down, starting, refused, lost):
        assert POSTGRES.out_of_reach(error)
        assert not SQLITE.out_of_reach(error)  # a file is not away
    for error in (full, twice, refused_login, no_db):  # waiting would not help
        assert not POSTGRES.out_of_reach(error)


def test_a_transaction_that_lost_to_another_is_tried_again_whatever_its_words() -> None:
    # Told by SQLSTATE: a server speaking another language says "Verklemmung entdeckt".
    for lost in (psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure):
        error = statement_error(OperationalError, lost("Verklemmung entdeckt"))
        assert POSTGRES.conflict(error) and not POSTGRES.out_of_reach(error)
        with pytest.raises(LedgerError) as raised, storage_errors("recording", POSTGRES):
            raise error
        assert raised.value.busy
    assert not POSTGRES.conflict(statement_error(IntegrityError, psycopg.errors.UniqueViolation()))


def test_a_postgresql_ledger_that_cannot_be_reached_says_so() -> None:
    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(LedgerError) as raised:
        Ledger(f"postgresql+psycopg://batchrun:secret@127.0.0.1:{port}/nothing")
    assert raised.value.out_of_reach and "secret" not in str(raised.value)
