"""The core commands as a nightly user runs them (submit, resume, status, export, retry,
cancel, gc), attacked: each test fails on the code as reviewed, and names the defect."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from batchrun import jobs
from batchrun.config import resolve
from batchrun.jobs import Home
from batchrun.ledger import Ledger
from batchrun.run_state import RunnerSettings, RunStats
from batchrun.sim import SimConfig, SimModel, SimTransport


class StopAtFirst(httpx.AsyncBaseTransport):
    """The simulator; the first completion request brings a Ctrl-C (SIGINT to this process)
    while it is in flight, and is then answered within the drain grace. Bodies are kept."""

    def __init__(self, model: SimModel) -> None:
        self.sim = SimTransport(model)
        self.bodies: list[dict[str, Any]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            self.bodies.append(json.loads(request.content))
            if len(self.bodies) == 1:
                os.kill(os.getpid(), signal.SIGINT)
                await anyio.sleep(0.05)  # the handler sees the signal while this is on the wire
        return await self.sim.handle_async_request(request)


async def _run_once(
    tmp_path: Path, transport: httpx.AsyncBaseTransport, *, load: bool, **options: Any
) -> tuple[RunStats, dict[str, int]]:
    home = Home.at(tmp_path, None)
    ledger = Ledger(home.ledger_url)
    spec = resolve({"backend": "sim", "concurrency": 1, "server_metrics": "off", **options})
    if load:
        path = tmp_path / "in.jsonl"
        path.write_text(json.dumps({"id": "a", "prompt": "extract the name of bob"}) + "\n")
        jobs.create_job(ledger, "j", path, spec)
    settings = RunnerSettings(drain_timeout=5.0)
    stats = await jobs.run_job(
        ledger, home, "j", spec, transport=transport, settings=settings, handle_signals=True
    )
    jobs.finish(ledger, home, "j", spec)
    counts = ledger.counts("j")
    ledger.close()
    return stats, counts


def _first_asks(bodies: list[dict[str, Any]]) -> int:
    """Requests that were the line's own first ask (one user message, not a follow-up)."""
    return sum(len(b.get("messages", [])) == 1 for b in bodies)


@pytest.mark.anyio
async def test_ctrl_c_before_a_repair_is_sent_keeps_the_answer_already_received(
    tmp_path: Path,
) -> None:
    """Ctrl-C while a schema job's request is in flight: the request is answered within the
    10 s grace (paid), its answer breaks the schema, and the repair is not sent (the stop).
    README: in-flight requests get the grace to finish, then what finished is committed, and
    nothing committed is requested again. The answer received must survive the stop (kept, as
    a budget that refuses the repair keeps it); instead the item goes back to pending with
    nothing, and `resume` pays for the same first request again."""
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "required": ["name"]}))
    model = SimModel(SimConfig(json_styles={"broken": 1.0}))
    options = {"schema": str(schema), "max_tokens": 40}
    first = StopAtFirst(model)
    stats, _counts = await _run_once(tmp_path, first, load=True, **options)
    assert stats.interrupted and _first_asks(first.bodies) == 1
    again = StopAtFirst(model)
    again.bodies.append({})  # no signal this time
    await _run_once(tmp_path, again, load=False, **options)
    resent = _first_asks(again.bodies[1:])
    assert resent == 0, (
        f"resume sent the line's first request again ({resent}x): the answer received before "
        "the Ctrl-C was dropped"
    )


@pytest.mark.anyio
async def test_ctrl_c_before_a_longer_retry_keeps_the_truncated_answer(tmp_path: Path) -> None:
    """The same with --on-truncate retry-longer and no schema: the answer cut at max_tokens
    came back within the grace; the longer retry is not sent because of the stop, and the
    answer (done with finish_reason length, as when no longer retry is possible) is dropped:
    resume sends the max_tokens 8 request again."""
    model = SimModel(SimConfig(min_output_tokens=40, max_output_tokens=48))
    options = {"max_tokens": 8, "on_truncate": "retry-longer", "max_tokens_cap": 64}
    first = StopAtFirst(model)
    stats, _counts = await _run_once(tmp_path, first, load=True, **options)
    assert stats.interrupted
    assert [b.get("max_tokens") for b in first.bodies] == [8]
    again = StopAtFirst(model)
    again.bodies.append({})
    await _run_once(tmp_path, again, load=False, **options)
    asked = [b.get("max_tokens") for b in again.bodies[1:]]
    assert 8 not in asked, f"resume paid again for the max_tokens 8 answer: sent {asked}"


