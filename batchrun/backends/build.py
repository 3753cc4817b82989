"""A backend made from a run spec: the endpoint, its key and auth style, or the in-process
simulator; and where `--concurrency auto` reads the server's load."""

from __future__ import annotations

import dataclasses
from typing import Any
from urllib.parse import urlsplit

from batchrun.backends.base import Backend, Transport, auth_headers
from batchrun.backends.metrics_reader import MetricsReader
from batchrun.backends.openai_compat import OpenAICompatBackend
from batchrun.config import RunSpec, checked, preset_for
from batchrun.errors import UsageError
from batchrun.server_metrics import metrics_url
from batchrun.sim import SimConfig, SimModel, SimTransport
from batchrun.sim.faults import FAULT_KINDS, check_rates
from batchrun.sim.json_answers import JSON_STYLES
from batchrun.sim.settings import OPTIONAL_KINDS, config_problem

SIM_DEFAULTS: dict[str, Any] = {"ttft_ms": 20.0, "tpot_ms": 1.0}

# The protocols a preset may speak (presets.Preset.protocol), each a Backend; one so far.
BACKENDS: dict[str, type[OpenAICompatBackend]] = {"openai": OpenAICompatBackend}


def build_backend(spec: RunSpec, transport: Transport | None = None) -> Backend:
    """The backend the spec's preset speaks, for its endpoint, key and auth style."""
    return BACKENDS[preset_for(spec).protocol](
        spec.base_url,
        api_key=checked_key(spec),
        auth=preset_for(spec).auth,
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
    auto = spec.server_metrics == "auto"
    url = metrics_url(spec.base_url) if auto else spec.server_metrics
    # The key goes only to the endpoint's own host (llama-server wants it on /metrics).
    same_host = urlsplit(url).netloc == urlsplit(spec.base_url).netloc
    headers = auth_headers(preset_for(spec).auth, checked_key(spec)) if same_host else {}
    slots = metrics_url(spec.base_url, "slots") if auto else None  # llama-server without them
    return MetricsReader(url, headers=headers or None, transport=transport, fallback=slots)


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


def sim_config(spec: RunSpec) -> SimConfig:
    """The in-process simulator's settings: defaults, then the spec's `sim_options`."""
    defaults = dataclasses.asdict(SimConfig())
    options: dict[str, Any] = {}
    for key, value in {**SIM_DEFAULTS, **spec.sim_options}.items():
        if key not in defaults:
            raise UsageError(f"sim_options: unknown option {key!r} (known: {', '.join(defaults)})")
        kind = OPTIONAL_KINDS.get(key) or type(defaults[key]).__name__
        options[key] = checked(f"sim_options: {key}", value, kind)
    for key, known in (("faults", FAULT_KINDS), ("json_styles", JSON_STYLES)):
        try:
            check_rates(options.get(key, {}), known, key.rstrip("s").replace("_", " "))
        except ValueError as exc:
            raise UsageError(f"sim_options.{key}: {exc}") from None
    config = SimConfig(**options)
    if (problem := config_problem(config)) is not None:
        raise UsageError(f"sim_options: {problem}")
    return config
