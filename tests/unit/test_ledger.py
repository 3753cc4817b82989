"""The ledger's guarantees: all-or-nothing ingest, leases, the duplicate guard, reclaim."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import bindparam, inspect, text, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Dialect

from batchrun.errors import EmptyInput, InputError, JobExists, LedgerError, OptionError
from batchrun.inputs import BadLine, InputItem
from batchrun.ledger import ItemResult, Ledger, Spent
from batchrun.ledger.driver import Many
from batchrun.ledger.engine import make_engine
from batchrun.ledger.migrations import MIGRATIONS, current_version, migrate
from batchrun.ledger.schema import items
from batchrun.outputs import native_record, openai_record
from batchrun.status_view import job_detail, jobs_table
from tests.unit.test_runner import rows as stored_rows


def item(line: int, item_id: str | None = None) -> InputItem:
    return InputItem(
        line=line,
        item_id=item_id or f"id{line}",
        endpoint="chat",
        body=b'{"messages":[{"role":"user","content":"hi"}]}',
        digest=f"{line:064x}",
        meta=None,
    )


@pytest.fixture
def ledger(ledger_url: str) -> Iterator[Ledger]:
    """The ledger on SQLite and on PostgreSQL: every test that takes it runs on both."""
    opened = Ledger(ledger_url)
    yield opened
    opened.close()


def make_job(ledger: Ledger, n: int = 10, name: str = "j") -> None:
    ledger.create_job(
        name,
        input_path="in.jsonl",
        input_digest="abc",
        spec={},
        lines=[item(i) for i in range(1, n + 1)],
        skip_invalid=False,
    )


def done(line: int, output: str = "ok") -> ItemResult:
    return ItemResult(line=line, status="done", attempts=1, output=output, latency_ms=5.0)


def test_migrations_on_blank_database_are_ordered_and_idempotent(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'blank.db'}")
    assert migrate(engine) == len(MIGRATIONS)
    assert migrate(engine) == 0
    assert current_version(engine) == MIGRATIONS[-1][0]
    tables = set(inspect(engine).get_table_names())
    assert {"jobs", "items", "schema_migrations"} <= tables
    versions = [v for v, _name, _fn in MIGRATIONS]
    assert versions == sorted(versions) and len(set(versions)) == len(versions)


def test_a_ledger_made_before_long_ids_takes_them_and_still_refuses_repeats(
    ledger_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ledger of version 10 (PostgreSQL: ids unique by their text, in a B-tree that holds
    at most 2,704 bytes an entry) migrates to ids unique by their md5 there; the same
    rule holds on both ledgers: an id of any length loads, a repeated one is refused."""
    engine = make_engine(ledger_url)
    monkeypatch.setattr("batchrun.ledger.migrations.MIGRATIONS", MIGRATIONS[:10])
    migrate(engine)
    if engine.dialect.name == "postgresql":  # as version 10 made it
        with engine.begin() as conn:
            conn.execute(text("DROP INDEX ix_items_job_item_md5"))
            conn.execute(
                text(
                    "CREATE UNIQUE INDEX ix_items_job_item_id ON items (job, item_id) "
                    "WHERE status != 'rejected'"
                )
            )
    monkeypatch.undo()
    assert migrate(engine) == len(MIGRATIONS) - 10
    indexes = {i["name"] for i in inspect(engine).get_indexes("items")}
    kept = (
        "ix_items_job_item_md5" if engine.dialect.name == "postgresql" else "ix_items_job_item_id"
    )
    assert kept in indexes and len(indexes & {"ix_items_job_item_md5", "ix_items_job_item_id"}) == 1
    engine.dispose()
    ledger = Ledger(ledger_url)
    long_id = "https://bucket.example/doc.pdf?sig=" + "".join(f"{n:08x}" for n in range(400))
    report = ledger.create_job(
        "long",
        input_path="in.jsonl",
        input_digest="abc",
        spec={},
        lines=[item(1, long_id), item(2)],
        skip_invalid=False,
    )
    assert report.accepted == 2
    with pytest.raises(InputError, match="duplicate"):
        ledger.create_job(
            "twice",
            input_path="in.jsonl",
            input_digest="abc",
            spec={},
            lines=[item(1, long_id), item(2, long_id)],
            skip_invalid=False,
        )
    ledger.close()


def test_sqlite_runs_in_wal_mode_with_busy_timeout(tmp_path: Path) -> None:
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    with ledger.engine.connect() as conn:
        assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
        assert conn.execute(text("PRAGMA busy_timeout")).scalar() == 30000