class RefuseFollowUps(httpx.AsyncBaseTransport):
    """The simulator, but a follow-up (a repair: more than one message) gets `status`:
    the key was revoked, or the endpoint went down, between an answer and its repair."""

    def __init__(self, model: SimModel, status: int | None) -> None:
        self.sim = SimTransport(model)
        self.status = status
        self.bodies: list[dict[str, Any]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            body = json.loads(request.content)
            self.bodies.append(body)
            if self.status is not None and len(body.get("messages", [])) > 1:
                return httpx.Response(self.status, json={"error": {"message": "key revoked"}})
        return await self.sim.handle_async_request(request)


@pytest.mark.anyio
async def test_a_job_stopped_at_a_repair_keeps_the_answer_already_received(
    tmp_path: Path,
) -> None:
    """The same loss when the stop is the endpoint's: the answer came back (paid), and its
    repair met a 401 (a key revoked mid-run), which stops the job (exit 3). README: "If a
    follow-up itself fails ... the answer the item already had stands"; only a budget's
    refusal keeps it in the code. The item goes back to pending empty, and `resume` (the key
    fixed) pays for its first request again."""
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "required": ["name"]}))
    model = SimModel(SimConfig(json_styles={"broken": 1.0}))
    options = {"schema": str(schema), "max_tokens": 40}
    first = RefuseFollowUps(model, 401)
    stats, _counts = await _run_once(tmp_path, first, load=True, **options)
    assert stats.aborted and _first_asks(first.bodies) == 1
    again = RefuseFollowUps(model, None)
    await _run_once(tmp_path, again, load=False, **options)
    resent = _first_asks(again.bodies)
    assert resent == 0, f"resume sent the line's first request again ({resent}x)"


# --- the ledger given as an SQLite URI -------------------------------------------------------


def _one_job(home: Path) -> None:
    import batchrun

    path = home / "in.jsonl"
    path.write_text("".join(json.dumps({"id": n, "prompt": f"p{n}"}) + "\n" for n in range(3)))
    batchrun.submit(path, home=home, backend="sim", concurrency=1, server_metrics="off")


def test_status_and_export_read_a_ledger_given_as_a_read_only_sqlite_uri(tmp_path: Path) -> None:
    """A dashboard or a colleague reads the nightly ledger read-only, as SQLite URIs allow
    (`sqlite:///file:/srv/jobs/ledger.db?mode=ro&uri=true`; the dialect even takes care not to
    make a folder named `file:` for such a URL). `status` and `export` only read, yet both
    refuse: `no ledger at file:/.../ledger.db?mode=ro&uri=true`, exit 2. The check that a
    read-only verb does not make an empty ledger takes the URI for a path."""
    import batchrun

    _one_job(tmp_path)
    db = tmp_path / "jobs" / "ledger.db"
    assert db.exists()
    uri = f"sqlite:///file:{db}?mode=ro&uri=true"
    detail = batchrun.status("in", home=tmp_path, ledger=uri)
    assert detail["counts"]["done"] == 3
    out = batchrun.export("in", home=tmp_path, ledger=uri, path=tmp_path / "copy.jsonl")
    assert len(out.read_text().splitlines()) == 3


def test_a_read_only_verb_makes_no_ledger_under_a_mistyped_driver_url(tmp_path: Path) -> None:
    """README: verbs that only read "refuse a home with no ledger rather than making an
    empty one". Given the same SQLite file as `sqlite+pysqlite:///...` (SQLAlchemy's explicit
    driver name, as many deployment configs write it), a mistyped path gets a new folder and an
    empty ledger, and `status` says "no jobs yet" (exit 0) instead of naming the mistake."""
    from click.testing import CliRunner

    from batchrun.cli import main

    url = f"sqlite+pysqlite:///{tmp_path / 'typo' / 'ledger.db'}"
    result = CliRunner().invoke(main, ["--home", str(tmp_path), "--ledger", url, "status"])
    assert not (tmp_path / "typo").exists(), "an empty ledger was made by `status`"
    assert result.exit_code == 2, result.output


# --- input and output shapes -----------------------------------------------------------------


