"""The Python API: the verbs the CLI is made of, for notebooks, pipelines and scripts.

Each call opens the ledger, does one thing and closes it, with the CLI's guarantees: a job is
loaded all or nothing, results are committed in groups as they come, the results file is
written atomically when no item is left, and a second call with the same input resumes.
Run options are keyword arguments under the CLI's names (`--max-attempts` is
`max_attempts=`); the library draws no progress bar and prints nothing: pass `on_progress`
and `on_message` to hear how a run goes.
"""

from __future__ import annotations

import functools
import os
import tempfile
import threading
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypedDict, TypeVar, Unpack

import anyio
import orjson

from batchrun import jobs as verbs
from batchrun.config import RunSpec, load_spec_file
from batchrun.errors import UsageError
from batchrun.inputs import file_digest
from batchrun.jobs import Home
from batchrun.ledger import Job, Ledger
from batchrun.outputs import Result, result_of
from batchrun.progress import ProgressUpdate
from batchrun.run_state import RunStats
from batchrun.status import job_detail, jobs_table

T = TypeVar("T")
PathLike = str | os.PathLike[str]


class RunOptions(TypedDict, total=False):
    """Every run option, under the CLI's names; left out means the spec's or the default."""

    backend: str
    base_url: str
    model: str
    api_key_env: str  # the NAME of the variable that holds the key, never the key
    endpoint: str  # "chat" or "completions"
    stream: bool
    concurrency: int | str  # a number, or "auto"
    max_concurrency: int
    server_metrics: str
    rpm: float
    tpm: float
    max_attempts: int
    timeout: float
    outage_timeout: float
    max_tokens: int
    temperature: float
    top_p: float
    schema: str
    guided: bool
    repair_attempts: int
    on_truncate: str
    max_tokens_cap: int
    skip_invalid: bool
    redact: bool
    max_line_bytes: int
    max_input_chars: int
    max_input_tokens: int
    sim_options: dict[str, Any]


OnProgress = Callable[[ProgressUpdate], None]  # after each group commit
OnMessage = Callable[[str], None]  # a line for the user: loaded, resuming, stopping...


@dataclass(frozen=True)
class JobReport:
    """What a submit or resume did, and where the job stands."""

    job: str
    counts: dict[str, int]  # items by status: pending, running, done, failed, invalid, rejected
    complete: bool  # no item left to send; the results file is written
    output: Path | None  # the results file, once complete
    loaded: int | None = None  # items this call loaded (None: the job was there already)
    rejected: int = 0  # bad lines this call recorded as rejected (skip_invalid)
    notes: tuple[str, ...] = ()  # things the caller should know (the input file changed...)
    stats: RunStats = field(default_factory=RunStats)  # this run's requests, retries, tokens

    @property
    def ok(self) -> bool:
        """Complete, with every line done."""
        return self.complete and self.counts["done"] == sum(self.counts.values())


# --- the verbs, async --------------------------------------------------------------------------


