"""The ledger and the files batchrun writes, under faults (README: "How it keeps work safe",
"Storage faults", "Output", `--home`/`--ledger`, "Several workers, several machines"), attacked:
each test fails on the code as reviewed, and names the defect it shows."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import sqlite3
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from batchrun.cli import main

SECRET = "Hunter2Secret"  # a ledger password: never printed


def _cli(*args: str, env: dict[str, str] | None = None) -> Any:
    """The real command line, in this process: exit code, output, and what it raised."""
    return CliRunner().invoke(main, list(args), env=env)


def _one_job(home: Path, name: str = "in", lines: int = 3) -> Path:
    """A finished job under `home` (the in-process simulator), its ledger closed."""
    import batchrun

    path = home / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"id": n, "prompt": f"p{n}"}) + "\n" for n in range(lines)))
    batchrun.submit(path, home=home, backend="sim", concurrency=1, server_metrics="off")
    return home / "jobs" / "ledger.db"


def _at_rest(db: Path) -> None:
    """The ledger as every process left it after closing: no -wal or -shm beside it."""
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    for suffix in ("-wal", "-shm"):
        Path(f"{db}{suffix}").unlink(missing_ok=True)


def _no_write_access() -> Callable[[], None]:
    """preexec_fn: the command runs as a user without write access to files it does not own
    (root keeps its uid, but loses the capabilities that let it write any file)."""

    def drop() -> None:
        if os.geteuid() != 0:
            return
        libc = ctypes.CDLL(None, use_errno=True)
        pr_capbset_drop = 24
        for cap in (1, 2, 3):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER
            if libc.prctl(pr_capbset_drop, cap, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")

    return drop


def _run_cli(home: Path, *args: str, preexec: Callable[[], None] | None = None) -> Any:
    return subprocess.run(
        [sys.executable, "-m", "batchrun", "--home", str(home), *args],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=preexec,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )


def _start_cli(home: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "batchrun", "--home", str(home), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )


@contextlib.contextmanager
def _read_only(*paths: Path) -> Iterator[None]:
    modes = {p: stat.S_IMODE(p.stat().st_mode) for p in paths}
    for p in paths:
        p.chmod(0o555 if p.is_dir() else 0o444)
    try:
        yield
    finally:
        for p, mode in modes.items():
            p.chmod(mode)


def _can_drop_write_access(tmp_path: Path) -> None:
    probe = tmp_path / "probe"
    probe.mkdir()
    with _read_only(probe):
        done = subprocess.run(
            ["sh", "-c", f"touch {probe}/x"], preexec_fn=_no_write_access(), capture_output=True
        )
    if done.returncode == 0:
        pytest.skip("cannot take write access away on this machine")


# --- reading a ledger without write access --------------------------------------------------------


def test_a_read_only_uri_reads_a_ledger_at_rest_in_a_folder_without_write_access(
    tmp_path: Path,
) -> None:
    """README (--home/--ledger): `sqlite:///file:/srv/jobs/ledger.db?mode=ro&uri=true` "lets
    `status` and `export` read a ledger without write access". A ledger in WAL mode that every
    process closed has no -shm file, and SQLite cannot open it read-only without making one:
    a colleague without write access to jobs/ (or a read-only mount, a backup) gets
    `ledger error while opening the ledger: attempt to write a readonly database`, exit 2, for
    every ledger at rest. (SQLite reads such a file with `immutable=1`, or the ledger could
    leave its journal mode so that a reader needs no -shm.)"""
    _can_drop_write_access(tmp_path)
    home = tmp_path / "nightly"
    home.mkdir()
    db = _one_job(home)
    _at_rest(db)
    reader = tmp_path / "reader"  # the colleague's own home, for export's file
    reader.mkdir()
    uri = f"sqlite:///file:{db}?mode=ro&uri=true"
    with _read_only(db, db.parent):
        shown = _run_cli(reader, "--ledger", uri, "status", "in", preexec=_no_write_access())
        copy = reader / "copy.jsonl"
        exported = _run_cli(
            reader, "--ledger", uri, "export", "in", "-o", str(copy), preexec=_no_write_access()
        )
    assert shown.returncode == 0, shown.stderr
    assert "3 done" in shown.stdout, shown.stdout
    assert exported.returncode == 0, exported.stderr
    assert len(copy.read_text().splitlines()) == 3


def test_a_read_only_uri_reads_a_ledger_an_older_batchrun_made(tmp_path: Path) -> None:
    """The same promise, for a ledger one migration behind (the nightly host has not run the
    new batchrun yet; a backup from last month). Opening it runs the due migration first, a
    write, even for `status` through a `mode=ro` URI: `attempt to write a readonly database`,
    exit 2, without a word on why (the schema is old). A reader could read it at its own
    version (the missing columns are new ones), or at least be told to open it once with write
    access."""
    db = _one_job(tmp_path)
    with sqlite3.connect(db) as conn:  # the ledger before migration 11
        conn.execute("DELETE FROM schema_migrations WHERE version = 11")
    conn.close()
    _at_rest(db)
    uri = f"sqlite:///file:{db}?mode=ro&uri=true"
    result = _cli("--home", str(tmp_path), "--ledger", uri, "status", "in")
    assert result.exit_code == 0, result.output
    assert "3 done" in result.output


# --- ledger URLs ----------------------------------------------------------------------------------


def test_a_ledger_url_with_a_port_that_is_not_a_number_is_one_line_and_exit_2(
    tmp_path: Path,
) -> None:
    """README (Storage faults): never a traceback; exit 2 for a usage error. A ledger URL whose
    port is not a number (an unexpanded `$PGPORT` in a cron line or a systemd unit) escapes as
    SQLAlchemy's `ValueError: invalid literal for int() with base 10` with a traceback, exit 1
    ("some items failed"). An endpoint URL with such a port is refused cleanly (README: "a port
    that is not a number ... is refused before anything runs (exit 2)"); the ledger URL is
    parsed in `dialect.home_expanded`, which catches only ArgumentError."""
    url = f"postgresql+psycopg://batch:{SECRET}@127.0.0.1:$PGPORT/batchrun"
    result = _cli("--home", str(tmp_path), "--ledger", url, "status")
    assert not isinstance(result.exception, ValueError), repr(result.exception)
    assert result.exit_code == 2, (result.exit_code, result.output, repr(result.exception))
    assert SECRET not in result.output


def test_a_password_with_an_unescaped_at_sign_is_not_printed(tmp_path: Path) -> None:
    """A password holding `@` written into the URL as it is (`batch:p@ss...@host`, the commonest
    mistake with database URLs): the part after the first `@` becomes the host, and the error
    prints it: `failed to resolve host 'ss-Hunter2Secret@127.0.0.1'`. `shown_url` hides only
    what SQLAlchemy parsed as the password. README's secrets section: a `user:password@` is
    shown as `***@` wherever batchrun shows a URL."""
    url = f"postgresql+psycopg://batch:p@ss-{SECRET}@127.0.0.1:5432/batchrun"
    result = _cli("--home", str(tmp_path), "--ledger", url, "status")
    assert result.exit_code == 2, result.output
    assert SECRET not in result.output, result.output


def test_a_password_in_the_ledger_urls_query_is_not_printed(
    tmp_path: Path, postgres_server: str
) -> None:
    """libpq takes the password as a URL parameter too (`postgresql+psycopg://batch@db/x?
    password=...`, how many secret stores hand out URLs). `status` of a mistyped job name
    says `no job named 'nosuch' in postgresql+psycopg://...?password=Hunter2Secret` on the
    terminal (cron mails it): `shown_url` hides only the `user:password@` part."""
    from tests.postgres import fresh_database

    with fresh_database(postgres_server) as url:
        with_password = f"{url}?password={SECRET}"
        result = _cli("--home", str(tmp_path), "--ledger", with_password, "status", "nosuch")
        assert result.exit_code == 2, result.output
        assert "no job named" in result.output
        assert SECRET not in result.output, result.output


def test_sqlite_uri_parameters_without_uri_true_are_not_silently_dropped(tmp_path: Path) -> None:
    """README: "An SQLite URI is opened as written". Written without `uri=true`, its
    parameters are dropped with a two-line SQLAlchemy warning: `sqlite:////srv/ledger.db?
    mode=ro`, meant as a read-only dashboard's URL, writes to the ledger (`retry` puts the
    failed items back to pending here), and `sqlite:///file:/srv/ledger.db?mode=ro` makes a
    folder named `file:` in the working directory with a new, empty ledger in it (the very
    fault the Status notes say was fixed, with `uri=true`). Either should be refused, exit 2."""
    db = _one_job(tmp_path)
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE items SET status = 'failed', error = 'boom' WHERE line = 1")
    conn.close()
    result = _cli("--home", str(tmp_path), "--ledger", f"sqlite:///{db}?mode=ro", "retry", "in")
    with sqlite3.connect(db) as conn:
        statuses = [s for (s,) in conn.execute("SELECT status FROM items ORDER BY line")]
    conn.close()
    assert statuses[0] == "failed", f"a mode=ro ledger was written: {statuses} ({result.output})"
    assert result.exit_code == 2, result.output

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    before = os.getcwd()
    os.chdir(cwd)
    try:
        typo = f"sqlite:///file:{db}?mode=ro"
        result = _cli("--home", str(tmp_path), "--ledger", typo, "resume", "in")
    finally:
        os.chdir(before)
    assert result.exit_code == 2, result.output
    assert not (cwd / "file:").exists(), "a folder named file: was made, with a new ledger"


# --- ledger versions ------------------------------------------------------------------------------


def test_a_ledger_from_a_newer_batchrun_is_refused_not_written(tmp_path: Path) -> None:
    """A ledger that a newer batchrun migrated (schema version 1000, say a new status or column
    whose meaning this code does not know), opened by an older batchrun on another host or in
    another virtualenv: migrations only look for versions they lack, so the old code loads
    and runs jobs into it as if it were its own. It should stop with one line (the ledger is
    newer than this batchrun: upgrade), exit 2, before writing anything."""
    db = _one_job(tmp_path)
    with sqlite3.connect(db) as conn:
        conn.execute(
            "INSERT INTO schema_migrations VALUES (1000, 'a newer batchrun''s migration', 0)"
        )
    conn.close()
    path = tmp_path / "new.jsonl"
    path.write_text(json.dumps({"id": "x", "prompt": "hello"}) + "\n")
    result = _cli("--home", str(tmp_path), "submit", str(path), "--backend", "sim", "--no-run")
    with sqlite3.connect(db) as conn:
        names = [n for (n,) in conn.execute("SELECT name FROM jobs ORDER BY name")]
    conn.close()
    assert names == ["in"], f"an older batchrun loaded a job into a newer ledger: {names}"
    assert result.exit_code == 2, result.output


# --- errors name the file -------------------------------------------------------------------------


def test_a_corrupt_ledger_error_names_the_ledger_file(tmp_path: Path) -> None:
    """README (Storage faults): "a read-only or corrupt ledger ... each end the command with
    one line naming the file and the reason". With BATCHRUN_LEDGER set in the environment (or
    several homes), the file is what the user needs to find; the line says only
    `ledger error while counting items: database disk image is malformed`."""
    db = _one_job(tmp_path)
    _at_rest(db)
    conn = sqlite3.connect(db)
    pages = conn.execute("PRAGMA page_count").fetchone()[0]
    page = conn.execute("PRAGMA page_size").fetchone()[0]
    conn.close()
    with db.open("r+b") as f:  # garbage over the items' pages, the header left whole
        for n in range(3, pages):
            f.seek(n * page + 8)
            f.write(b"\xff" * (page - 16))
    result = _cli("--home", str(tmp_path), "status")  # every job, as a morning check does
    assert result.exit_code == 2, result.output
    assert "malformed" in result.output, result.output
    assert str(db) in result.output, result.output


# --- gc -------------------------------------------------------------------------------------------


def test_gc_all_whose_vacuum_failed_still_removes_the_files_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README (Storage faults): "if that VACUUM finds the ledger busy ..., it says so (exit 2),
    and the next `gc` removes the collected jobs' files all the same". With `gc --all` the
    collection deletes the jobs' rows outright before the VACUUM; the next gc finds the
    collected jobs only by `collected_at` on rows that are gone, so their results files and
    logs are never removed (a VACUUM on a full disk, the usual reason to run gc, fails the
    same way: it needs room for a copy)."""
    import batchrun
    from tests.hostile.test_core import _old_job_and_a_busy_vacuum

    undo = _old_job_and_a_busy_vacuum(tmp_path, monkeypatch)
    results, log = tmp_path / "outputs" / "in.jsonl", tmp_path / "logs" / "in.log"
    assert results.exists() and log.exists()
    first = _cli("--home", str(tmp_path), "gc", "--all")
    assert first.exit_code == 2, first.output
    undo()
    batchrun.gc("30d", everything=True, home=tmp_path)  # the next night's gc
    left = [p.name for p in (results, log) if p.exists()]
    assert not left, f"a collected job's files are never removed: {left}"