def test_an_sqlite_uri_is_opened_as_written_and_makes_no_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = tmp_path / "made" / "ledger.db"
    Ledger(f"sqlite:///{db}")
    monkeypatch.chdir(tmp_path)
    read_only = Ledger(f"sqlite:///file:{db}?mode=ro&uri=true")
    with read_only.engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM jobs")).scalar() == 0
    assert not (tmp_path / "file:").exists()


@pytest.mark.parametrize("port", ["0", "99999"])
def test_a_ledger_port_out_of_range_is_a_mistake_said_at_once_not_an_outage(port: str) -> None:
    # libpq says "invalid port number" as it connects, which was taken for a database away:
    # exit 3 (an outage), the advice to resume later, for a URL that can never work.
    with pytest.raises(LedgerError, match="port") as raised:
        Ledger(f"postgresql+psycopg://batch@127.0.0.1:{port}/batchrun")
    assert not raised.value.out_of_reach


def test_ingest_counts_and_job_row(ledger: Ledger) -> None:
    make_job(ledger, 25)
    job = ledger.get_job("j")
    assert job is not None and job.total == 25 and job.input_digest == "abc"
    assert ledger.counts("j")["pending"] == 25


def test_bad_lines_refuse_the_whole_file(ledger: Ledger) -> None:
    lines = [item(1), BadLine(2, "invalid JSON"), item(3), BadLine(4, "no prompt")]
    with pytest.raises(InputError) as caught:
        ledger.create_job(
            "j", input_path="x", input_digest="d", spec={}, lines=lines, skip_invalid=False
        )
    assert caught.value.problems == [(2, "invalid JSON"), (4, "no prompt")]
    assert "line 2: invalid JSON" in str(caught.value)
    assert ledger.get_job("j") is None  # nothing at all was stored


def test_duplicate_ids_are_refused_with_both_line_numbers(ledger: Ledger) -> None:
    lines = [item(1, "a"), item(2, "b"), item(3, "a")]
    with pytest.raises(InputError) as caught:
        ledger.create_job(
            "j", input_path="x", input_digest="d", spec={}, lines=lines, skip_invalid=False
        )
    assert caught.value.problems == [(3, "duplicate id 'a' (first on line 1)")]
    assert ledger.get_job("j") is None


def test_skip_invalid_records_rejected_lines(ledger: Ledger) -> None:
    lines = [item(1, "a"), BadLine(2, "invalid JSON"), item(3, "a"), item(4, "b")]
    report = ledger.create_job(
        "j", input_path="x", input_digest="d", spec={}, lines=lines, skip_invalid=True
    )
    assert (report.accepted, report.rejected) == (2, 2)
    rows = {r["line"]: r for r in stored_rows(ledger)}
    assert rows[2]["status"] == "rejected" and rows[2]["error"] == "invalid JSON"
    assert rows[3]["status"] == "rejected" and "duplicate id 'a'" in rows[3]["error"]
    assert [rows[n]["status"] for n in (1, 4)] == ["pending", "pending"]


def test_a_rejected_line_takes_no_id_that_a_real_item_could_have(ledger: Ledger) -> None:
    # Before: line 2's unusable id became "2", line 1's real id, twice in an export.
    lines = [item(1, "2"), BadLine(2, "'id' must be a string or an integer"), item(3, "b")]
    ledger.create_job(
        "j", input_path="x", input_digest="d", spec={}, lines=lines, skip_invalid=True
    )
    rows = list(ledger.iter_results("j"))
    custom_ids = [openai_record(row, None)["custom_id"] for row in rows]
    assert custom_ids == ["2", None, "b"]
    assert [native_record(row)["id"] for row in rows] == ["2", None, "b"]


def test_empty_input_is_an_error_and_stores_nothing(ledger: Ledger) -> None:
    with pytest.raises(EmptyInput, match="no items"):
        ledger.create_job(
            "j", input_path="x", input_digest="d", spec={}, lines=[], skip_invalid=False
        )
    assert ledger.get_job("j") is None


def test_digest_may_be_computed_after_the_lines_are_read(ledger: Ledger) -> None:
    seen: list[int] = []

    def lines():  # type: ignore[no-untyped-def]
        for i in (1, 2):
            seen.append(i)
            yield item(i)

    ledger.create_job(
        "j",
        input_path="x",
        input_digest=lambda: f"after-{len(seen)}",
        spec={},
        lines=lines(),
        skip_invalid=False,
    )
    job = ledger.get_job("j")
    assert job is not None and job.input_digest == "after-2"


