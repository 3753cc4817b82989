"""A job's life cycle: create or find it, wire its backend, run it, write its results.

This is the library behind the CLI's submit/resume/export/retry; the CLI only parses options,
calls these functions (the async ones through anyio.run) and maps errors to exit codes.
"""

from __future__ import annotations

import dataclasses
import re
import signal
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
import orjson

from batchrun.backends import Backend, MetricsReader, OpenAICompatBackend, Transport
from batchrun.config import RunSpec, preset_for, resolve
from batchrun.errors import (
    BatchrunError,
    EndpointDown,
    FatalError,
    JobExists,
    LedgerError,
    RequestError,
    UsageError,
)
from batchrun.inputs import InputReader, file_digest
from batchrun.ledger import FINAL_STATUSES, IngestReport, Job, Ledger
from batchrun.outputs import write_results
from batchrun.progress import JobLog, Progress
from batchrun.retry import OutageWatch, RetryPolicy
from batchrun.run_state import BUSY_PATIENCE_S, RunnerSettings, RunStats
from batchrun.runner import Runner
from batchrun.server_metrics import metrics_url
from batchrun.sim import SimConfig, SimModel, SimTransport
from batchrun.sim.faults import FAULT_KINDS, check_rates
from batchrun.sim.json_answers import JSON_STYLES
from batchrun.structured import OutputRules
from batchrun.validate import load_schema

JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")  # in full: `$` allows a final \n
SIM_DEFAULTS: dict[str, Any] = {"ttft_ms": 20.0, "tpot_ms": 1.0}

EXIT_OK, EXIT_SOME_FAILED, EXIT_USAGE, EXIT_ABORTED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


@dataclass(frozen=True)
class Home:
    """The folder that holds jobs/ outputs/ logs/, and the ledger URL."""

    root: Path
    ledger_url: str

    @classmethod
    def at(cls, root: Path, ledger_url: str | None) -> Home:
        root = root.resolve()
        return cls(root, ledger_url or f"sqlite:///{root / 'jobs' / 'ledger.db'}")

    def output_path(self, job: str) -> Path:
        return self.root / "outputs" / f"{job}.jsonl"

    def log_path(self, job: str) -> Path:
        return self.root / "logs" / f"{job}.log"


def check_job_name(name: str) -> str:
    if not JOB_NAME.fullmatch(name):
        raise UsageError(
            f"job name {name!r} must start with a letter or digit and use only letters, digits, "
            "'.', '_' and '-' (at most 100 characters)"
        )
    return name


def default_job_name(input_path: Path) -> str:
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", input_path.stem).strip("-._") or "job"
    return stem[:100]


def stored_spec(job: Job) -> dict[str, Any]:
    data: dict[str, Any] = orjson.loads(job.spec)
    return data


def job_spec(job: Job) -> RunSpec:
    """The spec a job last ran with, checked like any other (a clear error, not a TypeError,
    if it was stored by a version with other option names)."""
    return resolve(stored_spec(job), endpoint_required=False)


def spec_json(spec: RunSpec) -> str:
    return orjson.dumps(spec.to_json()).decode()


def create_job(ledger: Ledger, name: str, input_path: Path, spec: RunSpec) -> IngestReport:
    """Load the input into a new job, all or nothing (bad lines refuse it unless skipped)."""
    reader = InputReader(
        input_path,
        endpoint=spec.endpoint,
        defaults=spec.request_defaults(),
        max_line_bytes=spec.max_line_bytes,
        max_input_chars=spec.max_input_chars,
        max_input_tokens=spec.max_input_tokens,
    )
    report = ledger.create_job(
        name,
        input_path=str(input_path.resolve()),
        input_digest=lambda: reader.stats.file_digest,
        spec=spec_json(spec),
        lines=reader,
        skip_invalid=spec.skip_invalid,
    )
    return replace(report, blank_lines=reader.stats.blank_lines)


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
    raise UsageError(
        f"input file {path} changed since job {job.name!r} was submitted; resume would send "
        "the requests stored at submit time, not the new file. Submit the new file as a new "
        "job, or pass --allow-changed-input to resume anyway"
    )


def resolve_for_job(
    job: Job | None, *layers: dict[str, Any], endpoint_required: bool = True
) -> RunSpec:
    """The job's spec for this run, checked before anything is loaded or sent: the schema file
    is read and stored by absolute path, the simulator options are type-checked. Only a job
    loaded and not run may go without an endpoint (`submit --no-run`)."""
    base = stored_spec(job) if job else {}
    spec = resolve(base, *layers, endpoint_required=endpoint_required)
    if spec.schema:
        load_schema(spec.schema)
        spec = replace(spec, schema=str(Path(spec.schema).resolve()))
    if spec.backend == "sim":
        sim_config(spec)
    return spec