# --- PostgreSQL -----------------------------------------------------------------------------------


def test_a_connection_dropped_during_the_analyze_after_a_load_is_one_line(
    tmp_path: Path, postgres_server: str
) -> None:
    """README ("The database restarting"): a refused or dropped connection is waited out, or
    ends with exit 3 (one line, no traceback). After a load commits, `Postgres.loaded` runs
    `ANALYZE items` on an engine connection of its own, outside `storage_errors`: a connection
    dropped there (a restart, pg_terminate_backend, a failover; ANALYZE of a big table takes
    seconds) escapes as `sqlalchemy.exc.OperationalError: (psycopg.errors.AdminShutdown)`,
    a traceback and exit 1, though the job was loaded. Here another session holds the lock
    ANALYZE needs (SHARE UPDATE EXCLUSIVE: inserts pass it), and the submit's backend is
    terminated while it waits there."""
    import psycopg

    from tests.postgres import fresh_database

    with fresh_database(postgres_server) as url:
        first = tmp_path / "first.jsonl"
        first.write_text(json.dumps({"id": "a", "prompt": "hello"}) + "\n")
        made = _run_cli(tmp_path, "--ledger", url, "submit", str(first), "--no-run")
        assert made.returncode == 0, made.stderr  # the schema is there
        plain = url.replace("postgresql+psycopg://", "postgresql://")
        second = tmp_path / "second.jsonl"
        second.write_text(
            "".join(json.dumps({"id": n, "prompt": f"p{n}"}) + "\n" for n in range(50))
        )
        with psycopg.connect(plain) as holder, psycopg.connect(plain, autocommit=True) as admin:
            holder.execute("LOCK TABLE items IN SHARE UPDATE EXCLUSIVE MODE")
            proc = _start_cli(tmp_path, "--ledger", url, "submit", str(second), "--no-run")
            try:
                waiting = None
                for _ in range(600):  # until its ANALYZE waits for the lock
                    waiting = admin.execute(
                        "SELECT pid FROM pg_stat_activity WHERE query = 'ANALYZE items' "
                        "AND wait_event_type = 'Lock'"
                    ).fetchone()
                    if waiting or proc.poll() is not None:
                        break
                    time.sleep(0.05)
                assert waiting, "the submit never reached its ANALYZE"
                admin.execute("SELECT pg_terminate_backend(%s)", (waiting[0],))
                _out, err = proc.communicate(timeout=120)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            holder.rollback()
        assert "Traceback" not in err, err[-1500:]
        # The load committed; the statistics are autovacuum's to make later: it is loaded.
        assert proc.returncode == 0, (proc.returncode, err[-500:])
        assert "loaded 50 items" in err


