"""A hostile review of the Python API (`import batchrun`) as a notebook user and a pipeline
author would use it. Each test fails on the code it was written against and shows a defect
a user would hit; it passes once the defect is fixed."""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import threading
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import batchrun
from batchrun.ledger import Ledger

SIM: dict[str, Any] = {"backend": "sim", "sim_options": {"ttft_ms": 0.0, "tpot_ms": 0.0}}


def rows(n: int, tag: str = "p") -> list[dict[str, Any]]:
    return [{"id": f"{tag}{i}", "prompt": f"Say {tag} {i}."} for i in range(1, n + 1)]


def attempts(home: Path, job: str) -> list[dict[str, Any]]:
    log = (home / "logs" / f"{job}.log").read_text().splitlines()
    return [entry for entry in map(json.loads, log) if entry["event"] == "attempt"]


# --- option checks ------------------------------------------------------------------------------


@pytest.mark.parametrize("option", ["timeout", "lease", "temperature", "top_p"])
def test_a_nan_option_is_refused_naming_its_keyword(tmp_path: Path, option: str) -> None:
    # `temperature=df.temperature[0]` where the cell is empty: NaN. It passes every `<= 0`
    # check; `timeout`/`lease` then crash deep in the run (a bare ExceptionGroup/ValueError),
    # and `temperature`/`top_p` are stored as null, so the job refuses its own first run as
    # "being run by 1 other worker(s) that ask for other answers"
    with pytest.raises(batchrun.UsageError, match=rf"^{option} must be"):
        batchrun.submit(rows(2), job="nan", home=tmp_path, **{option: float("nan")}, **SIM)


@pytest.mark.parametrize(
    ("options", "keyword"),
    [
        pytest.param({"max_tokens": np.int64(8)}, "max_tokens", id="numpy-int"),
        pytest.param({"endpoints": {"a=http://sim.invalid/v1,backend=sim"}}, "endpoints", id="set"),
        pytest.param({"sim_options": {"models": {"m"}}}, "sim_options", id="set-in-sim-options"),
    ],
)
def test_an_option_of_the_wrong_type_with_rows_is_a_usage_error_naming_it(
    tmp_path: Path, options: dict[str, Any], keyword: str
) -> None:
    # the same options with a JSONL path give "max_tokens must be int, got np.int64(8)"; with
    # rows, the job name's digest (row_input.write_rows) dumps the raw options first and a
    # bare orjson TypeError ("Type is not JSON serializable: numpy.int64") reaches the caller
    given = {"backend": "sim", **options}
    with pytest.raises(batchrun.UsageError, match=keyword):
        batchrun.submit(rows(2), home=tmp_path, **given)


def test_a_numpy_float_option_works_with_rows_as_it_does_with_a_file(tmp_path: Path) -> None:
    # np.float64 is a float: a JSONL path takes `temperature=np.float64(0.5)`; rows crash
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows(2)))
    assert batchrun.submit(path, home=tmp_path, temperature=np.float64(0.5), **SIM).ok
    report = batchrun.submit(rows(2, "r"), home=tmp_path, temperature=np.float64(0.5), **SIM)
    assert report.ok


@pytest.mark.parametrize(
    ("call", "keyword"),
    [
        pytest.param(lambda home: batchrun.gc(30, home=home), "older_than", id="gc-int"),
        pytest.param(
            lambda home: batchrun.submit(rows(1), home=home, spec=5, **SIM), "spec", id="spec"
        ),
        pytest.param(lambda home: batchrun.export("j", path=5, home=home), "path", id="path"),
        pytest.param(lambda home: batchrun.list_jobs(home=5), "home", id="home"),
    ],
)
def test_arguments_of_the_wrong_kind_name_their_keyword(
    tmp_path: Path, call: Any, keyword: str
) -> None:
    # README: errors are BatchrunErrors, bad options named by their keyword (job=123 and a
    # source of the wrong kind already are); these raise a bare TypeError from inside
    batchrun.submit(rows(1), job="j", home=tmp_path, **SIM)
    with pytest.raises(batchrun.UsageError, match=keyword):
        call(tmp_path)