def test_claim_leases_lowest_lines_first_and_moves_them_to_running(ledger: Ledger) -> None:
    make_job(ledger, 10)
    ledger.join("j", "me", ttl=60)
    claimed = ledger.claim("j", "me", 4, lease_ttl=60)
    assert [c.line for c in claimed] == [1, 2, 3, 4]
    assert [c.item_id for c in claimed] == ["id1", "id2", "id3", "id4"]
    again = ledger.claim("j", "me", 4, lease_ttl=60)
    assert [c.line for c in again] == [5, 6, 7, 8]
    counts = ledger.counts("j")
    assert (counts["running"], counts["pending"]) == (8, 2)


def test_record_completes_items_and_counts_attempts(ledger: Ledger) -> None:
    make_job(ledger, 3)
    ledger.join("j", "me", ttl=60)
    ledger.claim("j", "me", 3, lease_ttl=60)
    changed = ledger.record(
        "j",
        "me",
        [
            done(1, "one"),
            ItemResult(line=2, status="failed", attempts=5, error="HTTP 500"),
            ItemResult(line=3, status="invalid", attempts=2, output="x", error="no JSON"),
        ],
    )
    assert changed.by_status == {"done": 1, "failed": 1, "invalid": 1}
    rows = {r["line"]: r for r in stored_rows(ledger)}
    assert (rows[1]["status"], rows[1]["output"], rows[1]["attempts"]) == ("done", "one", 1)
    assert (rows[2]["status"], rows[2]["attempts"], rows[2]["error"]) == ("failed", 5, "HTTP 500")
    assert rows[3]["status"] == "invalid"
    assert all(r["owner"] is None and r["lease_expires"] is None for r in rows.values())


def test_late_duplicate_result_changes_nothing(ledger: Ledger) -> None:
    make_job(ledger, 2)
    ledger.join("j", "me", ttl=60)
    ledger.claim("j", "me", 2, lease_ttl=60)
    assert ledger.record("j", "me", [done(1, "first")]).finished == 1
    assert ledger.record("j", "me", [done(1, "second")]).finished == 0  # already final
    assert ledger.record("j", "other", [done(2, "not mine")]).finished == 0  # not our lease
    rows = {r["line"]: r for r in stored_rows(ledger)}
    assert rows[1]["output"] == "first" and rows[1]["attempts"] == 1
    assert rows[2]["status"] == "running"


def test_release_puts_unfinished_claims_back_to_pending(ledger: Ledger) -> None:
    make_job(ledger, 5)
    ledger.join("j", "me", ttl=60)
    ledger.claim("j", "me", 5, lease_ttl=60)
    ledger.record("j", "me", [done(1), done(2)])
    assert ledger.release("j", "me") == 3
    counts = ledger.counts("j")
    assert (counts["done"], counts["pending"], counts["running"]) == (2, 3, 0)
    job = ledger.get_job("j")
    assert job is not None and job.runner_owner is None


def test_release_stores_what_was_spent_and_the_next_claim_goes_on_from_it(
    ledger: Ledger,
) -> None:
    make_job(ledger, 3)
    ledger.join("j", "me", ttl=60)
    ledger.claim("j", "me", 3, lease_ttl=60)
    spent = [Spent(1, requests=2, charged=1), Spent(2, requests=1, charged=0)]
    assert ledger.release("j", "me", spent=spent) == 3
    ledger.join("j", "next", ttl=60)
    claimed = {c.line: (c.attempts, c.charged) for c in ledger.claim("j", "next", 3, lease_ttl=60)}
    assert claimed == {1: (2, 1), 2: (1, 0), 3: (0, 0)}
    ledger.record("j", "next", [ItemResult(1, "failed", 1, error="x")])
    assert ledger.requeue("j") == 1  # `retry`: --max-attempts starts again, attempts stay
    ledger.release("j", "next")
    ledger.join("j", "third", ttl=60)
    claimed = {c.line: (c.attempts, c.charged) for c in ledger.claim("j", "third", 3, lease_ttl=60)}
    assert claimed[1] == (3, 0)


def test_a_ledger_made_before_charged_attempts_takes_them(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'v11.db'}"
    engine = make_engine(url)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("batchrun.ledger.migrations.MIGRATIONS", MIGRATIONS[:11])
        migrate(engine)
    with engine.begin() as conn:  # as version 11 made it
        conn.execute(text("ALTER TABLE items DROP COLUMN charged"))
        conn.execute(text("ALTER TABLE items DROP COLUMN answer_model"))
    assert migrate(engine) == len(MIGRATIONS) - 11
    engine.dispose()
    ledger = Ledger(url)
    make_job(ledger, 2)
    ledger.join("j", "me", ttl=60)
    assert [c.charged for c in ledger.claim("j", "me", 2, lease_ttl=60)] == [0, 0]
    ledger.close()


