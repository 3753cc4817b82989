"""A job's life cycle: create or find it, run it, write its results (the domain verbs that
the Python API in api.py composes; backends are made in backends/build.py)."""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import anyio

from batchrun import batch_mode, reuse
from batchrun.backends import Transport
from batchrun.backends.build import sim_config
from batchrun.config import RunSpec, preset_for, resolve
from batchrun.errors import (
    FatalError,
    JobExists,
    LedgerError,
    OptionError,
    UsageError,
    single_error,
)
from batchrun.inputs import InputReader, file_digest
from batchrun.lanes import EndpointUse
from batchrun.ledger import (
    FINAL_STATUSES,
    IngestReport,
    Job,
    Joining,
    Ledger,
    file_ledger_url,
    home_expanded,
    left,
)
from batchrun.ledger_calls import LedgerCalls
from batchrun.outputs import FORMATS, write_results
from batchrun.progress import JobLog, Progress, ProgressUpdate
from batchrun.routes import opened_routes
from batchrun.run_state import BUSY_PATIENCE_S, RunnerSettings, RunStats
from batchrun.runner import Runner
from batchrun.stopping import leaving_if_stopped, stop_on_signals
from batchrun.structured import OutputRules
from batchrun.validate import load_schema

JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")  # in full: `$` allows a final \n


@dataclass(frozen=True)
class Home:
    """The folder that holds jobs/ outputs/ logs/, and the ledger URL."""

    root: Path
    ledger_url: str

    @classmethod
    def at(cls, root: Path, ledger_url: str | None) -> Home:
        root = root.resolve()
        url = home_expanded(ledger_url) if ledger_url else None
        return cls(root, url or file_ledger_url(root / "jobs" / "ledger.db"))

    def output_path(self, job: str, fmt: str = "native") -> Path:
        return self.root / "outputs" / FORMATS[fmt].place.format(job=job)

    def log_path(self, job: str) -> Path:
        return self.root / "logs" / f"{job}.log"


def check_job_name(name: str) -> str:
    if not isinstance(name, str):
        raise UsageError(f"job must be a string, not {type(name).__name__}")
    if not JOB_NAME.fullmatch(name):
        raise UsageError(
            f"job name {name!r} must start with a letter or digit and use only letters, digits, "
            "'.', '_' and '-' (at most 100 characters)"
        )
    return name


def default_job_name(input_path: Path) -> str:
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", input_path.stem).strip("-._") or "job"
    return stem[:100]


def job_spec(job: Job) -> RunSpec:
    """The spec a job last ran with, checked (an older version's option names: a clear error)."""
    return resolve(reuse.options(job.spec), endpoint_required=False, stored=True)


def create_job(ledger: Ledger, name: str, input_path: Path, spec: RunSpec) -> IngestReport:
    """Load the input into a new job, all or nothing (bad lines refuse it unless skipped)."""
    where = str(input_path.resolve())
    if any("\ud800" <= c <= "\udfff" for c in where):  # a Latin-1 name: not text to keep
        shown = os.fsencode(input_path.name)
        raise UsageError(f"the input file's name is not UTF-8 ({shown!r}): rename the file")
    reader = InputReader(
        input_path,
        endpoint=spec.endpoint,
        guards=spec.guards,
        prefixes=True,  # keyed always: the order is chosen when the job runs
    )
    report = ledger.create_job(
        name,
        input_path=where,
        input_digest=lambda: reader.stats.file_digest,
        spec=spec.to_json(),
        lines=reader,
        skip_invalid=spec.skip_invalid,
    )
    return replace(report, blank_lines=reader.stats.blank_lines)


def not_collected(led: Ledger, job: Job) -> None:
    """A job `gc` collected keeps only its answers for reuse: never run, exported or called
    complete again (its results would be a part passed off as the whole)."""
    kept = sum(led.counts(job.name).values())
    if job.collected(kept):
        raise UsageError(
            f"job {job.name!r} was collected by `gc`: {kept:,} of its {job.total:,} lines are "
            "kept, as answers for reuse, the rest and its results are gone; submit the file "
            "under another name (--job NAME), and its unchanged lines take the kept answers"
        )


def note_loaded(home: Home, name: str, made: IngestReport) -> None:
    """The load, in the job's log: how many items, and the prefix groups found."""
    log = JobLog(home.log_path(name), name)
    try:
        log.event(
            "loaded",
            items=made.accepted,
            rejected=made.rejected,
            prefix_groups=made.groups,
            grouped_lines=made.grouped,
        )
    finally:
        log.close()