def test_gc_takes_a_timedelta(tmp_path: Path) -> None:
    # gc(timedelta(days=30)) raised a bare TypeError; a timedelta is the Python way to say it
    batchrun.submit(rows(1), job="j", home=tmp_path, **SIM)
    assert batchrun.gc(datetime.timedelta(days=30), home=tmp_path).jobs == []
    assert batchrun.gc(datetime.timedelta(0), home=tmp_path).jobs == ["j"]


# --- callbacks ----------------------------------------------------------------------------------


def test_a_callback_that_raises_leaves_no_live_worker_behind(tmp_path: Path) -> None:
    # A notebook's progress callback with a bug raises at its first call (where the run starts).
    # The run registered its worker already and never gives it back: `status` says the job is
    # running in this process, and the user's next cell (another max_tokens) is refused as
    # "being run by 1 other worker(s)" until the lease runs out.
    def broken(update: batchrun.ProgressUpdate) -> None:
        raise RuntimeError("bug in my progress bar")

    with pytest.raises(RuntimeError, match="bug in my progress bar"):
        batchrun.submit(rows(5), job="cb", home=tmp_path, on_progress=broken, **SIM)
    workers = batchrun.status("cb", home=tmp_path)["workers"]
    assert all(w["state"] != "running" for w in workers), workers
    assert batchrun.resume("cb", home=tmp_path, max_tokens=16, **SIM).ok


def test_a_callback_that_raises_keeps_every_answer_already_received(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # README: "An exception raised by a callback stops the run (what finished is committed)".
    # Answers that came while a group was being committed are dropped when the callback then
    # raises (the writer commits what it holds only on a cancel, not on an error), and the
    # resume pays for them again. The ledger is made a little slow so that answers do come
    # during the commit, as they do on a busy ledger.
    real = Ledger.record
    slow = threading.Event()

    def slow_record(self: Ledger, *args: Any, **kwargs: Any) -> Any:
        if not slow.is_set():
            slow.set()
            threading.Event().wait(0.3)  # in the ledger's thread: the event loop goes on
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Ledger, "record", slow_record)

    def stop_after_first_commit(update: batchrun.ProgressUpdate) -> None:
        if update.done:
            raise RuntimeError("enough")

    with pytest.raises(RuntimeError, match="enough"):
        batchrun.submit(
            rows(200),
            job="cb",
            home=tmp_path,
            concurrency=4,
            on_progress=stop_after_first_commit,
            backend="sim",
            sim_options={"ttft_ms": 20.0, "tpot_ms": 0.0},  # the job outlasts a commit
        )
    answered = {a["id"] for a in attempts(tmp_path, "cb") if a["status"] == "ok"}
    kept = {r.id for r in batchrun.results("cb", home=tmp_path) if r.status == "done"}
    assert answered - kept == set(), f"{len(answered - kept)} answers received, then dropped"


# --- signals, threads, paths --------------------------------------------------------------------


def test_handle_signals_off_the_main_thread_is_a_usage_error_before_anything_is_loaded(
    tmp_path: Path,
) -> None:
    # A Dagster/Airflow task running the async verb in a worker thread with handle_signals=True
    # gets a bare RuntimeError ("set_wakeup_fd only works in main thread") from deep inside the
    # run, after the job was loaded and joined
    caught: list[BaseException] = []

    def task() -> None:
        try:
            asyncio.run(
                batchrun.submit_async(rows(3), job="t", home=tmp_path, handle_signals=True, **SIM)
            )
        except BaseException as exc:  # what reaches the caller
            caught.append(exc)

    worker = threading.Thread(target=task)
    worker.start()
    worker.join()
    assert caught and isinstance(caught[0], batchrun.UsageError), caught


def test_a_tilde_in_a_sqlite_ledger_url_is_the_users_home_not_a_folder_named_tilde(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # README (Python API): "`~` in paths is expanded". `ledger="sqlite:///~/batch/ledger.db"`
    # makes a folder literally named `~` in the working directory (a later `rm -rf ~` to tidy
    # it up deletes the user's home), and a pipeline whose working directory changes from run
    # to run gets a new, empty ledger each time: nothing resumes, everything is paid again.
    user_home, work = tmp_path / "home", tmp_path / "work"
    user_home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(user_home))
    monkeypatch.chdir(work)
    url = "sqlite:///~/batch/ledger.db"
    batchrun.submit(rows(2), job="t", home=tmp_path / "runs", ledger=url, **SIM)
    assert not (work / "~").exists()
    assert (user_home / "batch" / "ledger.db").exists()


