"""The `batchrun` command: parses options, calls the Python API (api.py), prints what it
says and maps errors to exit codes. No SQL, no HTTP here.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import anyio
import click
import orjson

from batchrun import __version__, api, retention
from batchrun.cli_bench import bench
from batchrun.cli_errors import EXIT_ABORTED, errors_to_exit_codes, say, show
from batchrun.cli_report import ProgressBar, finish, ran
from batchrun.cli_sim import sim
from batchrun.config import resolve
from batchrun.doctor import diagnose, ready, render
from batchrun.endpoints import is_endpoint, shown_endpoint
from batchrun.errors import UsageError
from batchrun.outputs import FORMATS
from batchrun.presets import PRESETS
from batchrun.status_view import render_detail, render_table

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Context:
    home: Path
    ledger: str | None

    @property
    def where(self) -> dict[str, Any]:
        """Where the API's verbs find the ledger."""
        return {"home": self.home, "ledger": self.ledger}


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
    click.option(
        "--endpoint",
        multiple=True,
        metavar="chat|completions|NAME=URL[,...]",
        help="The API (chat or completions) [chat]; or, repeated, several endpoints for one job: "
        "NAME=URL[,model=M][,key=VAR][,backend=PRESET][,weight=W][,rpm=R][,tpm=T].",
    ),
    click.option(
        "--mode",
        type=click.Choice(["online", "batch"]),
        help="online: ordinary requests; batch: the provider's Batch API (/v1/batches), at its "
        "discount, answers within its window [online].",
    ),
    click.option(
        "--then",
        type=click.Choice(["none", "online"]),
        help="After --mode batch: send what batches left (failed, expired) as ordinary "
        "requests (online), or leave it pending [none].",
    ),
    click.option(
        "--batch-max-requests",
        type=click.IntRange(min=1),
        help="Lines per batch file at most [50000].",
    ),
    click.option(
        "--batch-max-bytes", type=click.IntRange(min=1000), help="Bytes per batch file [200MB]."
    ),
    click.option(
        "--poll-interval",
        type=click.FloatRange(min=0, min_open=True),
        help="Seconds between looks at a running batch, at the longest [30].",
    ),
    click.option(
        "--order",
        type=click.Choice(["auto", "prefix", "input"]),
        help="Send lines sharing a long prompt prefix together (prefix), or in input order; "
        "auto: prefix, but input against llama.cpp's server [auto]. Results are in input "
        "order either way.",
    ),
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
        help="Where the server publishes its running/waiting request counts, for "
        "--concurrency auto: auto (the endpoint's /metrics, else llama-server's /slots, used "
        "when it has them), a URL, or off [auto].",
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
    click.option(
        "--lease",
        type=click.FloatRange(min=1),
        help="Seconds a worker's claims outlive its last heartbeat; a worker silent longer "
        "loses its items to the others [60].",
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
    click.option(
        "--reuse/--no-reuse",
        default=None,
        help="Copy an earlier job's answer to the same request under the same model, sampling "
        "and schema, and answer repeated lines once, instead of sending them [on].",
    ),
    click.option("--reuse-max-age", help="Reuse only answers this recent: 7d, 12h, 30m [any]."),
    click.option(
        "--max-total-tokens",
        type=click.IntRange(min=1),
        help="Stop before the job's prompt + completion tokens would pass this [no limit].",
    ),
    click.option(
        "--max-cost",
        type=click.FloatRange(min=0),
        help="Stop before the job's cost would pass this, at --price-in/--price-out.",
    ),
    click.option("--price-in", type=click.FloatRange(min=0), help="Price of 1M prompt tokens."),
    click.option("--price-out", type=click.FloatRange(min=0), help="Price of 1M output tokens."),
    click.option("--redact", is_flag=True, default=None, help="Keep input text out of the log."),
    click.option("--quiet", "-q", is_flag=True, help="No progress bar."),
]


def run_options(fn: F) -> F:
    for option in reversed(RUN_OPTIONS):
        fn = option(fn)
    return fn


