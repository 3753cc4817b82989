"""The `batchrun` command: parses options, calls the library, maps errors to exit codes.

The only module that calls anyio.run. No SQL, no HTTP here.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio
import click
import orjson

from batchrun import __version__, jobs
from batchrun.cli_bench import bench
from batchrun.cli_errors import errors_to_exit_codes, say, show
from batchrun.cli_sim import sim
from batchrun.config import PRESETS, RunSpec, load_spec_file, resolve
from batchrun.doctor import diagnose, ready, render
from batchrun.errors import UsageError
from batchrun.jobs import Home
from batchrun.ledger import IngestReport, Ledger
from batchrun.outputs import FORMATS
from batchrun.status import job_detail, jobs_table, render_detail, render_table

F = TypeVar("F", bound=Callable[..., Any])


class Context:
    def __init__(self, home: Path, ledger_url: str | None) -> None:
        self.home = Home.at(home, ledger_url)
        self._ledger: Ledger | None = None

    @property
    def ledger(self) -> Ledger:
        if self._ledger is None:
            self._ledger = Ledger(self.home.ledger_url)
        return self._ledger


pass_ctx = click.make_pass_decorator(Context)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="batchrun")
@click.option(
    "--home",
    type=click.Path(file_okay=False, path_type=Path),
    envvar="BATCHRUN_HOME",
    default=".",
    show_default=True,
    help="Folder holding jobs/ outputs/ logs/.",
)
@click.option(
    "--ledger",
    "ledger_url",
    envvar="BATCHRUN_LEDGER",
    default=None,
    help="SQLAlchemy URL of the ledger [default: sqlite:///HOME/jobs/ledger.db].",
)
@click.pass_context
def main(ctx: click.Context, home: Path, ledger_url: str | None) -> None:
    """Push JSONL files of prompts through OpenAI-compatible endpoints, durably."""
    ctx.obj = Context(home, ledger_url)


# --- run options, shared by submit and resume ------------------------------------------------

RUN_OPTIONS: list[Callable[[F], F]] = [
    click.option(
        "--spec",
        "spec_file",
        type=click.Path(dir_okay=False, path_type=Path),
        help="Job spec TOML (the command line wins over it).",
    ),
    click.option(
        "--backend",
        type=click.Choice(sorted(PRESETS)),
        help="Server preset: base URL, key variable, quirks.",
    ),
    click.option("--base-url", help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1."),
    click.option("--model", help="Model name [default: the first one the server lists]."),
    click.option("--api-key-env", help="NAME of the environment variable holding the API key."),
    click.option("--endpoint", type=click.Choice(["chat", "completions"]), help="[default: chat]"),
    click.option("--stream/--no-stream", default=None, help="Stream responses [default: on]."),
    click.option(
        "--concurrency",
        metavar="auto|N",
        help="Requests in flight, or auto to find the server's knee [auto].",
    ),
    click.option(
        "--max-concurrency",
        type=click.IntRange(min=1),
        help="The most --concurrency auto may reach [256].",
    ),
    click.option(
        "--server-metrics",
        help="Where the server publishes its running/waiting request counts (Prometheus), for "
        "--concurrency auto: auto (the endpoint's /metrics, used when it has them), a URL, "
        "or off [auto].",
    ),
    click.option(
        "--rpm",
        type=click.FloatRange(min=0, min_open=True),
        help="Pace requests to this many a minute.",
    ),
    click.option(
        "--tpm",
        type=click.FloatRange(min=0, min_open=True),
        help="Pace to this many tokens a minute (prompt estimate + max_tokens).",
    ),
    click.option("--max-attempts", type=click.IntRange(min=1), help="Tries per item [5]."),
    click.option(
        "--timeout", type=click.FloatRange(min=0, min_open=True), help="Seconds per request [120]."
    ),
    click.option(
        "--outage-timeout",
        type=click.FloatRange(min=0),
        help="Seconds the endpoint may stay unreachable before the job stops [60].",
    ),
    click.option("--max-tokens", type=click.IntRange(min=1), help="Default max_tokens."),
    click.option("--temperature", type=float, help="Default temperature."),
    click.option("--top-p", type=float, help="Default top_p."),
    click.option(
        "--schema", type=click.Path(dir_okay=False), help="JSON Schema the output must satisfy."
    ),
    click.option(
        "--guided/--no-guided",
        default=None,
        help="Send the schema for constrained decoding (response_format) [on].",
    ),
    click.option(
        "--repair-attempts",
        type=click.IntRange(min=0),
        help="Re-ask with the validation error this many times before `invalid` [1].",
    ),
    click.option(
        "--on-truncate",
        type=click.Choice(["fail", "retry-longer"]),
        help="An answer cut by max_tokens: keep it (invalid with a schema), or retry with "
        "max_tokens doubled up to --max-tokens-cap [fail].",
    ),
    click.option("--max-tokens-cap", type=click.IntRange(min=1), help="See --on-truncate [4096]."),
    click.option("--redact", is_flag=True, default=None, help="Keep input text out of the log."),
    click.option("--quiet", "-q", is_flag=True, help="No progress bar."),
]


def run_options(fn: F) -> F:
    for option in reversed(RUN_OPTIONS):
        fn = option(fn)
    return fn


def _layers(spec_file: Path | None, options: dict[str, Any]) -> list[dict[str, Any]]:
    layers = [load_spec_file(spec_file)] if spec_file else []
    layers.append(options)
    return layers


def _run(ctx: Context, name: str, spec: RunSpec, quiet: bool) -> None:
    ledger, home = ctx.ledger, ctx.home
    counts = ledger.counts(name)
    stats = None
    if counts["pending"] or counts["running"]:
        stats = anyio.run(functools.partial(jobs.run_job, ledger, home, name, spec, quiet=quiet))
    else:
        say(f"job {name} has nothing left to do")
    job = ledger.get_job(name)
    final_spec = jobs.job_spec(job) if job else spec
    counts, complete = jobs.finish(ledger, home, name, final_spec)
    output = home.output_path(name) if complete else None
    say(jobs.summary_line(name, counts, stats, output))
    sys.exit(jobs.exit_code(counts, stats))


@main.command()
@click.argument("input_path", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--job", "job_name", help="Job name [default: the input file's name].")
@click.option(
    "--skip-invalid",
    is_flag=True,
    default=None,
    help="Record bad lines as rejected instead of refusing the file.",
)
@click.option("--max-line-bytes", type=click.IntRange(min=1), help="Longest line accepted [1MB].")
@click.option(
    "--max-input-chars",
    type=click.IntRange(min=1),
    help="Refuse lines whose prompt text is longer (checked before sending).",
)
@click.option(
    "--max-input-tokens",
    type=click.IntRange(min=1),
    help="Refuse lines whose prompt is longer, estimated at 4 characters a token.",
)
@click.option("--no-run", is_flag=True, help="Load the file into the ledger, send nothing.")
@run_options
@pass_ctx
@errors_to_exit_codes
def submit(
    ctx: Context,
    /,
    input_path: Path,
    job_name: str | None,
    no_run: bool,
    quiet: bool,
    spec_file: Path | None,
    **options: Any,
) -> None:
    """Create a job from INPUT_PATH (JSONL) and run it to the end.

    Submitting the same file under the same job name again resumes that job instead.
    """
    name = jobs.check_job_name(job_name or jobs.default_job_name(input_path))
    ledger = ctx.ledger
    layers = _layers(spec_file, options)
    existing = ledger.get_job(name)
    spec = jobs.resolve_for_job(existing, *layers, endpoint_required=not no_run)
    if existing is None:
        report = jobs.create_or_join(ledger, name, input_path, spec)
        if report is None:  # another submit made it since we looked: as if it had been there
            existing = ledger.get_job(name)
            assert existing is not None
            spec = jobs.resolve_for_job(existing, *layers, endpoint_required=not no_run)
        elif not quiet:
            say(_loaded(name, report))
    if existing is not None:
        if not jobs.same_input(existing, input_path):
            raise UsageError(
                f"job {name!r} exists and was made from a different input "
                f"({existing.input_path}); use another --job name"
            )
        if not quiet:
            say(f"job {name} exists for this file; {_left(ledger, name, no_run)}")
    if no_run:
        return
    _run(ctx, name, spec, quiet)


def _left(ledger: Ledger, name: str, no_run: bool) -> str:
    """What a second submit of the same file does: resume, or (--no-run) nothing."""
    if not no_run:
        return "resuming it"
    counts = ledger.counts(name)
    waiting = counts["pending"] + counts["running"]
    return f"nothing loaded (--no-run); {waiting} item(s) still to send: `batchrun resume {name}`"


def _loaded(name: str, report: IngestReport) -> str:
    rejected = f", {report.rejected} rejected" if report.rejected else ""
    blank = f", {len(report.blank_lines)} blank line(s) skipped" if report.blank_lines else ""
    return f"job {name}: loaded {report.accepted} items{rejected}{blank}"


@main.command()
@click.argument("job_name")
@click.option(
    "--allow-changed-input",
    is_flag=True,
    help="Resume even if the input file changed since submit.",
)
@run_options
@pass_ctx
@errors_to_exit_codes
def resume(
    ctx: Context,
    /,
    job_name: str,
    allow_changed_input: bool,
    quiet: bool,
    spec_file: Path | None,
    **options: Any,
) -> None:
    """Continue JOB_NAME: every item that has no final record yet."""
    job = _job(ctx, job_name)
    note = jobs.check_input_unchanged(job, allow=allow_changed_input)
    if note:
        say(note)
    spec = jobs.resolve_for_job(job, *_layers(spec_file, options))
    _run(ctx, job.name, spec, quiet)


def _job(ctx: Context, name: str) -> Any:
    job = ctx.ledger.get_job(name)
    if job is None:
        known = ", ".join(j.name for j in ctx.ledger.list_jobs()) or "none"
        raise UsageError(f"no job named {name!r} in {ctx.home.ledger_url} (jobs: {known})")
    return job


@main.command()
@click.argument("job_name", required=False)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
@errors_to_exit_codes
def status(ctx: Context, job_name: str | None, as_json: bool) -> None:
    """All jobs, or one job in detail."""
    if job_name is None:
        rows = jobs_table(ctx.ledger)
        show(_dump(rows) if as_json else render_table(rows))
        return
    detail = job_detail(ctx.ledger, _job(ctx, job_name))
    show(_dump(detail) if as_json else render_detail(detail))


def _dump(data: Any) -> str:
    return orjson.dumps(data, option=orjson.OPT_INDENT_2).decode()


@main.command()
@click.argument("job_name")
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Where to write [default: HOME/outputs/JOB.jsonl].",
)
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="native", show_default=True)
@pass_ctx
@errors_to_exit_codes
def export(ctx: Context, job_name: str, output: Path | None, fmt: str) -> None:
    """Write JOB_NAME's results file again (one line per input line, input order)."""
    job = _job(ctx, job_name)
    path = output or ctx.home.output_path(job.name)
    spec = jobs.job_spec(job)
    count = jobs.export(ctx.ledger, path, job.name, spec, fmt)
    say(f"wrote {count} lines to {path}")