def test_the_process_exits_after_a_callback_raises_keyboard_interrupt(tmp_path: Path) -> None:
    # A callback that stops the run with KeyboardInterrupt (or a notebook's interrupt landing
    # in it): the interrupt reaches the caller, but an idle AnyIO worker thread of the run's
    # event loop is never told to stop, so the script never exits (the interpreter waits for
    # it at shutdown). A RuntimeError or SystemExit from the same callback exits at once.
    import subprocess
    import sys

    script = f"""
import batchrun
rows = [{{"id": f"r{{i}}", "prompt": f"a{{i}}"}} for i in range(100)]
def stop(update):
    if update.done:
        raise KeyboardInterrupt
try:
    batchrun.submit(rows, job="j", home={str(tmp_path)!r}, on_progress=stop, concurrency=4,
                    backend="sim", sim_options={{"ttft_ms": 5.0, "tpot_ms": 0.0}})
except KeyboardInterrupt:
    print("interrupted")
"""
    env = {**os.environ, "PYTHONPATH": str(Path(batchrun.__file__).parent.parent)}
    try:
        done = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=20
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the script printed its last line but never exited (an idle worker thread)")
    assert done.returncode == 0 and "interrupted" in done.stdout, done.stderr


@pytest.mark.parametrize("keyword", ["schema", "spec"])
def test_a_tilde_in_a_schema_or_spec_path_is_expanded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keyword: str
) -> None:
    # README (Python API): "`~` in paths is expanded" (it is for home=, a source path and
    # export's path=). `schema="~/..."` and `spec="~/..."` are refused as "not found".
    user_home = tmp_path / "home"
    user_home.mkdir()
    monkeypatch.setenv("HOME", str(user_home))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    (user_home / "answer.json").write_text(json.dumps(schema))
    (user_home / "job.toml").write_text('backend = "sim"\nmax-attempts = 3\n')
    given = {"schema": "~/answer.json"} if keyword == "schema" else {"spec": "~/job.toml"}
    report = batchrun.submit(rows(2), home=tmp_path / "runs", **given, **SIM)
    assert report.complete and report.counts["pending"] == 0


def test_rows_that_cannot_be_written_to_home_inputs_raise_a_batchrun_error(tmp_path: Path) -> None:
    # README: storage failures are BatchrunErrors ("never with a traceback"); the job log and
    # the results file say "cannot write ..." (OutputError). Writing the rows to HOME/inputs/
    # catches no OSError at all: a full disk, a read-only home or (here) a file in the way
    # reach the caller as a bare OSError (FileExistsError here).
    (tmp_path / "inputs").write_text("not a folder")
    with pytest.raises(batchrun.BatchrunError, match="inputs"):
        batchrun.submit(rows(2), home=tmp_path, **SIM)


def test_rows_streamed_from_a_sqlite_cursor_are_read_in_the_callers_thread(tmp_path: Path) -> None:
    # A pipeline's usual way to hand over many rows without a list: a generator over a
    # database cursor. submit_async reads the rows in a worker thread (anyio.to_thread), and
    # sqlite3 objects (like thread-local sessions, Django's connections...) refuse to be used
    # from another thread: a bare sqlite3.ProgrammingError, whatever the rows.
    import sqlite3

    con = sqlite3.connect(tmp_path / "catalog.db")
    con.execute("create table products (sku text, prompt text)")
    con.executemany(
        "insert into products values (?, ?)", [(f"s{i}", f"Describe {i}") for i in range(5)]
    )
    con.commit()
    source = (
        {"id": sku, "prompt": p} for sku, p in con.execute("select sku, prompt from products")
    )
    report = batchrun.submit(source, home=tmp_path, **SIM)
    assert report.ok and report.loaded == 5