def create_or_join(
    ledger: Ledger, name: str, input_path: Path, spec: RunSpec
) -> IngestReport | None:
    """create_job, or None when another process made the job meanwhile: the same file submitted
    twice at once (cron and a user, say). The loser may wait out the winner's whole ingest, which
    can outlast one busy timeout: it waits as a run does (BUSY_PATIENCE_S)."""
    deadline = time.monotonic() + BUSY_PATIENCE_S
    while True:
        try:
            return create_job(ledger, name, input_path, spec)
        except JobExists:
            return None
        except LedgerError as exc:
            if not exc.busy or time.monotonic() > deadline:
                raise
            if ledger.get_job(name) is not None:
                return None


def same_input(job: Job, input_path: Path) -> bool:
    try:
        return file_digest(input_path) == job.input_digest
    except OSError as exc:
        raise UsageError(f"cannot read input file {input_path}: {exc.strerror or exc}") from None


def check_input_unchanged(job: Job, *, allow: bool) -> str | None:
    """Resume sends the requests stored at submit time; if the input file has changed since,
    the user probably expects something else, so say so. Returns a note to show, if any."""
    path = Path(job.input_path)
    if not path.exists():
        return f"input file {path} is gone; resuming from the requests stored in the ledger"
    if same_input(job, path):
        return None
    if allow:
        return f"input file {path} changed since submit; resuming the requests stored then"
    shown = str(path).replace("{", "{{").replace("}", "}}")  # a path's braces stay braces
    raise OptionError(
        f"input file {shown} changed since job {job.name!r} was submitted; resume would send "
        "the requests stored at submit time, not the new file. Submit the new file as a new "
        "job, or pass {allow_changed_input} to resume anyway"
    )


def resolve_for_job(
    job: Job | None, *layers: dict[str, Any], endpoint_required: bool = True
) -> RunSpec:
    """The job's spec for this run, checked before anything is loaded or sent: the schema file
    is read and stored by absolute path, the simulator options are type-checked. Only a job
    loaded and not run may go without an endpoint (`submit --no-run`)."""
    base = reuse.options(job.spec) if job else {}
    spec = resolve(base, *layers, endpoint_required=endpoint_required)
    if spec.schema:
        schema = Path(spec.schema).expanduser()
        load_schema(str(schema))
        spec = replace(spec, schema=str(schema.resolve()))
    if spec.backend == "sim":
        sim_config(spec)
    if spec.reuse_max_age:
        reuse.seconds(spec.reuse_max_age, key="reuse_max_age")
    return spec


async def run_job(
    ledger: Ledger,
    home: Home,
    name: str,
    spec: RunSpec,
    *,
    transport: Transport | None = None,
    settings: RunnerSettings | None = None,
    handle_signals: bool = True,
    on_progress: Callable[[ProgressUpdate], None] | None = None,
    on_message: Callable[[str], None] | None = None,
) -> RunStats:
    """Run every item that is not final yet: as hosted batches with --mode batch (or while
    batches of the job are open), then, with --then online (or --mode online), as ordinary
    requests. Ctrl-C/SIGTERM stop it gracefully."""
    batched = await _batches_first(
        ledger, home, name, spec, transport=transport, handle_signals=handle_signals
    )
    if batched is not None:
        online = spec.mode == "online" or spec.then == "online"
        stopped = batched.aborted or batched.interrupted
        if stopped or not online or not ledger.counts(name)["pending"]:
            return batched
    rules = output_rules(spec)
    settings = settings or RunnerSettings(lease_ttl=spec.lease)
    log = JobLog(home.log_path(name), name, redact=spec.redact)

    out: list[EndpointUse] = []  # endpoints left out at start: in the summary, not in the run

    def left_out(endpoint: str, why: str) -> None:
        out.append(EndpointUse(endpoint, "out", answered=0, errors=0, limit=0, reason=why))
        log.event("endpoint_out", endpoint=endpoint, error=why)
        if on_message is not None:
            on_message(f"endpoint {endpoint} left out: {why}")

    opened = False
    try:
        async with opened_routes(
            spec, transport=transport, sleep=settings.sleep, clock=settings.clock, note=left_out
        ) as routes:
            opened = True
            models = {route.spec.model for route in routes}
            if len(models) == 1 and not spec.endpoints:  # the model every request goes with
                # (asked of the server when not given), kept with the job; not an endpoints'
                # job's, where an endpoint added later asks its own, as it lists none given
                spec = replace(spec, model=models.pop())
            # joined as the runner will be, in the transaction that copies answers into the job
            settings = replace(settings, worker=settings.worker or uuid.uuid4().hex)
            mine = reuse.joined(spec, routes)
            joining = Joining(mine, reuse.SAME, settings.lease_ttl, settings.worker)
            # what its answers are under: an endpoint whose model is not known yet has none
            keys = reuse.answer_keys(route.spec for route in routes if not route.waiting)
            reuse_run = partial(reuse.prepare, ledger, name, spec, log, joining, keys)
            # a database restarting as the run starts is waited out, as it is once running
            db = LedgerCalls(settings, outage_timeout=spec.outage_timeout, log=log, say=on_message)
            with leaving_if_stopped(ledger, name, settings.worker):  # prepare joined it
                waiting, reused = await db(reuse_run)
                counts = await db(ledger.counts, name)
                progress = Progress(
                    total=sum(counts.values()),
                    initial=sum(counts[s] for s in FINAL_STATUSES),
                    concurrency=spec.most_in_flight,  # the runner shows its own limit
                    on_progress=on_progress,
                    on_message=on_message,
                )
                progress.update(newly_done=0, tokens=0, retries=0, failed=0)  # where it starts
                progress.raise_what_a_callback_raised()
            runner = Runner(
                ledger,
                routes,
                name,
                spec,
                log=log,
                progress=progress,
                rules=rules,
                settings=settings,
                left_out=out,
            )
            try:
                async with anyio.create_task_group() as tg:
                    if handle_signals:
                        tg.start_soon(stop_on_signals, runner.request_stop)
                    stats = await runner.run()
                    stats.reused, stats.duplicates = reused, waiting
                    tg.cancel_scope.cancel()
            except BaseExceptionGroup as group:
                raise single_error(group) from None
            progress.raise_what_a_callback_raised()  # the run stopped for it, and is committed
            return _after(batched, stats)
    except FatalError as exc:
        if opened:
            raise
        log.event("abort", error=str(exc), kind=type(exc).__name__)  # no endpoint to send to
        return _after(batched, RunStats(aborted=str(exc)))
    finally:
        log.close()


