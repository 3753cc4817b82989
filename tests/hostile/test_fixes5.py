"""A hostile review of the fixes of 4 December (commits 19779b2..3e3fc20): attempts carried
across a stopped run, the ask-again count, the ledger URL rules, the read-only open, migrations
12 and 13, the request digest, validate(stored=True), answer_model on export. Each test fails on
the code as reviewed and passes once the defect is fixed."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from batchrun.cli import main
from tests.hostile.test_storage import _at_rest


def _cli(*args: str, env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(main, list(args), env=env)


def _one_job(home: Path, name: str = "in", lines: int = 3, **options: Any) -> Path:
    """A finished job under `home` (the in-process simulator); the ledger's path."""
    import batchrun

    path = home / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"id": n, "prompt": f"p{n}"}) + "\n" for n in range(lines)))
    batchrun.submit(path, home=home, backend="sim", concurrency=1, server_metrics="off", **options)
    return home / "jobs" / "ledger.db"


def _as_made_before_migration_12(db: Path) -> None:
    """The ledger as batchrun made it before 4 December: schema version 11, no items.charged,
    no items.answer_model (the columns migrations 12 and 13 add)."""
    with sqlite3.connect(db) as conn:
        conn.execute("DELETE FROM schema_migrations WHERE version >= 12")
        conn.execute("ALTER TABLE items DROP COLUMN answer_model")
        conn.execute("ALTER TABLE items DROP COLUMN charged")
    conn.close()
    _at_rest(db)


# --- a ledger an older batchrun made, read through a read-only URI -------------------------


@pytest.mark.parametrize("fmt", ["native", "openai"])
def test_export_reads_a_ledger_an_older_batchrun_made_through_a_read_only_uri(
    tmp_path: Path, fmt: str
) -> None:
    """README (--home/--ledger): `...?mode=ro&uri=true` "lets `status` and `export` read a
    ledger without write access: ... one an older batchrun made is read at its own version
    (not migrated: that would write)". `status` does; `export` fails, exit 2, with `no such
    column: items.answer_model (a ledger an older batchrun made, read-only: open it once with
    write access)`: the results query (rows.STORED_COLUMNS) names migration 13's column, which
    a version-11 ledger does not have. A colleague with read access cannot get the results."""
    home = tmp_path / "nightly"
    home.mkdir()
    db = _one_job(home)
    _as_made_before_migration_12(db)
    uri = f"sqlite:///file:{db}?mode=ro&uri=true"
    target = tmp_path / "copy.jsonl"
    result = _cli(
        "--home", str(tmp_path), "--ledger", uri, "export", "in", "--format", fmt, "-o", str(target)
    )
    assert result.exit_code == 0, result.output
    assert len(target.read_text().splitlines()) == 3


# --- a job's stored spec under today's rules ----------


def test_export_of_a_job_stored_with_max_cost_and_one_price(tmp_path: Path) -> None:
    """Until 4 December `--max-cost 5 --price-out 2` (one price, the other taken as 0) was
    accepted and stored with the job. Today's rule (--max-cost needs both prices) is applied
    to the stored spec too (jobs.job_spec -> spec_rules.validate(stored=True)), so `export`
    of that job -- finished, nothing to send -- is refused, exit 2, `--max-cost needs
    --price-in and --price-out`; export takes no run options, so the results of every such
    job cannot be written again. `stored=True` was added so that export needs no key
    variable; the rules that only guard a run to come should not bind a stored spec."""
    home = tmp_path / "h"
    home.mkdir()
    db = _one_job(home, max_tokens=20, max_cost=5.0, price_in=1.0, price_out=2.0)
    result, target = stored_then_exported(home, db, {"price_in": None}, tmp_path / "again.jsonl")
    assert result.exit_code == 0, result.output
    assert len(target.read_text().splitlines()) == 3


# --- SQLite URL options ----------


def test_a_plain_sqlite_urls_timeout_is_honoured_not_dropped(tmp_path: Path) -> None:
    """The storage fix refuses SQLite URL options that would be "dropped without a word"
    (dialect.parsed_url), and lets through those SQLAlchemy's driver reads from a plain URL
    (PLAIN_SQLITE_QUERY: timeout, ...). But `?timeout=60` is dropped without a word all the
    same: Dialect.engine passes connect_args={"timeout": 30}, which SQLAlchemy lays over the
    URL's, and the connect hook sets busy_timeout 30000. A ledger shared by many workers whose
    user raised the wait to 60 s still gives up ("database is locked") after 30."""
    from batchrun.ledger import Ledger

    url = f"sqlite:///{tmp_path / 'ledger.db'}?timeout=60"
    ledger = Ledger(url)
    with ledger.engine.connect() as conn:
        waits = conn.exec_driver_sql("PRAGMA busy_timeout").scalar()
    ledger.close()
    assert waits == 60_000, f"?timeout=60 accepted, but SQLite waits {waits} ms for a lock"