@main.command()
@click.argument("job_name")
@pass_ctx
@errors_to_exit_codes
def retry(ctx: Context, job_name: str) -> None:
    """Put JOB_NAME's failed and invalid items back to pending (then run `resume`)."""
    job = _job(ctx, job_name)
    count = ctx.ledger.requeue(job.name)
    say(f"{count} item(s) of {job.name} back to pending; run `batchrun resume {job.name}`")


@main.command()
@click.option("--backend", type=click.Choice(sorted(PRESETS)), help="Server preset.")
@click.option("--base-url", help="OpenAI-compatible base URL.")
@click.option("--model", help="Model to check [default: the first one the server lists].")
@click.option("--api-key-env", help="NAME of the environment variable holding the API key.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), help="Seconds [120].")
@errors_to_exit_codes
def doctor(**options: Any) -> None:
    """Probe an endpoint: reachable, key, model, chat/completions, streaming, usage, JSON mode."""
    spec = resolve({k: v for k, v in options.items() if v is not None})
    named = "" if spec.backend == "custom" else f"{spec.backend} "  # custom: the URL alone
    say(f"checking {named}at {spec.base_url} ...")
    checks = anyio.run(diagnose, spec)
    show(render(checks))
    if not ready(checks):
        say("not ready: fix the FAIL lines marked above before running a job")
        sys.exit(jobs.EXIT_ABORTED)
    say("ready: a job can run against this endpoint")


main.add_command(sim)
main.add_command(bench)
