"""One job run by many workers, attacked: each test failed on the code before its fix, and
names the defect it showed."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from batchrun import jobs, reuse, status_view
from batchrun.config import resolve
from batchrun.errors import OptionError
from batchrun.ledger import Joining, Ledger
from tests.postgres import fresh_database
from tests.unit.test_reuse import answer_all, ledger, load

SPEC_X, SPEC_Y = "x" * 64, "y" * 64
__all__ = ["ledger"]  # the fixture, shared with tests/unit/test_reuse.py


@pytest.fixture
def pg_ledger(postgres_server: str) -> Iterator[Ledger]:
    with fresh_database(postgres_server) as url:
        opened = Ledger(url)
        yield opened
        opened.close()


def test_two_workers_starting_together_with_other_options_leave_one_answer_set(
    ledger: Ledger,
) -> None:
    """Two `resume`s of one job start at once, one with --model x, one with --model y. Each
    looked (jobs: reuse.prepare, with its Joining check) and then joined (Runner.run) in two
    transactions: both looked before either joined, so both passed, y copied last week's
    y answers into the job, and only then was refused at its join. README: refused "before it
    changes anything (it copies no earlier answer made under its own options into their
    job)". Now a run joins, as its runner's worker, in the transaction that copies."""
    load(ledger, "last-week", ["a", "b"])
    answer_all(ledger, "last-week", SPEC_Y)  # answered under --model y
    load(ledger, "j", ["a", "b"])
    x = Joining({"model": "x"}, ("model",), 60, worker="wx")
    y = Joining({"model": "y"}, ("model",), 60, worker="wy")
    assert ledger.prepare_reuse("j", SPEC_X, reuse_since=None, joining=x) == (0, 0)
    with pytest.raises(OptionError):  # x joined as it looked: y is refused, and copies nothing
        ledger.prepare_reuse("j", SPEC_Y, reuse_since=None, joining=y)
    ledger.join("j", "wx", ttl=60, spec=x.spec, same=x.same)  # x's runner: the same worker
    answered = [(i.line, i.status, i.output) for i in ledger.iter_results("j")]
    assert answered == [(1, "pending", None), (2, "pending", None)]
    assert [w.id for w in ledger.workers("j")] == ["wx"]


def test_status_judges_workers_by_the_databases_clock_not_the_hosts(
    pg_ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README: "Heartbeats and leases use the database's clock (PostgreSQL's, for every host
    alike), so hosts' clocks may differ." A worker that just beat is running, whatever the
    clock of the host where `status` is typed (here 10 minutes ahead of the server)."""
    load(pg_ledger, "j", ["a", "b"])
    pg_ledger.join("j", "w1", ttl=60)
    pg_ledger.heartbeat("j", "w1", lease_ttl=60)  # a fresh heartbeat, in the server's time
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 600)  # this host: ahead
    job = pg_ledger.get_job("j")
    assert job is not None
    detail = status_view.job_detail(pg_ledger, job)
    (worker,) = detail["workers"]
    assert worker["state"] == "running", worker
    assert worker["heartbeat_age_s"] < 60, worker
    assert detail["state"].startswith("running"), detail["state"]


def test_a_worker_whose_schema_file_says_otherwise_is_not_let_in(
    ledger: Ledger, tmp_path: Any
) -> None:
    """--schema is one of the options workers must agree on (README), and an edited schema file
    asks for other answers (reuse.answer_spec hashes the file's bytes). The check that lets a
    worker in compares the path (jobs.py stores it resolved), not what the file says: a host
    whose file at that path says otherwise (or the file edited between two starts) joins."""
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "required": ["label"]}')
    spec = resolve({"backend": "sim", "model": "m", "schema": str(schema.resolve())})
    load(ledger, "j", ["a", "b"])
    ledger.join("j", "first", ttl=60, spec=reuse.joined(spec), same=reuse.SAME)
    schema.write_text('{"type": "object", "required": ["label", "reason"]}')  # other answers
    with pytest.raises(OptionError, match="schema"):
        ledger.join("j", "second", ttl=60, spec=reuse.joined(spec), same=reuse.SAME)
    schema.write_text('{"type": "object", "required": ["label"]}')  # the same schema again
    ledger.join("j", "third", ttl=60, spec=reuse.joined(spec), same=reuse.SAME)
    job = ledger.get_job("j")
    assert job is not None and jobs.job_spec(job).schema == str(schema.resolve())