def test_a_prompt_line_with_a_meta_field_named_body_is_not_refused(tmp_path: Path) -> None:
    """README (Input): request fields override the job's defaults; "other fields (`sku`
    above) are kept as meta and returned in the output". An email-summarising job's lines
    carry the email as `body`: `{"id": "e1", "prompt": "Summarise", "body": "Hi Bob..."}`.
    The reader takes any line with a `body` key for the OpenAI Batch shape and refuses the
    whole file: `batch 'url' must be one of /v1/chat/completions, ... got None` (exit 2)."""
    import batchrun

    path = tmp_path / "mail.jsonl"
    rows = [
        {"id": "e1", "prompt": "Summarise this email", "body": "Hi Bob, lunch on Friday?"},
        {"id": "e2", "prompt": "Summarise this email", "body": "The invoice is attached."},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = batchrun.submit(path, home=tmp_path, backend="sim", server_metrics="off")
    assert report.ok
    results = list(batchrun.results("mail", home=tmp_path))
    assert [r.meta for r in results] == [{"body": rows[0]["body"]}, {"body": rows[1]["body"]}]


def test_openai_export_names_the_model_a_line_asked_for_not_the_jobs(tmp_path: Path) -> None:
    """A line's own `model` overrides the job's (README, Input), and the request goes to
    that model. `export --format openai` writes the job's `--model` into every response
    body, so a line answered by `big-model` is reported as answered by `small-model`: a
    pipeline that splits results (or costs) by the OpenAI shape's `model` gets them wrong."""
    import batchrun

    path = tmp_path / "in.jsonl"
    rows = [{"id": "a", "prompt": "hi", "model": "big-model"}, {"id": "b", "prompt": "hello"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    class Seen(httpx.AsyncBaseTransport):
        def __init__(self) -> None:
            self.sim = SimTransport(SimModel())
            self.models: list[str] = []

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            if request.method == "POST":
                self.models.append(json.loads(request.content)["model"])
            return await self.sim.handle_async_request(request)

    home = Home.at(tmp_path, None)
    ledger = Ledger(home.ledger_url)
    spec = resolve({"backend": "sim", "model": "small-model", "server_metrics": "off"})
    jobs.create_job(ledger, "in", path, spec)
    seen = Seen()
    anyio.run(lambda: jobs.run_job(ledger, home, "in", spec, transport=seen, handle_signals=False))
    jobs.finish(ledger, home, "in", spec)
    ledger.close()
    assert sorted(seen.models) == ["big-model", "small-model"]  # line a went to big-model
    out = batchrun.export("in", fmt="openai", home=tmp_path)
    by_id = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert by_id["b"]["response"]["body"]["model"] == "small-model"
    assert by_id["a"]["response"]["body"]["model"] == "big-model", (
        "line a was answered by big-model, exported as "
        + repr(by_id["a"]["response"]["body"]["model"])
    )


# --- gc ----------------------------------------------------------------------------------------


def _old_job_and_a_busy_vacuum(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A finished job, untouched for weeks; gc's VACUUM then meets another process holding
    the ledger's write lock (another cron's big ingest) past the busy timeout (cut to 0.2 s
    here so the test is fast). Returns the undo."""
    import sqlite3

    from batchrun.ledger import dialect

    _one_job(tmp_path)
    db = tmp_path / "jobs" / "ledger.db"
    with sqlite3.connect(db) as conn:  # ... weeks go by
        conn.execute("UPDATE jobs SET updated_at = 0")
    monkeypatch.setattr(dialect, "BUSY_TIMEOUT_MS", 200)
    vacuum = dialect.Dialect.reclaim_space

    def busy_vacuum(self: Any, engine: Any) -> None:
        other = sqlite3.connect(db, isolation_level=None)  # another process is writing
        other.execute("BEGIN IMMEDIATE")
        try:
            vacuum(self, engine)
        finally:
            other.execute("ROLLBACK")
            other.close()

    monkeypatch.setattr(dialect.Dialect, "reclaim_space", busy_vacuum)
    return lambda: monkeypatch.setattr(dialect.Dialect, "reclaim_space", vacuum)


def test_gc_whose_vacuum_meets_a_busy_ledger_says_so_without_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README (Storage faults): a ledger fault ends the command with one line and exit 2,
    "never a traceback". VACUUM runs on the driver's raw connection, outside the guard that
    turns driver errors into LedgerError: `sqlite3.OperationalError: database is locked`
    escapes `batchrun gc` as a traceback (exit 1)."""
    from click.testing import CliRunner

    from batchrun.cli import main

    _old_job_and_a_busy_vacuum(tmp_path, monkeypatch)
    result = CliRunner().invoke(main, ["--home", str(tmp_path), "gc", "--older-than", "30d"])
    assert result.exit_code == 2, (
        f"exit {result.exit_code}: {type(result.exception).__name__}: {result.exception}"
    )


def test_gc_whose_vacuum_failed_still_removes_the_files_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same fault, then the next night's gc: the first gc had committed the collection
    before its VACUUM failed, so its jobs' results files and logs were never reached; the
    next gc passes over jobs already collected, and those files are never removed, against
    README's "removes jobs untouched for that long: their items, results files and logs"."""
    import batchrun

    results, log = tmp_path / "outputs" / "in.jsonl", tmp_path / "logs" / "in.log"
    undo = _old_job_and_a_busy_vacuum(tmp_path, monkeypatch)
    assert results.exists() and log.exists()
    with contextlib.suppress(Exception):  # today: the driver's "database is locked"
        batchrun.gc("30d", home=tmp_path)
    undo()  # the ingest is over
    batchrun.gc("30d", home=tmp_path)  # the next night's gc
    assert batchrun.status("in", home=tmp_path)["state"].startswith("collected by gc")
    left = [p.name for p in (results, log) if p.exists()]
    assert not left, f"a collected job's files are never removed: {left}"