def sim_config(spec: RunSpec) -> SimConfig:
    """The in-process simulator's settings: defaults, then the spec's `sim_options`."""
    options = {**SIM_DEFAULTS, **spec.sim_options}
    defaults = dataclasses.asdict(SimConfig())
    accepted = {
        float: (int, float),
        int: (int,),
        bool: (bool,),
        tuple: (list, tuple),
        dict: (dict,),
    }
    for key, value in options.items():
        if key not in defaults:
            raise UsageError(f"sim_options: unknown option {key!r} (known: {', '.join(defaults)})")
        kind = type(defaults[key])
        allowed = accepted.get(kind)
        wrong_type = allowed is not None and not isinstance(value, allowed)
        bool_for_number = isinstance(value, bool) and kind is not bool
        if wrong_type or bool_for_number:
            raise UsageError(f"sim_options: {key} must be {kind.__name__}, got {value!r}")
    if isinstance(options.get("models"), list):
        options["models"] = tuple(options["models"])
    for key, known in (("faults", FAULT_KINDS), ("json_styles", JSON_STYLES)):
        try:
            check_rates(options.get(key, {}), known, key.rstrip("s").replace("_", " "))
        except ValueError as exc:
            raise UsageError(f"sim_options.{key}: {exc}") from None
    return SimConfig(**options)


def build_backend(spec: RunSpec, transport: Transport | None = None) -> Backend:
    return OpenAICompatBackend(
        spec.base_url,
        api_key=checked_key(spec),
        timeout=spec.timeout,
        stream=spec.stream,
        stream_options=preset_for(spec).stream_options,
        max_connections=spec.most_in_flight,
        transport=transport or sim_transport(spec),
    )


def sim_transport(spec: RunSpec) -> Transport | None:
    """The in-process simulator's transport for `--backend sim`; None for real endpoints."""
    return SimTransport(SimModel(sim_config(spec))) if spec.backend == "sim" else None


def metrics_reader(spec: RunSpec, transport: Transport | None = None) -> MetricsReader | None:
    """Where `--concurrency auto` reads the server's running/waiting counts, unless off."""
    if not spec.adaptive or spec.server_metrics == "off":
        return None
    url = metrics_url(spec.base_url) if spec.server_metrics == "auto" else spec.server_metrics
    key = checked_key(spec)
    # The key goes only to the endpoint's own host (llama-server wants it on /metrics).
    same_host = urlsplit(url).netloc == urlsplit(spec.base_url).netloc
    headers = {"authorization": f"Bearer {key}"} if key and same_host else None
    return MetricsReader(url, headers=headers, transport=transport)


def checked_key(spec: RunSpec) -> str | None:
    """The API key, refused early if it cannot be a header value (a stray newline from a
    secrets file would otherwise be echoed back by the HTTP library in an error)."""
    key = spec.api_key()
    if key is not None and not (key.isascii() and key.isprintable() and " " not in key):
        raise UsageError(
            f"the API key in ${spec.api_key_env} has whitespace, control or non-ASCII "
            "characters (a trailing newline?); fix the variable"
        )
    return key


async def pick_model(backend: Backend, spec: RunSpec, policy: RetryPolicy) -> RunSpec:
    """With no --model, use the one model a local server serves (llama.cpp, vLLM...).

    A server that is still starting gets the outage grace period to answer."""
    if spec.model:
        return spec
    try:
        models = await policy.call_within(backend.list_models, spec.outage_timeout)
    except FatalError:
        raise
    except RequestError as exc:
        raise EndpointDown(f"cannot list models at {spec.base_url}: {exc}") from None
    if not models:
        raise FatalError(f"{spec.base_url}/models lists no model; give --model")
    return replace(spec, model=models[0])