def test_a_postgresql_server_out_of_connections_is_waited_out_like_one_away(
    postgres_server: str,
) -> None:
    # "sorry, too many clients already": many workers at once, or another program's pool. The
    # others will let connections go, so it is waited out as an outage (out_of_reach), not a
    # mistake that ends the run.
    import psycopg

    from tests.postgres import fresh_database

    with fresh_database(postgres_server) as url:
        ledger = Ledger(url)
        make_job(ledger, 1)
        ledger.engine.dispose()
        plain, held = url.replace("postgresql+psycopg://", "postgresql://"), []
        try:
            with pytest.raises(psycopg.OperationalError, match="too many clients"):
                while len(held) < 1000:
                    held.append(psycopg.connect(plain))
            with pytest.raises(LedgerError, match="too many clients") as raised:
                ledger.counts("j")
            assert raised.value.out_of_reach
        finally:
            for conn in held:
                conn.close()
        assert ledger.counts("j")["pending"] == 1
        ledger.close()


def test_a_runs_writes_may_sit_idle_no_longer_than_its_lease_on_postgresql(
    postgres_server: str,
) -> None:
    # A worker frozen (or its machine gone) inside a write would hold its row locks until TCP
    # gives up, hours later; the live workers wait behind it (tests/hostile/test_crash.py).
    # Only a run's writes are limited: a load's gaps are its input's.
    from tests.postgres import fresh_database

    with fresh_database(postgres_server) as url:
        ledger = Ledger(url)

        def idle_limit() -> str:
            with ledger._write("looking") as conn:
                shown = conn.exec_driver_sql("SHOW idle_in_transaction_session_timeout")
                return str(shown.scalar())

        make_job(ledger, 2)
        assert idle_limit() == "0"
        ledger.join("j", "me", ttl=3)
        assert idle_limit() == "3s"
        ledger.release("j", "me")
        assert idle_limit() == "0"
        ledger.close()


def test_claims_a_worker_never_saw_go_back_and_those_it_holds_stay(ledger: Ledger) -> None:
    make_job(ledger, 6)
    ledger.join("j", "me", ttl=60)
    ledger.join("j", "other", ttl=60)
    ledger.claim("j", "me", 4, lease_ttl=60)  # its answer lost with the connection, say
    ledger.claim("j", "other", 1, lease_ttl=60)
    assert ledger.put_back_strays("j", "me", {1, 2}) == 2  # it holds 1 and 2 only
    assert [c.line for c in ledger.claim("j", "me", 10, lease_ttl=60)] == [3, 4, 6]
    assert ledger.put_back_strays("j", "me", {1, 2, 3, 4, 6}) == 0
    assert ledger.counts("j")["running"] == 6  # 5 stays the other worker's


def test_a_worker_asking_for_other_answers_cannot_join_a_running_job(ledger: Ledger) -> None:
    make_job(ledger, 4)
    same = ("model", "temperature")
    ledger.join("j", "first", ttl=60, spec={"model": "m", "temperature": 0.2}, same=same)
    with pytest.raises(OptionError) as refused:
        ledger.join("j", "second", ttl=60, spec={"model": "m", "temperature": 0.9}, same=same)
    said = refused.value.naming(lambda key: f"--{key}")
    assert "1 other worker(s)" in said and "--temperature 0.9 here, 0.2 there" in said
    assert [w.id for w in ledger.workers("j")] == ["first"]  # nothing changed
    faster = {"model": "m", "temperature": 0.2, "concurrency": 64}  # pacing may differ
    ledger.join("j", "third", ttl=60, spec=faster, same=same)
    ledger.release("j", "first")
    ledger.release("j", "third")
    ledger.join("j", "fourth", ttl=60, spec={"model": "m", "temperature": 0.9}, same=same)
    job = ledger.get_job("j")
    assert job is not None and job.spec["temperature"] == 0.9  # alone now: its options


def test_a_dead_worker_does_not_hold_a_job_to_its_options(ledger: Ledger) -> None:
    make_job(ledger, 4)
    same = ("temperature",)
    ledger.join("j", "crashed", ttl=600, spec={"temperature": 0.2}, same=same)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    with ledger.engine.begin() as conn:  # its process is gone, its heartbeat still fresh
        conn.execute(text("UPDATE workers SET pid = :pid"), {"pid": int(dead.stdout)})
    ledger.join("j", "fixed", ttl=600, spec={"temperature": 0.9}, same=same)
    ledger.join("j", "fixed", ttl=600, spec={"temperature": 0.9}, same=same)  # tried again
    assert [w.id for w in ledger.workers("j")] == ["crashed", "fixed"]


