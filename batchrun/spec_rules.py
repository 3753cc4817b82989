"""The rules a resolved run spec keeps: values in range, options that need each other, URLs
that can be read, a key variable that is a name. Apart from config.py, which merges layers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchrun.endpoints import not_a_name, parse_endpoints, url_problem
from batchrun.errors import OptionError, UsageError
from batchrun.presets import PRESETS, Preset

if TYPE_CHECKING:
    from batchrun.config import RunSpec

ENDPOINTS = ("chat", "completions")
ON_TRUNCATE = ("fail", "retry-longer")
ORDERS = ("auto", "prefix", "input")


def validate(spec: RunSpec, preset: Preset | None, *, stored: bool = False) -> None:
    """Every rule a resolved spec must keep, as an OptionError naming the option (never
    echoing a value that may hold a secret). `preset`: a run's, whose key must be set now."""
    if spec.endpoint not in ENDPOINTS:  # not echoed: an endpoint's URL given here by mistake
        raise OptionError("{endpoint} must be chat or completions (NAME=URL is --endpoint too)")
    several = parse_endpoints(spec.endpoints)
    if len(several) > 1 and spec.server_metrics not in ("auto", "off"):
        raise OptionError(
            "{server_metrics} URL names one server; with several endpoints give auto or off"
        )
    for e in several:
        if e.key and (why := not_a_name(e.key)):  # not echoed, like api_key_env
            raise UsageError(f"--endpoint {e.name}: key= {why}")
        if e.backend and e.backend not in PRESETS:
            raise UsageError(f"--endpoint {e.name}: unknown backend {e.backend!r}")
    if spec.mode not in ("online", "batch") or spec.then not in ("none", "online"):
        raise OptionError("{mode} must be online or batch, and {then} none or online")
    if spec.mode == "batch" and (not spec.model or spec.endpoints):
        raise OptionError(
            "{mode} batch needs {model}, and the provider as {backend} or {base_url} (not "
            "{endpoints})"
        )
    if spec.batch_max_requests < 1 or spec.batch_max_bytes < 1000 or spec.poll_interval <= 0:
        raise OptionError(
            "{batch_max_requests} must be at least 1, {batch_max_bytes} at least 1000 and "
            "{poll_interval} positive"
        )
    if spec.order not in ORDERS:
        raise OptionError(f"{{order}} must be one of {', '.join(ORDERS)}")
    if isinstance(spec.concurrency, int) and spec.concurrency < 1:
        raise OptionError("{concurrency} must be at least 1")
    if spec.max_concurrency < 1:
        raise OptionError("{max_concurrency} must be at least 1")
    metrics = spec.server_metrics
    if metrics not in ("auto", "off") and url_problem(metrics) is not None:
        got = "a URL with a user:password@" if "@" in metrics else OptionError.quoted(metrics)
        raise OptionError(f"{{server_metrics}} must be auto, off or an http(s) URL, got {got}")
    # these URLs are never shown: one may hold a user:password@
    for e in parse_endpoints(spec.endpoints):  # first: the job's base URL is the first's
        if (problem := url_problem(e.url)) is not None:
            raise UsageError(f"--endpoint {e.name}: its URL {problem}")
    if spec.base_url and (problem := url_problem(spec.base_url)) is not None:
        raise OptionError(f"{{base_url}} {problem}")
    for name in ("rpm", "tpm"):
        value = getattr(spec, name)
        if value is not None and value <= 0:
            raise OptionError(f"{{{name}}} must be positive")
    if spec.max_attempts < 1:
        raise OptionError("{max_attempts} must be at least 1")
    if spec.repair_attempts < 0:
        raise OptionError("{repair_attempts} must be 0 or more")
    if spec.on_truncate not in ON_TRUNCATE:
        raise OptionError(f"{{on_truncate}} must be one of {', '.join(ON_TRUNCATE)}")
    if spec.max_tokens_cap < 1:
        raise OptionError("{max_tokens_cap} must be at least 1")
    if spec.timeout <= 0:
        raise OptionError("{timeout} must be positive")
    if spec.outage_timeout < 0:
        raise OptionError("{outage_timeout} must be 0 or more")
    if spec.lease < 1:
        raise OptionError("{lease} must be at least 1 second")
    for name in ("max_cost", "price_in", "price_out"):
        if (getattr(spec, name) or 0) < 0:
            raise OptionError(f"{{{name}}} must be 0 or more")
    limits = ("max_tokens", "max_line_bytes", "max_input_chars", "max_input_tokens")
    for name in (*limits, "max_total_tokens"):
        value = getattr(spec, name)
        if value is not None and value < 1:
            raise OptionError(f"{{{name}}} must be at least 1")
    if not stored:  # a job's own spec read back was checked when it was given
        _given_rules(spec)
    if preset is not None and preset.key_required and spec.api_key() is None:
        raise OptionError(
            f"backend {preset.name} needs an API key: set the environment variable "
            f"{spec.api_key_env} (or name another with {{api_key_env}})"
        )


def _given_rules(spec: RunSpec) -> None:
    """Rules for options as they are given, not for a job's stored spec read back (`export`,
    `cancel`): a rule added since, or a key variable not set here, must not lock its results
    away."""
    if spec.max_cost is not None and None in (spec.price_in, spec.price_out):
        raise OptionError("{max_cost} needs {price_in} and {price_out} (per million tokens)")
    budget = "max_total_tokens" if spec.max_total_tokens is not None else "max_cost"
    if getattr(spec, budget) is not None and spec.max_tokens is None:
        # an answer's length bounds what a request may cost: without it no estimate holds
        raise OptionError(
            f"{{{budget}}} needs {{max_tokens}}: without it an answer's length has no bound, "
            "and one answer could pass the budget (a line's own max_tokens still wins)"
        )
    if spec.on_truncate == "retry-longer" and spec.max_tokens_cap <= (spec.max_tokens or 0):
        raise OptionError("{max_tokens_cap} must be above {max_tokens} to retry longer")
    if (spec.temperature or 0) < 0 or not 0 < (1 if spec.top_p is None else spec.top_p) <= 1:
        raise OptionError("{temperature} must be 0 or more, and {top_p} above 0 and at most 1")
    if spec.api_key_env and (why := not_a_name(spec.api_key_env)):
        # not echoed: a key pasted where its variable's name goes must not reach a log
        raise OptionError("{api_key_env} " + why)