async def _batches_first(
    ledger: Ledger,
    home: Home,
    name: str,
    spec: RunSpec,
    *,
    transport: Transport | None,
    handle_signals: bool,
) -> RunStats | None:
    """With --mode batch, or while the job has batches open: earlier answers and repeated
    lines first (pay only for what changed), then the hosted batches. None: not batch mode."""
    if spec.mode != "batch" and not ledger.chunks.listed(name, open_only=True):
        return None
    log = JobLog(home.log_path(name), name, redact=spec.redact)
    try:
        worker = uuid.uuid4().hex  # joined in the pass that copies, as the batch run's worker
        joining = Joining(reuse.joined(spec), reuse.SAME, spec.lease, worker)
        keys = reuse.answer_keys([spec])  # a hosted batch's answers are under the job's
        reuse_run = partial(reuse.prepare, ledger, name, spec, log, joining, keys)
        with leaving_if_stopped(ledger, name, worker):  # one that never started (a bad key)
            waiting, reused = await anyio.to_thread.run_sync(reuse_run)
            stats = await batch_mode.run_batches(
                ledger,
                name,
                spec,
                log=log,
                rules=output_rules(spec),
                transport=transport,
                handle_signals=handle_signals,
                worker=worker,
            )
        stats.reused, stats.duplicates = reused, waiting
        return stats
    finally:
        log.close()


def _after(batched: RunStats | None, stats: RunStats) -> RunStats:
    """An online run's stats, counting what batches did before it."""
    if batched is not None:
        stats.recorded += batched.recorded
        stats.batches, stats.batch_tokens = batched.batches, batched.batch_tokens
        stats.reused += batched.reused  # copied before the batches: none left to the online part
        stats.duplicates = max(stats.duplicates, batched.duplicates)
    return stats


def output_rules(spec: RunSpec) -> OutputRules:
    """The job's schema, guidance style, repairs and truncation policy, for its items."""
    return OutputRules(
        schema=load_schema(spec.schema) if spec.schema else None,
        guided_style=preset_for(spec).guided_style if spec.guided else None,
        repair_attempts=spec.repair_attempts,
        retry_longer=spec.on_truncate == "retry-longer",
        max_tokens_cap=spec.max_tokens_cap,
    )


def finish(ledger: Ledger, home: Home, name: str, spec: RunSpec) -> tuple[dict[str, int], bool]:
    """After a run: when no item is left to do, write the job's results and mark it finished:
    by the worker that finds it complete first (two ending at once may both write it: the
    same lines, atomically), and again when the file is missing."""
    counts = ledger.counts(name)
    complete = left(counts) == 0
    if not complete:
        return counts, complete
    path, job = home.output_path(name), ledger.get_job(name)
    if job is None or job.finished_at is None or not path.exists():
        export(ledger, path, name, spec)  # before marking: a failed write is tried again
    ledger.mark_finished(name, True)
    return counts, complete


def export(ledger: Ledger, path: Path, name: str, spec: RunSpec, fmt: str = "native") -> int:
    items = ledger.iter_results(name, models=fmt == "openai")  # its lines name their model
    return write_results(path, items, fmt=fmt, model=spec.model)