def _run_options(options: dict[str, Any]) -> dict[str, Any]:
    """The options given (click passes None for the ones left out); `--endpoint` is the API
    kind (chat, completions) or, with NAME=URL, one of several endpoints."""
    given = {key: value for key, value in options.items() if value is not None}
    values = given.pop("endpoint", ())
    kinds = [value for value in values if not is_endpoint(value)]
    if len(kinds) > 1:
        raise UsageError("--endpoint chat|completions given twice")
    if kinds:
        given["endpoint"] = kinds[0]
    if len(kinds) < len(values):
        given["endpoints"] = [value for value in values if is_endpoint(value)]
    return given


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
    bar = ProgressBar(quiet=quiet)
    with bar:
        call = functools.partial(
            api.submit_async, input_path, job=job_name, run=not no_run, spec=spec_file
        )
        said = bar.say if no_run or not quiet else None  # --no-run's answer is what it says
        listen = {"on_progress": bar, "on_message": said}
        report = ran(call, {**listen, **ctx.where, **_run_options(options)})
    if not no_run:
        finish(report, quiet=quiet)


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
    bar = ProgressBar(quiet=quiet)
    with bar:
        call = functools.partial(
            api.resume_async, job_name, allow_changed_input=allow_changed_input, spec=spec_file
        )
        listen = {"on_progress": bar, "on_message": None if quiet else bar.say}
        report = ran(call, {**listen, **ctx.where, **_run_options(options)})
    finish(report, quiet=quiet)


@main.command()
@click.argument("job_name", required=False)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
@errors_to_exit_codes
def status(ctx: Context, job_name: str | None, as_json: bool) -> None:
    """All jobs, or one job in detail."""
    if job_name is None:
        rows = api.list_jobs(**ctx.where)
        show(_dump(rows) if as_json else render_table(rows))
        return
    detail = api.status(job_name, **ctx.where)
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
    path = api.export(job_name, fmt=fmt, path=output, **ctx.where)
    with path.open("rb") as f:
        say(f"wrote {sum(1 for _ in f)} lines to {path}")


@main.command()
@click.argument("job_name")
@pass_ctx
@errors_to_exit_codes
def retry(ctx: Context, job_name: str) -> None:
    """Put JOB_NAME's failed and invalid items back to pending (then run `resume`)."""
    count = api.retry(job_name, **ctx.where)
    say(f"{count} item(s) of {job_name} back to pending; run `batchrun resume {job_name}`")


@main.command()
@click.argument("job_name")
@click.option("--forget", is_flag=True, help="A batch the provider does not know is gone.")
@pass_ctx
@errors_to_exit_codes
def cancel(ctx: Context, job_name: str, forget: bool) -> None:
    """Cancel JOB_NAME's running hosted batches (--mode batch); `resume` then collects what
    they answered, and the rest goes back to pending."""
    ids = api.cancel(job_name, forget=forget, **ctx.where)
    say(f"cancelled {len(ids)} batch(es) of {job_name}" + (f": {', '.join(ids)}" if ids else ""))


@main.command()
@click.option("--older-than", default="30d", show_default=True, help="Age: 30d, 12h, 90m.")
@click.option("--all", "everything", is_flag=True, help="Keep nothing, not even for reuse.")
@pass_ctx
@errors_to_exit_codes
def gc(ctx: Context, older_than: str, everything: bool) -> None:
    """Remove jobs untouched for --older-than: their items, results files and logs, keeping the
    answers later jobs may reuse (or nothing, with --all), then give the space back. A job a
    live worker is running is never touched."""
    done = retention.gc(older_than, everything=everything, **ctx.where)
    kept = "" if everything else f", kept {done.kept:,} answers for reuse"
    say(f"removed {len(done.jobs)} job(s): {done.removed:,} items{kept}")
    for name in done.running:
        say(f"left {name} alone: a worker is running it, or a batch of it is open")


@main.command()
@click.option("--backend", type=click.Choice(sorted(PRESETS)), help="Server preset.")
@click.option("--base-url", help="OpenAI-compatible base URL.")
@click.option("--model", help="Model to check [default: the first one the server lists].")
@click.option("--api-key-env", help="NAME of the environment variable holding the API key.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), help="Seconds [120].")
@click.option("--stream/--no-stream", default=None, help="As the job will run [streamed].")
@errors_to_exit_codes
def doctor(**options: Any) -> None:
    """Probe an endpoint: reachable, key, model, chat/completions, streaming, usage, JSON mode."""
    spec = resolve({k: v for k, v in options.items() if v is not None})
    named = "" if spec.backend == "custom" else f"{spec.backend} "  # custom: the URL alone
    say(f"checking {named}at {shown_endpoint(spec.base_url)} ...")
    checks = anyio.run(diagnose, spec)
    show(render(checks))
    if not ready(checks):
        say("not ready: fix the FAIL lines marked above before running a job")
        sys.exit(EXIT_ABORTED)
    say("ready: a job can run against this endpoint")


main.add_command(sim)
main.add_command(bench)