def test_a_plain_sqlite_url_with_a_driver_option_is_not_refused(tmp_path: Path) -> None:
    """`cached_statements` is one of the options SQLAlchemy's pysqlite driver reads from a
    plain URL (with timeout, isolation_level, detect_types, check_same_thread), but
    PLAIN_SQLITE_QUERY leaves it out: `sqlite:///ledger.db?cached_statements=500` is refused,
    exit 2, told to `add uri=true` -- which would make SQLite read it as a URI option it does
    not know, and SQLAlchemy not apply it."""
    db = _one_job(tmp_path)
    result = _cli(
        "--home", str(tmp_path), "--ledger", f"sqlite:///{db}?cached_statements=500", "status", "in"
    )
    assert result.exit_code == 0, result.output
    assert "3 done" in result.output


# --- config._moved: a job's own URL under a preset named at resume ----------


def test_a_jobs_base_url_stays_when_resume_names_its_servers_preset(tmp_path: Path) -> None:
    """README (presets): "`--base-url` and `--api-key-env` override a preset, wherever they are
    given: a spec file's URL and key variable stay when the command line names a preset
    (`--spec gpu.toml --backend vllm` sends to the file's server with its key)". A job loaded
    with `--base-url http://gpu.lan:8000/v1` is stored as backend `custom`; `resume JOB
    --backend vllm` (to get vLLM's quirks) drops the job's URL in config._moved (`custom` is
    "an earlier preset", so the new one "brings its own URL") and the run goes to vLLM's
    default, http://127.0.0.1:8000/v1: another server, maybe serving another model, whose
    answers are filed as this job's."""
    import batchrun
    from batchrun.jobs import Home, resolve_for_job
    from batchrun.ledger import Ledger

    path = tmp_path / "in.jsonl"
    path.write_text('{"id": 1, "prompt": "p"}\n')
    batchrun.submit(path, home=tmp_path, base_url="http://gpu.lan:8000/v1", model="m", run=False)
    ledger = Ledger(Home.at(tmp_path, None).ledger_url)
    job = ledger.get_job("in")
    ledger.close()
    assert job is not None
    spec = resolve_for_job(job, {"backend": "vllm"})
    assert spec.backend == "vllm"
    assert spec.base_url == "http://gpu.lan:8000/v1", f"the run would go to {spec.base_url}"


# --- the asks again inside one attempt ----------


@pytest.mark.anyio
async def test_every_ask_after_an_empty_stream_is_counted(tmp_path: Path) -> None:
    """README: `attempts` "counts every request sent for the item", and since 4 December the
    ask again after an empty stream is a request of its own (Completion.asked_again). When the
    plain ask meets a closed connection (OpenAICompatBackend._complete: `except
    ConnectionFailed`), a third request goes out -- the server got three -- but only one ask
    again is reported (`again` keeps the first reason; the third request is not in it):
    `attempts` says 2 and the log has 2 lines for 3 requests."""
    import httpx

    from tests.hostile.test_retry import POISON, attempt_lines, run_job
    from tests.unit.test_runner import ScriptedTransport, rows

    def empty_then_cut(request: httpx.Request, call: int) -> httpx.Response | None:
        if POISON not in request.content:
            return None
        if json.loads(request.content).get("stream"):
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=b"")
        if call == 2:  # the plain ask, on the connection the stream came on
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        return None

    transport = ScriptedTransport(empty_then_cut)
    ledger, _stats = await run_job(tmp_path, transport, create=True)
    sent = transport.calls["prompt number 1"]
    line = rows(ledger)[1]
    ledger.close()
    assert sent == 3
    assert line["status"] == "done"
    assert line["attempts"] == sent, f"{sent} requests sent, attempts says {line['attempts']}"
    assert len(attempt_lines(tmp_path, 2)) == sent