def test_a_second_worker_joins_and_claims_other_items(ledger: Ledger) -> None:
    make_job(ledger, 6)
    ledger.join("j", "first", ttl=60)  # this process: alive
    assert [c.line for c in ledger.claim("j", "first", 2, lease_ttl=60)] == [1, 2]
    assert ledger.join("j", "second", ttl=60) == 0  # a live worker's items stay its own
    assert [c.line for c in ledger.claim("j", "second", 10, lease_ttl=60)] == [3, 4, 5, 6]
    assert [w.id for w in ledger.workers("j")] == ["first", "second"]


def test_dead_runners_leases_are_reclaimed_at_once(ledger: Ledger) -> None:
    make_job(ledger, 6)
    ledger.join("j", "crashed", ttl=600)
    ledger.claim("j", "crashed", 4, lease_ttl=600)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    with ledger.engine.begin() as conn:  # pretend the crashed worker was that exited process
        conn.execute(text("UPDATE workers SET pid = :pid"), {"pid": int(dead.stdout)})
    assert ledger.join("j", "new", ttl=600) == 4
    assert ledger.counts("j")["pending"] == 6
    assert [c.line for c in ledger.claim("j", "new", 10, lease_ttl=60)] == [1, 2, 3, 4, 5, 6]


def test_a_worker_with_a_stale_heartbeat_loses_its_items(ledger: Ledger) -> None:
    make_job(ledger, 2)
    ledger.join("j", "old", ttl=60)
    ledger.claim("j", "old", 2, lease_ttl=60)
    with ledger.engine.begin() as conn:
        conn.execute(text("UPDATE workers SET heartbeat = :t"), {"t": time.time() - 3600})
    assert ledger.join("j", "new", ttl=60) == 2
    assert [w.stopped_at is not None for w in ledger.workers("j")] == [True, False]


def leases(ledger: Ledger) -> list[float]:
    with ledger.engine.begin() as conn:
        return [t for (t,) in conn.execute(text("SELECT lease_expires FROM items ORDER BY line"))]


def test_heartbeat_extends_leases(ledger: Ledger) -> None:
    make_job(ledger, 2)
    ledger.join("j", "me", ttl=60)
    ledger.claim("j", "me", 2, lease_ttl=1)
    before = leases(ledger)
    ledger.heartbeat("j", "me", lease_ttl=120)
    after = leases(ledger)
    assert all(a > b + 100 for a, b in zip(after, before, strict=True))


def test_requeue_puts_failed_and_invalid_back(ledger: Ledger) -> None:
    make_job(ledger, 3)
    ledger.join("j", "me", ttl=60)
    ledger.claim("j", "me", 3, lease_ttl=60)
    ledger.record(
        "j",
        "me",
        [
            done(1),
            ItemResult(line=2, status="failed", attempts=5, error="boom"),
            ItemResult(line=3, status="invalid", attempts=1, error="bad"),
        ],
    )
    ledger.mark_finished("j", True)
    assert ledger.requeue("j") == 2
    counts = ledger.counts("j")
    assert (counts["done"], counts["pending"]) == (1, 2)
    job = ledger.get_job("j")
    assert job is not None and job.finished_at is None
    rows = {r["line"]: r for r in stored_rows(ledger)}
    assert rows[2]["error"] is None and rows[2]["attempts"] == 5  # history of attempts kept


def test_iter_results_pages_in_input_order(ledger: Ledger) -> None:
    make_job(ledger, 45)
    lines = [r.line for r in ledger.iter_results("j", batch=7)]
    assert lines == list(range(1, 46))


def test_item_stats_percentiles_and_totals(ledger: Ledger) -> None:
    make_job(ledger, 4)
    ledger.join("j", "me", ttl=60)
    ledger.claim("j", "me", 4, lease_ttl=60)
    ledger.record(
        "j",
        "me",
        [
            ItemResult(
                line=i,
                status="done",
                attempts=1,
                latency_ms=float(i * 100),
                prompt_tokens=10,
                completion_tokens=i,
            )
            for i in range(1, 5)
        ],
    )
    stats = ledger.item_stats("j")
    assert stats["prompt_tokens"] == 40 and stats["completion_tokens"] == 10
    assert stats["latency_ms"]["p50"] in (200.0, 300.0)
    assert stats["latency_ms"]["p99"] == 400.0