# --- the default ledger's place -------------------------------------------------------------------


@pytest.mark.parametrize("folder", ["night?1", "run%41"])
def test_the_default_ledger_lies_in_the_homes_jobs_folder_whatever_its_name(
    tmp_path: Path, folder: str
) -> None:
    """README: `--home DIR` holds `jobs/ outputs/ logs/`, the ledger defaulting to
    `sqlite:///HOME/jobs/ledger.db`. `Home.at` pastes the path into that URL as text, so the
    URL parser reads the home's name: under a home named `night?1` the ledger is a file named
    `night` beside it (`?1/jobs/ledger.db` taken for a query), which every home `night?N`
    shares (one's jobs resumed by the others'); under `run%41` it is `runA/jobs/ledger.db`, a
    folder made outside the home. (sqlalchemy's `URL.create(database=...)` builds it whole.)"""
    home = tmp_path / folder
    home.mkdir()
    _one_job(home)
    made = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert (home / "jobs" / "ledger.db").exists(), f"the ledger is elsewhere: {made}"
    assert not (tmp_path / "night").exists() and not (tmp_path / "runA").exists(), made


def _terminate_when_waiting(admin: Any, proc: subprocess.Popen[str], query_like: str) -> None:
    """Terminate the backend of `proc`'s session once it waits for a lock in `query_like`."""
    for _ in range(600):
        waiting = admin.execute(
            "SELECT pid FROM pg_stat_activity WHERE query LIKE %s AND wait_event_type = 'Lock'",
            (query_like,),
        ).fetchone()
        if waiting:
            admin.execute("SELECT pg_terminate_backend(%s)", (waiting[0],))
            return
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    raise AssertionError(f"the command never waited in {query_like!r}")


