"""`batchrun bench` and `batchrun bench compare`: the command-line side of batchrun/bench/."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import anyio
import click

from batchrun.bench import compare as comparing
from batchrun.bench import plots
from batchrun.bench.load import LoadPlan
from batchrun.bench.run import Endpoint, output_folder, parse_endpoint, run_bench
from batchrun.bench.suite import builtin_suite, load_suite, select
from batchrun.cli_errors import errors_to_exit_codes, say, show
from batchrun.config import resolve
from batchrun.endpoints import host_port
from batchrun.errors import UsageError
from batchrun.presets import PRESETS


def _levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise UsageError(f"--concurrency {text!r}: write levels like 1,4,8,16") from None
    if not levels or levels[0] < 1:
        raise UsageError("--concurrency levels must be 1 or more")
    return levels


@click.group(invoke_without_command=True)
@click.option(
    "--endpoint",
    "endpoints",
    multiple=True,
    metavar="NAME=URL[,model=M][,key=VAR][,backend=PRESET]",
    help="An endpoint to measure (repeat for several; run one after another).",
)
@click.option("--backend", type=click.Choice(sorted(PRESETS)), help="One endpoint by preset.")
@click.option("--base-url", help="One endpoint by URL.")
@click.option("--model", help="Model [default: the first the server lists].")
@click.option("--api-key-env", help="NAME of the variable holding the API key.")
@click.option("--concurrency", default="1,4,8,16", show_default=True, help="Levels to sweep.")
@click.option(
    "--rate",
    type=click.FloatRange(min=0, min_open=True),
    help="Open loop: Poisson arrivals at this many requests/s (capped at each level).",
)
@click.option(
    "--repeat",
    default=10,
    show_default=True,
    type=click.IntRange(min=1),
    help="Measured requests per class per level (at least one per slot).",
)
@click.option(
    "--warmup",
    default=2,
    show_default=True,
    type=click.IntRange(min=0),
    help="Requests per class per level sent first and not counted.",
)
@click.option("--classes", help="Comma-separated classes to run [all of the suite].")
@click.option(
    "--suite",
    "suite_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="JSONL suite with a `class` and `prompt` per line [built-in: short, summary, code, json].",
)
@click.option("--max-tokens", type=click.IntRange(min=1), help="Override every class's.")
@click.option("--seed", default=0, show_default=True, help="Sent with every request.")
@click.option("--timeout", default=300.0, show_default=True, help="Seconds per request.")
@click.option(
    "--guided/--no-guided",
    default=True,
    show_default=True,
    help="Send the JSON class's schema as response_format.",
)
@click.option(
    "--self-test/--no-self-test",
    default=True,
    show_default=True,
    help="Measure this client against the built-in simulator first.",
)
@click.option("--label", help="Name of the run [the endpoint names].")
@click.option(
    "-o",
    "--output",
    type=click.Path(file_okay=False, path_type=Path),
    help="Folder for the files [HOME/outputs/bench-LABEL-TIME].",
)
@click.pass_context
@errors_to_exit_codes
def bench(ctx: click.Context, /, **o: Any) -> None:
    """Measure endpoints like serving engineers do: TTFT, TPOT, ITL, E2E percentiles and
    throughput over a concurrency sweep, per prompt class, with the knee of each."""
    if ctx.invoked_subcommand is not None:
        return
    endpoints = _endpoints(o)
    plan = LoadPlan(_levels(o["concurrency"]), o["repeat"], o["warmup"], o["rate"], o["seed"])
    # built in: as many prompts as the sweep sends of a class, so none is sent twice
    suite = load_suite(o["suite_path"]) if o["suite_path"] else builtin_suite(plan.per_class())
    names = [c.strip() for c in o["classes"].split(",")] if o["classes"] else None
    suite = select(suite, names, o["max_tokens"])
    label = o["label"] or "+".join(e.name for e in endpoints)
    folder = o["output"] or output_folder(ctx.obj.home / "outputs", label)
    run = functools.partial(run_bench, label=label, guided=o["guided"], say=say, show=show)
    anyio.run(functools.partial(run, endpoints, suite, plan, folder, selftest=o["self_test"]))


def _endpoints(o: dict[str, Any]) -> list[Endpoint]:
    def spec_of(options: dict[str, Any]) -> Any:
        return resolve({"timeout": o["timeout"], "max_concurrency": 1024, **options})

    endpoints = [parse_endpoint(text, spec_of) for text in o["endpoints"]]
    if o["backend"] or o["base_url"]:
        one = {k: o[k] for k in ("backend", "base_url", "model", "api_key_env")}
        spec = spec_of({k: v for k, v in one.items() if v is not None})
        endpoints.append(Endpoint(spec.backend if o["backend"] else host_port(spec.base_url), spec))
    if not endpoints:
        raise UsageError("nothing to measure: give --endpoint NAME=URL, --backend or --base-url")
    if len({e.name for e in endpoints}) < len(endpoints):
        raise UsageError("two endpoints have the same name; name each one differently")
    return endpoints


@bench.command("compare")
@click.argument("run_a", type=click.Path(file_okay=False, exists=True, path_type=Path))
@click.argument("run_b", type=click.Path(file_okay=False, exists=True, path_type=Path))
@click.option(
    "-o",
    "--output",
    type=click.Path(file_okay=False, path_type=Path),
    help="Folder for the overlaid charts [RUN_B/compare-<RUN_A name>].",
)
@errors_to_exit_codes
def compare(run_a: Path, run_b: Path, output: Path | None) -> None:
    """Two bench runs side by side: B / A for each class and level both have."""
    a, b = comparing.load(run_a), comparing.load(run_b)
    show(comparing.render(a["label"], b["label"], comparing.ratios(a, b)))
    if not plots.available():
        say(plots.MISSING)
        return
    folder = output or run_b / f"compare-{run_a.name}"
    folder.mkdir(parents=True, exist_ok=True)
    files = plots.write_charts(folder, [(f"A {a['label']}", a), (f"B {b['label']}", b)])
    say(f"wrote {', '.join(p.name for p in files)} to {folder}")
