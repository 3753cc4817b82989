"""The Python API: the verbs the CLI is made of, for notebooks, pipelines and scripts.

Each call opens the ledger, does one thing and closes it, with the CLI's guarantees: a job is
loaded all or nothing, results are committed in groups as they come, the results file is
written atomically when no item is left, and a second call with the same input resumes.
Run options are keyword arguments under the CLI's names (`--max-attempts` is
`max_attempts=`); the library draws no progress bar and prints nothing: pass `on_progress`
and `on_message` to hear how a run goes.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import threading
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from contextlib import closing, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Unpack

import anyio

from batchrun import batch_mode
from batchrun import jobs as verbs
from batchrun.config import RunOptions, RunSpec
from batchrun.errors import UsageError
from batchrun.jobs import Home
from batchrun.ledger import IngestReport, Job, Ledger, ledger_file, left, shown_url
from batchrun.ledger_calls import LedgerCalls
from batchrun.outputs import FORMATS, Result, result_of
from batchrun.preview import preview
from batchrun.progress import JobLog, ProgressUpdate
from batchrun.report import JobAborted, JobReport, checked
from batchrun.row_input import PathLike, input_of, option_layers, rows_job
from batchrun.run_state import RunnerSettings, RunStats
from batchrun.status_view import job_detail, jobs_table
from batchrun.stopping import Raised, carried, handlers_put_back

OnProgress = Callable[[ProgressUpdate], None]  # after each group commit
OnMessage = Callable[[str], None]  # a line for the user: loaded, resuming, stopping...


# --- the verbs, async --------------------------------------------------------------------------


async def submit_async(
    source: PathLike | Iterable[Mapping[str, Any]],
    *,
    job: str | None = None,
    home: PathLike = ".",
    ledger: str | None = None,
    spec: PathLike | None = None,
    run: bool = True,
    handle_signals: bool = False,
    on_progress: OnProgress | None = None,
    on_message: OnMessage | None = None,
    **options: Unpack[RunOptions],
) -> JobReport:
    """Load `source` (a JSONL file, or rows as dicts) into a new job and run it to the end.

    The same input under the same job name resumes that job instead. Rows are written to
    HOME/inputs/ first (so a resume reads the same file); rows with no `job` name are named
    from their content and the options that shape the requests (model, sampling, schema,
    endpoint; where `gc` collected that job, the next name it did not: `-2`, `-3`...). With
    `run=False` the job is loaded and nothing is sent. `handle_signals`: a
    Ctrl-C or SIGTERM stops the run gracefully (main thread only; the sync verbs set it)."""
    _signals_here(handle_signals)
    where = _home(home, ledger)
    layers = option_layers(spec, options)
    # rows are read here, in the caller's thread (a database cursor is its thread's)
    path, name = input_of(source, where, job, layers)
    named_here = job is None and not isinstance(source, (str, os.PathLike))
    with _ledger(where, patience=_patience(layers)) as led:
        name, existing = rows_job(led, name) if named_here else (name, led.get_job(name))
        run_spec = verbs.resolve_for_job(existing, *layers, endpoint_required=run)
        loaded = rejected = None
        if existing is None:
            made = await anyio.to_thread.run_sync(verbs.create_or_join, led, name, path, run_spec)
            if made is None:  # another submit made it since we looked: as if it had been there
                existing = led.get_job(name)
                assert existing is not None
                run_spec = verbs.resolve_for_job(existing, *layers, endpoint_required=run)
            else:
                loaded, rejected = made.accepted, made.rejected
                _say(on_message, _loaded(name, made))
                verbs.note_loaded(where, name, made)
        if existing is not None:
            if not await anyio.to_thread.run_sync(verbs.same_input, existing, path):
                raise UsageError(
                    f"job {name!r} exists and was made from a different input "
                    f"({existing.input_path}); use another job name"
                )
            verbs.not_collected(led, existing)
            _say(on_message, f"job {name} exists for this file; {_left(led, name, run)}")
        if not run:  # a dry run: what running it would send and cost
            ahead = await anyio.to_thread.run_sync(preview, led, name, run_spec)
            _say(on_message, f"job {name}: {ahead.said()}")
            standing = _standing(led, where, name)
            return replace(standing, loaded=loaded, rejected=rejected or 0, preview=ahead)
        listen = _Listen(handle_signals, on_progress, on_message)
        report = await _run(led, where, name, run_spec, listen)
    return checked(replace(report, loaded=loaded, rejected=rejected or 0))


async def resume_async(
    job: str,
    *,
    home: PathLike = ".",
    ledger: str | None = None,
    spec: PathLike | None = None,
    allow_changed_input: bool = False,
    handle_signals: bool = False,
    on_progress: OnProgress | None = None,
    on_message: OnMessage | None = None,
    **options: Unpack[RunOptions],
) -> JobReport:
    """Continue `job`: send every item that has no final record yet. The input guards
    (skip_invalid, max_line_bytes, max_input_*) were applied when it was loaded; given here,
    they change nothing."""
    _signals_here(handle_signals)
    where, layers = _home(home, ledger), option_layers(spec, options)
    with _ledger(where, patience=_patience(layers)) as led:
        found = _job(led, where, job)
        changed = functools.partial(verbs.check_input_unchanged, allow=allow_changed_input)
        note = await anyio.to_thread.run_sync(changed, found)
        if note:
            _say(on_message, note)
        run_spec = verbs.resolve_for_job(found, *layers)
        listen = _Listen(handle_signals, on_progress, on_message)
        report = await _run(led, where, found.name, run_spec, listen)
    return checked(replace(report, notes=(note, *report.notes) if note else report.notes))


# --- the verbs, sync ---------------------------------------------------------------------------


def submit(
    source: PathLike | Iterable[Mapping[str, Any]],
    *,
    job: str | None = None,
    home: PathLike = ".",
    ledger: str | None = None,
    spec: PathLike | None = None,
    run: bool = True,
    on_progress: OnProgress | None = None,
    on_message: OnMessage | None = None,
    **options: Unpack[RunOptions],
) -> JobReport:
    """submit_async, run to its end in a new event loop (see there); Ctrl-C and SIGTERM stop
    it gracefully, then reach the caller as they would have (KeyboardInterrupt...)."""
    where = {"home": home, "ledger": ledger, "spec": spec}
    listen = {"on_progress": on_progress, "on_message": on_message}
    call = functools.partial(submit_async, source, job=job, run=run)
    return _sync(functools.partial(call, **where, **listen), options)


def resume(
    job: str,
    *,
    home: PathLike = ".",
    ledger: str | None = None,
    spec: PathLike | None = None,
    allow_changed_input: bool = False,
    on_progress: OnProgress | None = None,
    on_message: OnMessage | None = None,
    **options: Unpack[RunOptions],
) -> JobReport:
    """resume_async, run to its end in a new event loop (see there, and `submit`)."""
    where = {"home": home, "ledger": ledger, "spec": spec}
    listen = {"on_progress": on_progress, "on_message": on_message}
    call = functools.partial(resume_async, job, allow_changed_input=allow_changed_input)
    return _sync(functools.partial(call, **where, **listen), options)


def status(job: str, *, home: PathLike = ".", ledger: str | None = None) -> dict[str, Any]:
    """What `batchrun status JOB --json` prints: counts, endpoint, tokens, latencies, errors."""
    where = _home(home, ledger)
    with _ledger(where, existing=True) as led:
        return job_detail(led, _job(led, where, job, collected_ok=True))


def list_jobs(*, home: PathLike = ".", ledger: str | None = None) -> list[dict[str, Any]]:
    """Every job in the ledger, oldest first: name, state, total and counts by status."""
    with _ledger(_home(home, ledger), existing=True) as led:
        return jobs_table(led)


def retry(job: str, *, home: PathLike = ".", ledger: str | None = None) -> int:
    """Put the job's failed and invalid items back to pending (then resume); how many."""
    where = _home(home, ledger)
    with _ledger(where, existing=True) as led:
        return led.requeue(_job(led, where, job).name)