async def submit_async(
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
    """Load `source` (a JSONL file, or rows as dicts) into a new job and run it to the end.

    The same input under the same job name resumes that job instead. Rows are written to
    HOME/inputs/JOB.jsonl first (so a resume reads the same file); rows with no `job` name
    make one from their content. With `run=False` the job is loaded and nothing is sent."""
    where = Home.at(Path(home), ledger)
    path, name = _input(source, where, job)
    layers = _layers(spec, options)
    with _ledger(where) as led:
        existing = led.get_job(name)
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
                _say(on_message, _loaded(name, made.accepted, made.rejected, made.blank_lines))
        if existing is not None:
            if not await anyio.to_thread.run_sync(verbs.same_input, existing, path):
                raise UsageError(
                    f"job {name!r} exists and was made from a different input "
                    f"({existing.input_path}); use another job name"
                )
            _say(on_message, f"job {name} exists for this file; {_left(led, name, run)}")
        if not run:
            counts = led.counts(name)
            return JobReport(name, counts, False, None, loaded, rejected or 0)
        report = await _run(led, where, name, run_spec, on_progress, on_message)
    return replace(report, loaded=loaded, rejected=rejected or 0)


async def resume_async(
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
    """Continue `job`: send every item that has no final record yet."""
    where = Home.at(Path(home), ledger)
    with _ledger(where) as led:
        found = _job(led, where, job)
        note = verbs.check_input_unchanged(found, allow=allow_changed_input)
        if note:
            _say(on_message, note)
        run_spec = verbs.resolve_for_job(found, *_layers(spec, options))
        report = await _run(led, where, found.name, run_spec, on_progress, on_message)
    return replace(report, notes=(note,) if note else ())


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
    """submit_async, run to its end in a new event loop (see there)."""
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
    """resume_async, run to its end in a new event loop (see there)."""
    where = {"home": home, "ledger": ledger, "spec": spec}
    listen = {"on_progress": on_progress, "on_message": on_message}
    call = functools.partial(resume_async, job, allow_changed_input=allow_changed_input)
    return _sync(functools.partial(call, **where, **listen), options)


def status(job: str, *, home: PathLike = ".", ledger: str | None = None) -> dict[str, Any]:
    """What `batchrun status JOB --json` prints: counts, endpoint, tokens, latencies, errors."""
    where = Home.at(Path(home), ledger)
    with _ledger(where) as led:
        return job_detail(led, _job(led, where, job))


def list_jobs(*, home: PathLike = ".", ledger: str | None = None) -> list[dict[str, Any]]:
    """Every job in the ledger, oldest first: name, state, total and counts by status."""
    with _ledger(Home.at(Path(home), ledger)) as led:
        return jobs_table(led)


def retry(job: str, *, home: PathLike = ".", ledger: str | None = None) -> int:
    """Put the job's failed and invalid items back to pending (then resume); how many."""
    where = Home.at(Path(home), ledger)
    with _ledger(where) as led:
        return led.requeue(_job(led, where, job).name)


def export(
    job: str,
    *,
    fmt: str = "native",
    path: PathLike | None = None,
    home: PathLike = ".",
    ledger: str | None = None,
) -> Path:
    """Write the job's results file again (every line, input order, atomically); its path."""
    where = Home.at(Path(home), ledger)
    with _ledger(where) as led:
        found = _job(led, where, job)
        target = Path(path) if path is not None else where.output_path(found.name, fmt)
        verbs.export(led, target, found.name, verbs.job_spec(found), fmt)
    return target


def results(job: str, *, home: PathLike = ".", ledger: str | None = None) -> Iterator[Result]:
    """Every line's Result in input order, read from the ledger in pages (constant memory)."""
    where = Home.at(Path(home), ledger)
    with _ledger(where) as led:
        name = _job(led, where, job).name
        for item in led.iter_results(name):
            yield result_of(item)


# --- how they are made -------------------------------------------------------------------------


async def _run(
    led: Ledger,
    where: Home,
    name: str,
    spec: RunSpec,
    on_progress: OnProgress | None,
    on_message: OnMessage | None,
) -> JobReport:
    """Run what is left, then finish: results written once no item is left."""
    counts = led.counts(name)
    stats = RunStats()
    if counts["pending"] or counts["running"]:
        stats = await verbs.run_job(
            led,
            where,
            name,
            spec,
            # Ctrl-C and SIGTERM stop it gracefully where signals can be heard
            handle_signals=threading.current_thread() is threading.main_thread(),
            on_progress=on_progress,
            on_message=on_message,
        )
    else:
        _say(on_message, f"job {name} has nothing left to do")
    found = led.get_job(name)
    final_spec = verbs.job_spec(found) if found else spec
    # the results file is written here: off the event loop, which may be the caller's
    counts, complete = await anyio.to_thread.run_sync(verbs.finish, led, where, name, final_spec)
    output = where.output_path(name) if complete else None
    return JobReport(name, counts, complete, output, stats=stats)


def _sync(call: Callable[..., Awaitable[T]], options: Mapping[str, Any]) -> T:
    """Run an async verb in a new event loop (the run options go through as given)."""
    return anyio.run(functools.partial(call, **options))


@contextmanager
def _ledger(where: Home) -> Iterator[Ledger]:
    led = Ledger(where.ledger_url)
    try:
        yield led
    finally:
        led.close()


def _job(led: Ledger, where: Home, name: str) -> Job:
    found = led.get_job(name)
    if found is None:
        known = ", ".join(j.name for j in led.list_jobs()) or "none"
        raise UsageError(f"no job named {name!r} in {where.ledger_url} (jobs: {known})")
    return found


def _layers(spec: PathLike | None, options: Mapping[str, Any]) -> list[dict[str, Any]]:
    layers = [load_spec_file(Path(spec))] if spec is not None else []
    layers.append(dict(options))
    return layers


def _input(
    source: PathLike | Iterable[Mapping[str, Any]], where: Home, job: str | None
) -> tuple[Path, str]:
    """The input file and the job's name. Rows are written to HOME/inputs/ first."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        return path, verbs.check_job_name(job or verbs.default_job_name(path))
    folder = where.root / "inputs"
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("wb", dir=folder, suffix=".tmp", delete=False) as f:
        for row in source:
            f.write(orjson.dumps(row) + b"\n")
    tmp = Path(f.name)
    name = verbs.check_job_name(job or f"rows-{file_digest(tmp)[:12]}")
    path = folder / f"{name}.jsonl"
    if path.exists() and file_digest(path) != file_digest(tmp):
        tmp.unlink()
        raise UsageError(f"{path} holds other rows for job {name!r}; use another job name")
    os.replace(tmp, path)
    return path, name


def _say(on_message: OnMessage | None, message: str) -> None:
    if on_message is not None:
        on_message(message)


def _loaded(name: str, accepted: int, rejected: int, blank: list[int]) -> str:
    skipped = f", {rejected} rejected" if rejected else ""
    blanks = f", {len(blank)} blank line(s) skipped" if blank else ""
    return f"job {name}: loaded {accepted} items{skipped}{blanks}"


def _left(led: Ledger, name: str, run: bool) -> str:
    """What a second submit of the same input does: resume, or (not run) nothing."""
    if run:
        return "resuming it"
    counts = led.counts(name)
    waiting = counts["pending"] + counts["running"]
    return f"nothing loaded (--no-run); {waiting} item(s) still to send: `batchrun resume {name}`"