def test_the_errors_a_run_raises_cross_a_process_boundary(tmp_path: Path) -> None:
    # Pipelines fan jobs out with ProcessPoolExecutor, multiprocessing, joblib or Dask, which
    # pickle a task's exception back to the parent. JobAborted(report) and InputError(problems)
    # pickle as their message only and fail to unpickle ('str' object has no attribute
    # 'counts'; not enough values to unpack): ProcessPoolExecutor answers BrokenProcessPool ("A
    # process in the process pool was terminated abruptly") for the job and every other
    # future of the pool, and the report saying what is committed and pending is lost.
    import pickle

    with pytest.raises(batchrun.JobAborted) as aborted:
        batchrun.submit(
            rows(3), job="f", home=tmp_path, backend="sim", sim_options={"api_key": "sk-other"}
        )
    with pytest.raises(batchrun.InputError) as bad:
        batchrun.submit([{"prompt": "ok"}, {"nope": 1}], job="g", home=tmp_path, **SIM)
    back = pickle.loads(pickle.dumps(aborted.value))
    assert isinstance(back, batchrun.JobAborted) and str(back) == str(aborted.value)
    assert back.report.counts == aborted.value.report.counts
    again = pickle.loads(pickle.dumps(bad.value))
    assert isinstance(again, batchrun.InputError) and again.problems == bad.value.problems


@pytest.mark.anyio
async def test_an_async_run_cancelled_as_it_starts_leaves_no_live_worker_behind(
    tmp_path: Path,
) -> None:
    # README: cancelling an async verb (a cancel scope, asyncio.wait_for, a notebook's stop)
    # gives the items back. Cancelled in its first moments (here: right at the first progress
    # update, where nothing is sent yet; asyncio.wait_for(..., 0.01) hits the same window),
    # the run's worker, joined before the runner's try/finally, is never released: `status`
    # says "running (pid ...)" and a resume asking another max_tokens is refused until the
    # lease runs out.
    await batchrun.submit_async(rows(5), job="c", home=tmp_path, run=False)
    with anyio.CancelScope() as scope:

        def stop_at_start(update: batchrun.ProgressUpdate) -> None:
            scope.cancel()

        await batchrun.resume_async("c", home=tmp_path, on_progress=stop_at_start, **SIM)
    workers = batchrun.status("c", home=tmp_path)["workers"]
    assert all(w["state"] != "running" for w in workers), workers
    report = await batchrun.resume_async("c", home=tmp_path, max_tokens=16, **SIM)
    assert report.ok


def test_progress_reaches_the_total_when_two_runs_share_a_job(tmp_path: Path) -> None:
    # Two runs of one job in one process (two threads; or a cron run joining a notebook's):
    # ProgressUpdate.done is "items with a final record, this run's and earlier runs'
    # together", but each run counts only its own commits: the bars end at 88/200 and
    # 112/200 with the job complete, and a pipeline waiting for done == total waits for ever.
    source = rows(200)
    finals: dict[str, batchrun.ProgressUpdate] = {}
    reports: dict[str, batchrun.JobReport] = {}

    def run(name: str) -> None:
        updates: list[batchrun.ProgressUpdate] = []
        reports[name] = batchrun.submit(
            source,
            job="shared",
            home=tmp_path,
            concurrency=4,
            on_progress=updates.append,
            backend="sim",
            sim_options={"ttft_ms": 5.0, "tpot_ms": 0.0},
        )
        finals[name] = updates[-1]

    threads = [threading.Thread(target=run, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(report.complete for report in reports.values())
    # (where one run did all the work, its own count reaches the total: the same assertion)
    assert max(update.done for update in finals.values()) == 200, finals


def test_handle_signals_puts_the_callers_signal_handlers_back(tmp_path: Path) -> None:
    # An asyncio service (its own graceful SIGTERM handler) runs batches with
    # `await submit_async(..., handle_signals=True)`. Afterwards its SIGTERM handler is SIG_DFL
    # and its loop's own SIGINT handler is gone: the next SIGTERM kills the service outright,
    # mid-way through whatever else it was doing. The sync verbs put the handlers back.
    import signal

    heard: list[int] = []

    def mine(signum: int, _frame: Any) -> None:
        heard.append(signum)

    old = signal.signal(signal.SIGTERM, mine)
    try:

        async def service() -> Any:
            await batchrun.submit_async(rows(2), home=tmp_path, handle_signals=True, **SIM)
            return signal.getsignal(signal.SIGTERM)

        assert asyncio.run(service()) is mine
    finally:
        signal.signal(signal.SIGTERM, old)