async def run_job(
    ledger: Ledger,
    home: Home,
    name: str,
    spec: RunSpec,
    *,
    quiet: bool,
    transport: Transport | None = None,
    settings: RunnerSettings | None = None,
    handle_signals: bool = True,
) -> RunStats:
    """Run every item that is not final yet. Ctrl-C/SIGTERM stop it gracefully."""
    rules = output_rules(spec)
    settings = settings or RunnerSettings()
    transport = transport or sim_transport(spec)
    backend = build_backend(spec, transport)
    reader = metrics_reader(spec, transport)
    log = JobLog(home.log_path(name), name, redact=spec.redact)
    policy = RetryPolicy(
        spec.max_attempts,
        OutageWatch(spec.outage_timeout, settings.clock),
        sleep=settings.sleep,
    )
    try:
        try:
            spec = await pick_model(backend, spec, policy)
        except FatalError as exc:
            log.event("abort", error=str(exc), kind=type(exc).__name__)
            return RunStats(aborted=str(exc))
        counts = ledger.counts(name)
        done_before = sum(counts[s] for s in FINAL_STATUSES)
        progress = Progress(
            total=sum(counts.values()),
            initial=done_before,
            concurrency=spec.most_in_flight,  # the runner shows its own limit
            quiet=quiet,
        )
        runner = Runner(
            ledger,
            backend,
            name,
            spec,
            log=log,
            progress=progress,
            rules=rules,
            settings=settings,
            server_load=reader.read if reader is not None else None,
        )
        try:
            async with anyio.create_task_group() as tg:
                if handle_signals:
                    tg.start_soon(_stop_on_signals, runner)
                stats = await runner.run()
                tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            raise _single_error(group) from None
        finally:
            progress.close()
        return stats
    finally:
        log.close()
        await backend.aclose()
        if reader is not None:
            await reader.aclose()


def output_rules(spec: RunSpec) -> OutputRules:
    """The job's schema, guidance style, repairs and truncation policy, for its items."""
    return OutputRules(
        schema=load_schema(spec.schema) if spec.schema else None,
        guided_style=preset_for(spec).guided_style if spec.guided else None,
        repair_attempts=spec.repair_attempts,
        retry_longer=spec.on_truncate == "retry-longer",
        max_tokens_cap=spec.max_tokens_cap,
    )


def _single_error(group: BaseExceptionGroup) -> BaseException:
    """Task groups wrap errors; hand the caller the batchrun error inside, if there is one,
    so it gets its message and exit code instead of a traceback."""
    leaves: list[BaseException] = []
    stack: list[BaseException] = [group]
    while stack:
        exc = stack.pop()
        if isinstance(exc, BaseExceptionGroup):
            stack.extend(exc.exceptions)
        else:
            leaves.append(exc)
    ours = [e for e in leaves if isinstance(e, BatchrunError)]
    return ours[0] if ours else group


async def _stop_on_signals(runner: Runner) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            runner.request_stop()


def finish(ledger: Ledger, home: Home, name: str, spec: RunSpec) -> tuple[dict[str, int], bool]:
    """After a run: when no item is left to do, mark the job finished and write its results."""
    counts = ledger.counts(name)
    complete = counts["pending"] == 0 and counts["running"] == 0
    if complete:
        export(ledger, home.output_path(name), name, spec)
    ledger.mark_finished(name, complete)
    return counts, complete


def export(ledger: Ledger, path: Path, name: str, spec: RunSpec, fmt: str = "native") -> int:
    return write_results(path, ledger.iter_results(name), fmt=fmt, model=spec.model)


def exit_code(counts: dict[str, int], stats: RunStats | None) -> int:
    left = counts["pending"] + counts["running"]
    if stats is not None and stats.aborted and left:
        return EXIT_ABORTED
    if stats is not None and stats.interrupted and left:
        return EXIT_INTERRUPTED
    if left:
        return EXIT_SOME_FAILED
    bad = counts["failed"] + counts["invalid"] + counts["rejected"]
    return EXIT_SOME_FAILED if bad else EXIT_OK


def summary_line(
    name: str, counts: dict[str, int], stats: RunStats | None, output: Path | None
) -> str:
    parts = [f"job {name}:"] + [
        f"{counts[s]} {s}" for s in (*FINAL_STATUSES, "pending") if counts[s] or s == "done"
    ]
    text = " ".join(parts[:2]) + (", " + ", ".join(parts[2:]) if len(parts) > 2 else "")
    if stats is not None and stats.requests:
        secs = max(stats.elapsed, 1e-9)
        text += (
            f" | {stats.requests} requests, {stats.retries} retries, {secs:.1f}s, "
            f"{stats.recorded / secs:.1f} items/s, {stats.output_tokens / secs:,.0f} out tok/s"
        )
    if stats is not None and stats.repairs:
        text += f" | {stats.repairs} repairs ({stats.repair_tokens:,} tokens)"
    if stats is not None and stats.guided_refused:
        text += f" | the server refused response_format, sent without it: {stats.guided_refused}"
    if stats is not None and stats.aborted:
        text += f" | ABORTED: {stats.aborted}"
    elif stats is not None and stats.interrupted and counts["pending"]:
        text += " | interrupted; run `batchrun resume " + name + "` to continue"
    if output is not None:
        text += f" | results: {output}"
    return text