def cancel(
    job: str, *, forget: bool = False, home: PathLike = ".", ledger: str | None = None
) -> list[str]:
    """Cancel the job's running hosted batches (`--mode batch`); their ids. What they answered
    before stopping is collected by the next `resume`; the rest goes back to pending.
    `forget`: a batch the provider does not know is gone; its lines go back to pending."""
    where = _home(home, ledger)
    with _ledger(where, existing=True) as led:
        found = _job(led, where, job)
        spec = verbs.job_spec(found)
        run = functools.partial(batch_mode.cancel_batches, led, found.name, spec, forget=forget)
        _no_running_loop("cancel")
        return anyio.run(run)


def export(
    job: str,
    *,
    fmt: str = "native",
    path: PathLike | None = None,
    home: PathLike = ".",
    ledger: str | None = None,
) -> Path:
    """Write the job's results file again (every line, input order, atomically); its path."""
    if fmt not in FORMATS:
        raise UsageError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    where = _home(home, ledger)
    with _ledger(where, existing=True) as led:
        found = _job(led, where, job)
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise UsageError(f"path must be a path or a string, not {type(path).__name__}")
        target = Path(path).expanduser() if path is not None else where.output_path(found.name, fmt)
        complete = left(led.counts(found.name)) == 0
        verbs.export(led, target, found.name, verbs.job_spec(found), fmt)
        if not complete and left(led.counts(found.name)) == 0:  # a run finished meanwhile
            # and wrote the job's results file, which ours, read before, may have replaced
            verbs.export(led, target, found.name, verbs.job_spec(found), fmt)
    return target


