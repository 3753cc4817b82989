"""`batchrun sim`: serve the built-in OpenAI-compatible simulator on a real socket."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Any

import anyio
import click
import orjson

from batchrun.cli_errors import errors_to_exit_codes
from batchrun.errors import UsageError
from batchrun.sim import SimConfig, SimModel, SimServer
from batchrun.sim.faults import FAULT_KINDS, check_rates
from batchrun.sim.json_answers import JSON_STYLES
from batchrun.sim.settings import config_problem


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option(
    "--port",
    default=8089,
    show_default=True,
    type=click.IntRange(0, 65535),
    help="Port (0 picks a free one and prints it).",
)
@click.option("--ttft-ms", default=50.0, show_default=True, help="Time to first token.")
@click.option("--tpot-ms", default=5.0, show_default=True, help="Time per output token.")
@click.option(
    "--prefill-ms-per-token",
    default=0.0,
    show_default=True,
    help="Extra time to first token per prompt token.",
)
@click.option(
    "--prefix-cache-blocks",
    default=SimConfig.prefix_cache_blocks,
    show_default=True,
    type=click.IntRange(min=0),
    help="Prefix cache size in blocks of 64 tokens (256 characters); 0 turns it off. A prompt's "
    "cached start costs no --prefill-ms-per-token.",
)
@click.option("--min-output-tokens", default=8, show_default=True)
@click.option("--max-output-tokens", default=48, show_default=True)
@click.option("--model", "models", multiple=True, help="Model name(s) served [sim-1].")
@click.option("--strict-models", is_flag=True, help="Answer 404 to an unknown model.")
@click.option("--api-key-env", help="Require the key held in this environment variable.")
@click.option(
    "--fault",
    "faults",
    multiple=True,
    metavar="KIND=RATE",
    help=f"Inject a fault with this probability; KIND is one of {', '.join(FAULT_KINDS)}.",
)
@click.option("--fault-seed", default=0, show_default=True, help="Seed of the fault choice.")
@click.option(
    "--slots",
    type=click.IntRange(min=1),
    help="Batch slots (like vLLM's max_num_seqs); more requests wait in a queue.",
)
@click.option(
    "--tpot-slope",
    default=0.0,
    show_default=True,
    help="How much slower each token is with every slot busy (0.5: 50% slower).",
)
@click.option(
    "--queue-limit",
    type=click.IntRange(min=0),
    help="Refuse requests past this many waiting (with --gate-status).",
)
@click.option("--gate-status", type=click.Choice(["429", "503"]), default="429", show_default=True)
@click.option("--rpm", type=click.IntRange(min=1), help="Hosted-API limit: requests a minute.")
@click.option("--tpm", type=click.IntRange(min=1), help="Hosted-API limit: tokens a minute.")
@click.option(
    "--retry-after-ms",
    default=50.0,
    show_default=True,
    help="What a simulated 429 asks clients to wait.",
)
@click.option(
    "--json-style",
    "json_styles",
    multiple=True,
    metavar="STYLE=RATE",
    help=f"Answer JSON in this style with this probability; STYLE is one of "
    f"{', '.join(JSON_STYLES)} (the rest: valid). Requests with a schema get valid JSON.",
)
@click.option(
    "--json-schema",
    type=click.Path(dir_okay=False, exists=True),
    help="The schema JSON answers follow when a request sends none.",
)
@click.option("--repair-fails", is_flag=True, help="Repair follow-ups get broken JSON again.")
@click.option(
    "--refuse-response-format", is_flag=True, help="Answer 400 to requests with response_format."
)
@click.option(
    "--no-metrics", is_flag=True, help="Answer 404 to GET /metrics, like a server without them."
)
@click.option(
    "--batch-seconds",
    default=SimConfig.batch_seconds,
    show_default=True,
    type=click.FloatRange(min=0),
    help="Batch API: seconds in which a batch's lines are answered.",
)
@click.option(
    "--batch-window-s",
    default=SimConfig.batch_window_s,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help='Batch API: seconds of a batch\'s "24h" window; a batch not done by then expires.',
)
@click.option(
    "--batch-max-requests",
    default=SimConfig.batch_max_requests,
    show_default=True,
    type=click.IntRange(min=1),
    help="Batch API: the most lines an input file may hold.",
)
@errors_to_exit_codes
def sim(
    host: str,
    port: int,
    ttft_ms: float,
    tpot_ms: float,
    prefill_ms_per_token: float,
    prefix_cache_blocks: int,
    min_output_tokens: int,
    max_output_tokens: int,
    models: tuple[str, ...],
    strict_models: bool,
    api_key_env: str | None,
    faults: tuple[str, ...],
    fault_seed: int,
    retry_after_ms: float,
    slots: int | None,
    tpot_slope: float,
    queue_limit: int | None,
    gate_status: str,
    rpm: int | None,
    tpm: int | None,
    json_styles: tuple[str, ...],
    json_schema: str | None,
    repair_fails: bool,
    refuse_response_format: bool,
    no_metrics: bool,
    batch_seconds: float,
    batch_window_s: float,
    batch_max_requests: int,
) -> None:
    """Serve the built-in OpenAI-compatible simulator (synthetic outputs) until stopped.

    GET /sim/stats reports requests, faults injected by kind, prompts answered twice and prefix
    cache hits; GET /metrics the requests running and waiting and the prefix cache's queried and
    cached tokens, under vLLM's Prometheus names. /v1/files and /v1/batches serve OpenAI's
    Batch API on a time scale (--batch-seconds, --batch-window-s)."""
    api_key = None
    if api_key_env:
        api_key = os.environ.get(api_key_env)
        if not api_key:
            raise UsageError(f"--api-key-env {api_key_env}: that variable is not set")
    config = SimConfig(
        ttft_ms=ttft_ms,
        tpot_ms=tpot_ms,
        prefill_ms_per_token=prefill_ms_per_token,
        prefix_cache_blocks=prefix_cache_blocks,
        min_output_tokens=min_output_tokens,
        max_output_tokens=max_output_tokens,
        models=models or ("sim-1",),
        strict_models=strict_models,
        faults=_rates(faults, "--fault", FAULT_KINDS),
        fault_seed=fault_seed,
        retry_after_ms=retry_after_ms,
        slots=slots,
        tpot_slope=tpot_slope,
        queue_limit=queue_limit,
        gate_status=int(gate_status),
        rpm=rpm,
        tpm=tpm,
        api_key=api_key,
        json_styles=_rates(json_styles, "--json-style", JSON_STYLES),
        json_schema=_schema(json_schema) if json_schema else None,
        repair_fixes=not repair_fails,
        refuse_response_format=refuse_response_format,
        metrics=not no_metrics,
        batch_seconds=batch_seconds,
        batch_window_s=batch_window_s,
        batch_max_requests=batch_max_requests,
    )
    if (problem := config_problem(config)) is not None:
        raise UsageError(f"batchrun sim: {problem.replace('_', '-')}")  # named as its flag
    server = SimServer(SimModel(config))

    def ready(bound: int) -> None:
        click.echo(f"batchrun sim: serving http://{host}:{bound}/v1 (synthetic outputs)")
        sys.stdout.flush()

    try:
        anyio.run(functools.partial(server.serve, host, port, ready))
    except KeyboardInterrupt:
        pass
    except OSError as exc:
        raise UsageError(f"cannot serve on {host}:{port}: {exc.strerror or exc}") from None


def _rates(specs: tuple[str, ...], option: str, known: tuple[str, ...]) -> dict[str, float]:
    """Parse repeated KIND=RATE options (--fault, --json-style)."""
    rates: dict[str, float] = {}
    for item in specs:
        kind, sep, rate = item.partition("=")
        try:
            if not sep:
                raise ValueError(item)
            rates[kind.strip()] = float(rate)
        except ValueError:
            raise UsageError(f"{option} {item!r}: write KIND=RATE, e.g. {known[0]}=0.05") from None
    try:
        return check_rates(rates, known, option.lstrip("-"))
    except ValueError as exc:
        raise UsageError(f"{option}: {exc}") from None


def _schema(path: str) -> dict[str, Any]:
    try:
        schema = orjson.loads(Path(path).read_bytes())
    except (OSError, orjson.JSONDecodeError) as exc:
        raise UsageError(f"--json-schema {path}: cannot read it as JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise UsageError(f"--json-schema {path}: must hold a JSON object")
    return schema