def test_a_connection_dropped_as_a_run_starts_is_waited_out_like_one_mid_run(
    tmp_path: Path, postgres_server: str
) -> None:
    """README ("The database restarting"): "A worker whose ledger call finds PostgreSQL out of
    reach (a refused or dropped connection, the server shutting down or starting up) waits and
    tries again every second ... Past --outage-timeout ... exit 3". Only the runner's calls
    wait: the ones a run makes as it starts (joining the job and looking for answers to reuse
    in `reuse.prepare`, the counts, the chunks of hosted batches) run bare, so a connection
    dropped then (a restart as the 2 a.m. cron starts, a failover) ends the night's run at once:
    `aborted: ledger error while looking for answers to reuse: terminating connection due to
    administrator command`, exit 3, with `--outage-timeout 30` unspent. Here another session
    holds the job's row lock so that the moment is certain, and the run's backend is
    terminated while it waits for it."""
    import psycopg

    from tests.postgres import fresh_database

    with fresh_database(postgres_server) as url:
        inp = tmp_path / "nightly.jsonl"
        inp.write_text("".join(json.dumps({"id": n, "prompt": f"p{n}"}) + "\n" for n in range(20)))
        made = _run_cli(tmp_path, "--ledger", url, "submit", str(inp), "--no-run")
        assert made.returncode == 0, made.stderr
        plain = url.replace("postgresql+psycopg://", "postgresql://")
        with psycopg.connect(plain) as holder, psycopg.connect(plain, autocommit=True) as admin:
            holder.execute("SELECT name FROM jobs WHERE name = 'nightly' FOR UPDATE")
            proc = _start_cli(
                tmp_path,
                "--ledger",
                url,
                "resume",
                "nightly",
                "--backend",
                "sim",
                "--outage-timeout",
                "30",
                "--quiet",
            )
            try:
                _terminate_when_waiting(admin, proc, "%FROM jobs%FOR UPDATE%")
                holder.rollback()  # the database is back at once
                _out, err = proc.communicate(timeout=120)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        assert proc.returncode == 0, err
        assert "Traceback" not in err
        lines = (tmp_path / "outputs" / "nightly.jsonl").read_text().splitlines()
        assert [json.loads(line)["status"] for line in lines] == ["done"] * 20


def test_a_database_out_of_reach_is_said_on_one_line(tmp_path: Path) -> None:
    """README (Storage faults): "one line naming the file and the reason". PostgreSQL's
    messages carry their own line breaks (`Connection refused` then a tab and `Is the server
    running on that host and accepting TCP/IP connections?`; `CONTEXT:` lines), printed as
    they are: the error spans two lines and more, and a log reader or cron mail filter that
    takes the last line of stderr gets a hint without the error."""
    with __import__("socket").socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"postgresql+psycopg://batch:{SECRET}@127.0.0.1:{port}/batchrun"
    result = _cli("--home", str(tmp_path), "--ledger", url, "status")
    assert result.exit_code in (2, 3), result.output
    assert "refused" in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert SECRET not in result.output