def results(job: str, *, home: PathLike = ".", ledger: str | None = None) -> Iterator[Result]:
    """Every line's Result in input order, read from the ledger in pages (constant memory).
    An unknown job is refused here, not at the first `next()`."""
    where = _home(home, ledger)
    with _ledger(where, existing=True) as led:
        found = _job(led, where, job)
    return _results(where, found.name, verbs.job_spec(found).model)


def _results(where: Home, name: str, model: str | None) -> Iterator[Result]:
    with _ledger(where) as led:  # open while iterated; closed at the end or when dropped
        for item in led.iter_results(name):
            yield result_of(item, model)


# --- how they are made -------------------------------------------------------------------------


@dataclass(frozen=True)
class _Listen:
    handle_signals: bool
    on_progress: OnProgress | None
    on_message: OnMessage | None


async def _run(led: Ledger, where: Home, name: str, spec: RunSpec, listen: _Listen) -> JobReport:
    """Run what is left, then finish: results written once no item is left. The calls around
    the run wait out a database away (a PostgreSQL restart) as the run's own do."""
    with closing(JobLog(where.log_path(name), name, redact=spec.redact)) as log:
        say, settings = listen.on_message, RunnerSettings(lease_ttl=spec.lease)
        db = LedgerCalls(settings, outage_timeout=spec.outage_timeout, log=log, say=say)
        counts, started = await db(led.counts, name), await db(led.now)  # workers' clock
        stats, notes = RunStats(), tuple[str, ...]()
        if left(counts):
            stats = await verbs.run_job(
                led,
                where,
                name,
                spec,
                handle_signals=listen.handle_signals,
                on_progress=listen.on_progress,
                on_message=say,
            )
        else:
            notes = (f"job {name} has nothing left to do",)
            _say(say, notes[0])
        found = await db(led.get_job, name)
        final_spec = verbs.job_spec(found) if found else spec
        # the results file is written here: off the event loop, which may be the caller's
        counts, complete = await db(verbs.finish, led, where, name, final_spec)
        output = where.output_path(name) if complete else None
        took_part = sum(w.took_part(started, spec.lease) for w in await db(led.workers, name))
    report = JobReport(name, counts, complete, output, notes=notes, stats=stats)
    return replace(report, workers=max(1, took_part))


def _standing(led: Ledger, where: Home, name: str) -> JobReport:
    """Where a job stands, nothing run."""
    counts = led.counts(name)
    complete = left(counts) == 0
    output = where.output_path(name)
    return JobReport(name, counts, complete, output if complete and output.exists() else None)


def _sync(call: Callable[..., Awaitable[JobReport]], options: Mapping[str, Any]) -> JobReport:
    """Run an async verb in a new event loop; from the main thread, a Ctrl-C or SIGTERM stops
    the run gracefully, and then reaches the caller through its own handler (or Python's)."""
    try:
        report = in_new_loop(call, options)
    except JobAborted as aborted:  # a signal came first: the caller hears of it first
        if aborted.report.stats.stopped_by is not None:
            signal.raise_signal(aborted.report.stats.stopped_by)
        raise  # its handler went on (or it is ignored): the abort is still raised
    if report.stats.stopped_by is not None:
        signal.raise_signal(report.stats.stopped_by)  # handled as the caller would have
    return report