def test_ledger_survives_reopen(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    first = Ledger(url)
    make_job(first, 3)
    first.join("j", "me", ttl=60)
    first.claim("j", "me", 1, lease_ttl=60)
    first.record("j", "me", [done(1)])
    first.close()
    second = Ledger(url)
    assert second.counts("j")["done"] == 1
    assert os.path.exists(tmp_path / "ledger.db")


def test_creating_an_existing_job_is_a_usage_error(ledger: Ledger) -> None:
    make_job(ledger, 2)
    with pytest.raises(JobExists, match="already exists"):
        make_job(ledger, 2)
    assert ledger.counts("j")["pending"] == 2


def test_storage_errors_do_not_echo_sql_or_prompts(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    db.write_bytes(b"this is not a database, it holds a secret prompt" * 100)
    with pytest.raises(LedgerError) as caught:
        Ledger(f"sqlite:///{db}")
    assert "not a database" in str(caught.value)
    assert "SELECT" not in str(caught.value) and "secret prompt" not in str(caught.value)


def test_reads_do_not_wait_for_a_writer(tmp_path: Path) -> None:
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    make_job(ledger, 3)
    blocker = sqlite3.connect(tmp_path / "ledger.db", isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")  # another process holding the write lock
    try:
        started = time.monotonic()
        assert ledger.counts("j")["pending"] == 3
        assert ledger.get_job("j") is not None
        assert len(list(ledger.iter_results("j"))) == 3
        assert time.monotonic() - started < 5  # far below the 30 s busy timeout
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()


def test_a_frozen_worker_whose_leases_ran_out_commits_nothing_and_carries_on(
    ledger: Ledger,
) -> None:
    make_job(ledger, 6)
    ledger.join("j", "frozen", ttl=60)
    assert [c.line for c in ledger.claim("j", "frozen", 2, lease_ttl=60)] == [1, 2]
    with ledger.engine.begin() as conn:  # it stopped (SIGSTOP) past its lease
        conn.execute(text("UPDATE items SET lease_expires = :t"), {"t": time.time() - 1})
    ledger.join("j", "live", ttl=60)  # the live worker reclaims what ran out
    assert [c.line for c in ledger.claim("j", "live", 2, lease_ttl=60)] == [1, 2]
    # it wakes up: its results for those items change nothing, its heartbeat takes nothing
    assert ledger.record("j", "frozen", [ItemResult(1, "done", 1, output="late")]).finished == 0
    assert ledger.heartbeat("j", "frozen", lease_ttl=60) == 0
    assert ledger.record("j", "live", [ItemResult(1, "done", 1, output="mine")]).finished == 1
    assert [c.line for c in ledger.claim("j", "frozen", 2, lease_ttl=60)] == [3, 4]


def test_a_worker_waits_while_items_are_pending_or_held_by_others(ledger: Ledger) -> None:
    make_job(ledger, 3)
    ledger.join("j", "a", ttl=60)
    ledger.join("j", "b", ttl=60)
    ledger.claim("j", "a", 3, lease_ttl=60)
    assert ledger.more_may_come("j", "b")  # a's items may come back
    assert not ledger.more_may_come("j", "a")  # its own do not count
    assert ledger.release("j", "a") == 3  # put back, behind b's last claim: still to do
    assert ledger.more_may_come("j", "b")
    ledger.claim("j", "b", 3, lease_ttl=60)
    results = [ItemResult(line, "done", 1, output="x") for line in (1, 2, 3)]
    assert ledger.record("j", "b", results).finished == 3
    assert not ledger.more_may_come("j", "b")


def test_a_worker_whose_pid_cannot_be_checked_here_is_judged_by_its_heartbeat(
    ledger: Ledger,
) -> None:
    make_job(ledger, 2)
    ledger.join("j", "elsewhere", ttl=60)
    ledger.claim("j", "elsewhere", 2, lease_ttl=60)
    with ledger.engine.begin() as conn:  # same hostname, another machine or container
        conn.execute(text("UPDATE workers SET machine = 'other', pid = 999999"))
    assert ledger.join("j", "here", ttl=60) == 0  # its heartbeat is fresh: it keeps its items
    with ledger.engine.begin() as conn:
        conn.execute(text("UPDATE workers SET pid = 999999 WHERE id = 'here'"))
        conn.execute(text("UPDATE workers SET machine = 'other' WHERE id = 'here'"))
    assert ledger.heartbeat("j", "here", lease_ttl=60) == 0


def test_migrations_bring_an_older_ledger_up_to_date(tmp_path: Path) -> None:
    db = tmp_path / "old.db"
    conn = sqlite3.connect(db)
    conn.executescript(  # a ledger made by v1: no limit_history, no repair counts
        """
        CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, name VARCHAR(100) NOT NULL,
                                        applied_at FLOAT NOT NULL);
        INSERT INTO schema_migrations VALUES (1, 'initial jobs and items', 0);
        CREATE TABLE jobs (name VARCHAR(200) PRIMARY KEY, input_path TEXT NOT NULL,
            input_digest VARCHAR(64) NOT NULL, spec TEXT NOT NULL, total INTEGER NOT NULL,
            created_at FLOAT NOT NULL, updated_at FLOAT NOT NULL, finished_at FLOAT,
            runner_owner VARCHAR(64), runner_pid INTEGER, runner_host VARCHAR(255),
            runner_heartbeat FLOAT);
        INSERT INTO jobs VALUES ('old', 'in.jsonl', 'd', '{}', 1, 0, 0, NULL, NULL, NULL,
                                 NULL, NULL);
        CREATE TABLE items (job VARCHAR(200) NOT NULL, line INTEGER NOT NULL,
            item_id TEXT NOT NULL, endpoint VARCHAR(16) NOT NULL, body TEXT NOT NULL,
            digest VARCHAR(64) NOT NULL, meta TEXT, status VARCHAR(16) NOT NULL,
            attempts INTEGER NOT NULL, owner VARCHAR(64), lease_expires FLOAT,
            latency_ms FLOAT, ttft_ms FLOAT, prompt_tokens INTEGER, completion_tokens INTEGER,
            finish_reason VARCHAR(32), output TEXT, parsed TEXT, error TEXT,
            created_at FLOAT NOT NULL, updated_at FLOAT NOT NULL, PRIMARY KEY (job, line))
            WITHOUT ROWID;
        INSERT INTO items (job, line, item_id, endpoint, body, digest, status, attempts,
                           created_at, updated_at)
            VALUES ('old', 1, '1', 'chat', '{}', 'd', 'done', 1, 0, 0);
        """
    )
    conn.close()
    engine = make_engine(f"sqlite:///{db}")
    assert migrate(engine) == len(MIGRATIONS) - 1  # all after v1 ran
    assert "limit_history" in {c["name"] for c in inspect(engine).get_columns("jobs")}
    assert {
        "repairs",
        "repair_prompt_tokens",
        "repair_completion_tokens",
        "answer_spec",
        "reused_job",
        "reused_line",
        "dup_of",
        "answered_by",
        "sched",
        "chunk",
        "extra_prompt_tokens",
        "extra_completion_tokens",
        "charged",
        "answer_model",
    } <= {c["name"] for c in inspect(engine).get_columns("items")}
    assert {"ix_items_reuse", "ix_items_sched"} <= {
        i["name"] for i in inspect(engine).get_indexes("items")
    }
    assert {"waits", "chunks"} <= set(inspect(engine).get_table_names())
    assert migrate(engine) == 0
    ledger = Ledger(f"sqlite:///{db}")
    job = ledger.get_job("old")
    assert job is not None and job.limit_history == []
    (row,) = ledger.iter_results("old")
    assert (row.repairs, row.repair_prompt_tokens, row.repair_completion_tokens) == (
        0,
        0,
        0,
    )
    assert ledger.item_stats("old")["repairs"] == {
        "requests": 0,
        "prompt_tokens": 0,
        "completion_tokens": 0,
    }


def test_a_job_is_not_started_until_a_request_is_recorded_and_stopped_after(
    ledger: Ledger,
) -> None:
    make_job(ledger, 2)
    job = ledger.get_job("j")
    assert job is not None and job_detail(ledger, job)["state"] == "not started"
    ledger.join("j", "me", ttl=60)
    ledger.claim("j", "me", 2, lease_ttl=60)
    failed = ItemResult(line=1, status="failed", attempts=3, error="HTTP 500")
    ledger.record("j", "me", [failed, done(2)])
    ledger.release("j", "me")
    ledger.requeue("j")  # `batchrun retry`: pending again, but it has run
    job = ledger.get_job("j")
    assert job is not None and job_detail(ledger, job)["state"] == "stopped"
    assert jobs_table(ledger)[0]["state"] == "stopped"


def test_of_two_workers_ending_together_one_finishes_the_job(ledger: Ledger) -> None:
    make_job(ledger, 1)
    assert ledger.mark_finished("j", True) is False  # an item is open: not finished
    ledger.join("j", "me", ttl=60)
    ledger.claim("j", "me", 1, lease_ttl=60)
    ledger.record("j", "me", [done(1)])
    assert ledger.mark_finished("j", True) is True  # this one writes the results file
    assert ledger.mark_finished("j", True) is False  # the other does not


def test_live_workers_are_counted_by_their_heartbeats(ledger: Ledger) -> None:
    make_job(ledger, 2)
    ledger.join("j", "a", ttl=60)
    ledger.join("j", "b", ttl=60)
    assert ledger.live_workers("j", ttl=60) == ["a", "b"]  # first started first: their ranks
    ledger.release("j", "b")
    assert len(ledger.live_workers("j", ttl=60)) == 1
    with ledger.engine.begin() as conn:  # a's heartbeat is old: not counted
        conn.execute(text("UPDATE workers SET heartbeat = heartbeat - 3600 WHERE id = 'a'"))
    assert len(ledger.live_workers("j", ttl=60)) == 0


def test_each_worker_is_judged_by_its_own_lease(ledger: Ledger) -> None:
    make_job(ledger, 4)
    same = ("temperature",)
    ledger.join("j", "patient", ttl=60, spec={"temperature": 0.2}, same=same)
    (held,) = ledger.claim("j", "patient", 1, lease_ttl=60)
    time.sleep(1.1)  # longer than the next one's lease, far shorter than its own
    with pytest.raises(OptionError):  # still there: its options still hold the job
        ledger.join("j", "hasty", ttl=1.0, spec={"temperature": 0.9}, same=same)
    assert ledger.join("j", "hasty", ttl=1.0, spec={"temperature": 0.2}, same=same) == 0
    ledger.heartbeat("j", "hasty", lease_ttl=1.0)
    assert len(ledger.live_workers("j", ttl=1.0)) == 2  # (a second passes in no call here)
    statuses = {i.line: i.status for i in ledger.iter_results("j")}
    assert statuses[held.line] == "running"  # not taken from a live worker
    assert [w.stopped_at for w in ledger.workers("j")] == [None, None]


def test_gc_leaves_a_job_whose_worker_beats_within_its_own_lease(ledger: Ledger) -> None:
    make_job(ledger, 4)
    ledger.join("j", "slow", ttl=300)  # a long --lease: its heartbeats come minutes apart
    ledger.claim("j", "slow", 2, lease_ttl=300)
    ledger.heartbeat("j", "slow", lease_ttl=300)
    job = ledger.get_job("j")
    assert job is not None and job.updated_at > time.time() - 60  # a heartbeat touches it
    with ledger.engine.begin() as conn:  # its last heartbeat 100 s ago, the job's load long ago
        conn.execute(text("UPDATE workers SET heartbeat = heartbeat - 100"))
        conn.execute(text("UPDATE jobs SET updated_at = 0"))
    done = ledger.collect(before=time.time() - 60, everything=False, ttl=60)
    assert done.running == ["j"] and sum(ledger.counts("j").values()) == 4


@pytest.mark.parametrize("dialect", [sqlite.dialect(), postgresql.psycopg.dialect()])
def test_a_statement_the_driver_runs_takes_exactly_the_parameters_its_rows_hold(
    dialect: Dialect,
) -> None:
    """A value written into the statement (`job == "j"`) or a name it lacks would be a value
    the driver never gets, or a row's value bound to the wrong place: refused at compile."""
    by_line = items.c.line == bindparam("b_line")
    fixed = update(items).where(items.c.job == "j", by_line).values(status=bindparam("b_s"))
    with pytest.raises(ValueError, match="parameters"):
        Many.compile(fixed, dialect, ["b_line", "b_s"])
    named = update(items).where(by_line).values(status=bindparam("b_s"))
    with pytest.raises(ValueError, match="parameters"):
        Many.compile(named, dialect, ["b_line", "b_s", "b_other"])
    assert Many.compile(named, dialect, ["b_s", "b_line"]).names == ("b_s", "b_line")


def test_a_worker_joining_beside_others_leaves_the_jobs_options_as_they_are(
    ledger: Ledger,
) -> None:
    # A second host joins with its own --base-url (its local server) and --concurrency: they
    # became the job's, and the next plain `resume` on the first host went to the second's
    # 127.0.0.1. Only a worker alone on the job makes its options the job's.
    make_job(ledger, 4)
    same = ("model",)
    first = {"model": "m", "base_url": "http://127.0.0.1:8000/v1", "concurrency": 8}
    ledger.join("j", "a", ttl=60, spec=first, same=same)
    second = {**first, "base_url": "http://127.0.0.1:8001/v1", "concurrency": 2}
    ledger.join("j", "b", ttl=60, spec=second, same=same)
    job = ledger.get_job("j")
    assert job is not None and job.spec == first
    ledger.release("j", "a")
    ledger.release("j", "b")
    ledger.join("j", "c", ttl=60, spec=second, same=same)  # alone: its options are the job's
    job = ledger.get_job("j")
    assert job is not None and job.spec == second