def test_uri_true_without_file_prefix_makes_no_new_ledger_beside_the_real_one(
    tmp_path: Path,
) -> None:
    """`--ledger sqlite:////srv/jobs/ledger.db?mode=ro` is refused now, told to "add uri=true";
    the user adds it: `sqlite:////srv/jobs/ledger.db?mode=ro&uri=true`. SQLite reads a URI
    filename only when it starts with `file:`, so SQLAlchemy's `/srv/jobs/ledger.db?mode=ro`
    is an ordinary file name: a new, empty ledger `ledger.db?mode=ro` is made beside the real
    one (a write, through a "read-only" URL), and `status` says `no such table: jobs (.../
    ledger.db)` of a ledger that has it. README: "Verbs that only read refuse a ledger file
    that does not exist (a mistyped path would otherwise get a new, empty one), whatever the
    URL's spelling". dialect.ledger_file checks the path without the query; parsed_url lets a
    uri=true URL without `file:` through."""
    db = _one_job(tmp_path)
    _at_rest(db)
    before = sorted(p.name for p in db.parent.iterdir())
    result = _cli(
        "--home", str(tmp_path), "--ledger", f"sqlite:///{db}?mode=ro&uri=true", "status", "in"
    )
    after = sorted(p.name for p in db.parent.iterdir())
    made = set(after) - set(before) - {"ledger.db-wal", "ledger.db-shm"}
    assert not made, f"a 'read-only' status made {made} beside the ledger"
    assert "no such table" not in result.output, result.output


# --- migration 13's column on PostgreSQL ----------


@pytest.mark.anyio
async def test_a_line_asking_a_long_model_name_does_not_abort_a_postgres_run(
    tmp_path: Path, postgres_server: str
) -> None:
    """Migration 13 stores the model each answer was asked of in `items.answer_model`,
    VARCHAR(200). The model comes from the line itself (any string), the job's --model, or the
    server's /v1/models (vLLM and llama-server name a model by its path when served from one).
    On PostgreSQL a name past 200 characters makes the group commit fail (`value too long for
    type character varying(200)`): the run aborts, and every resume sends the line and aborts
    again, where before the column existed the line was simply answered (or failed alone)."""
    from tests.postgres import fresh_database

    long_model = "/srv/models/" + "snapshots/" * 20 + "model-Q4_K_M.gguf"  # 229 characters
    assert len(long_model) > 200
    rows = [{"id": "a", "prompt": "p0"}, {"id": "b", "prompt": "p1", "model": long_model}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with fresh_database(postgres_server) as url:
        stats, counts = await run_sim_job(tmp_path, url)
    assert stats.aborted is None, stats.aborted
    assert counts["pending"] == 0 and counts["running"] == 0, counts


async def run_sim_job(tmp_path: Path, url: str) -> tuple[Any, dict[str, int]]:
    """Job `j` from `tmp_path/in.jsonl` on the ledger at `url`, run once against the
    simulator in fake time: its stats and counts."""
    from batchrun import jobs
    from batchrun.config import resolve
    from batchrun.jobs import Home
    from batchrun.ledger import Ledger
    from batchrun.run_state import RunnerSettings
    from batchrun.sim import SimModel, SimTransport
    from tests.fakes import FakeTime

    home = Home.at(tmp_path, url)
    ledger = Ledger(url)
    spec = resolve({"backend": "sim", "model": "sim-1", "concurrency": 1, "max_attempts": 1})
    jobs.create_job(ledger, "j", tmp_path / "in.jsonl", spec)
    fake = FakeTime()
    settings = RunnerSettings(sleep=fake.sleep, clock=fake.clock, drain_timeout=0.0)
    try:
        stats = await jobs.run_job(
            ledger,
            home,
            "j",
            spec,
            transport=SimTransport(SimModel()),
            settings=settings,
            handle_signals=False,
        )
        return stats, ledger.counts("j")
    finally:
        ledger.close()


def stored_then_exported(
    home: Path, db: Path, stored_as: dict[str, Any], target: Path
) -> tuple[Any, Path]:
    """Job `in`'s stored spec changed to `stored_as` (as an older batchrun stored it), then
    exported to `target`: the command's result."""
    with sqlite3.connect(db) as conn:
        (spec,) = conn.execute("SELECT spec FROM jobs WHERE name = 'in'").fetchone()
        stored = {**json.loads(spec), **stored_as}
        conn.execute("UPDATE jobs SET spec = ? WHERE name = 'in'", (json.dumps(stored),))
    conn.close()
    return _cli("--home", str(home), "export", "in", "-o", str(target)), target