def in_new_loop(call: Callable[..., Awaitable[JobReport]], options: Mapping[str, Any]) -> JobReport:
    """An async verb run to its end in a new event loop (the CLI's way too), stopping
    gracefully on Ctrl-C/SIGTERM from the main thread; the signal handlers are put back."""
    _no_running_loop("submit")
    if "handle_signals" in options:
        raise UsageError("handle_signals is for the async verbs: the sync ones stop on signals")
    main = threading.current_thread() is threading.main_thread()
    with handlers_put_back():
        report = anyio.run(carried, functools.partial(call, handle_signals=main, **options))
    if isinstance(report, Raised):
        raise report.error  # out of the loop, closed (see carried)
    return report


def _signals_here(handle_signals: bool) -> None:
    if handle_signals and threading.current_thread() is not threading.main_thread():
        raise UsageError("handle_signals=True needs the main thread: only it hears signals")


def _no_running_loop(verb: str) -> None:
    """The sync verbs start an event loop of their own: not inside one (a notebook's)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    hint = (
        "call it from a thread, or run `batchrun cancel JOB`"
        if verb == "cancel"
        else "use `await batchrun.submit_async(...)` or `await batchrun.resume_async(...)`"
    )
    raise UsageError(f"called inside a running event loop (a notebook?): {hint}")


def _home(home: PathLike, ledger: str | None) -> Home:
    for key, value in (("home", home), ("ledger", ledger)):
        if value is not None and not isinstance(value, (str, os.PathLike)):
            raise UsageError(f"{key} must be a path or a string, not {type(value).__name__}")
    root = Path(home).expanduser()
    if root.exists() and not root.is_dir():
        raise UsageError(f"home {str(root)!r} is a file, not a folder")
    return Home.at(root, ledger)


@contextmanager
def _ledger(where: Home, *, existing: bool = False, patience: float = 0.0) -> Iterator[Ledger]:
    """The ledger, open for one verb. `existing`: a verb that only reads refuses to make one
    (a mistyped home would otherwise get a new, empty ledger). `patience`: a run's verb waits
    out a database away as it opens it (a PostgreSQL restart), up to its outage timeout."""
    file = ledger_file(where.ledger_url) if existing else None
    if file is not None and not file[0].exists():
        raise UsageError(f"no ledger at {file[0]} (is home {where.root} right?)")
    led = Ledger(where.ledger_url, patience=patience)
    try:
        yield led
    finally:
        led.close()


def _patience(layers: list[dict[str, Any]]) -> float:
    """How long a run's verb waits for its ledger: the outage timeout its options give (a
    keyword over a spec file's), else its default."""
    given = [layer["outage_timeout"] for layer in layers if "outage_timeout" in layer]
    last = given[-1] if given else None
    return float(last) if isinstance(last, (int, float)) else RunSpec.outage_timeout


def _job(led: Ledger, where: Home, name: str, *, collected_ok: bool = False) -> Job:
    found = led.get_job(name)
    if found is None:
        known = ", ".join(j.name for j in led.list_jobs()) or "none"
        raise UsageError(f"no job named {name!r} in {shown_url(where.ledger_url)} (jobs: {known})")
    if not collected_ok:
        verbs.not_collected(led, found)
    return found


def _say(on_message: OnMessage | None, message: str) -> None:
    if on_message is not None:
        on_message(message)


def _loaded(name: str, made: IngestReport) -> str:
    skipped = f", {made.rejected} rejected" if made.rejected else ""
    blanks = f", {len(made.blank_lines)} blank line(s) skipped" if made.blank_lines else ""
    groups = ""
    if made.groups:
        groups = (
            f"; {made.groups} prefix group(s) ({made.grouped} lines sharing a long prompt "
            "prefix) go out together"
        )
    return f"job {name}: loaded {made.accepted} items{skipped}{blanks}{groups}"


def _left(led: Ledger, name: str, run: bool) -> str:
    """What a second submit of the same input does: resume, or (not run) nothing."""
    if run:
        return "resuming it"
    counts = led.counts(name)
    waiting = left(counts)
    return f"nothing loaded (--no-run); {waiting} item(s) still to send: `batchrun resume {name}`"
