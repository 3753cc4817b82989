"""A job's endpoints made ready to send to: each one's spec, backend, metrics reader and model.

One endpoint (--backend/--base-url) is the job's own spec. Several (`--endpoint NAME=URL,...`,
see endpoints.py) each get the job's options with their own URL, preset, key variable, model
and rpm/tpm: a job's key never goes to another endpoint's host.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace

import anyio

from batchrun.backends import Backend, Transport
from batchrun.backends.build import build_backend, metrics_reader, sim_transport
from batchrun.backends.metrics_reader import MetricsReader
from batchrun.config import RunSpec, resolve
from batchrun.endpoints import EndpointSpec, host_port, parse_endpoints, shown_endpoint
from batchrun.errors import EndpointDown, FatalError, RequestError
from batchrun.lanes import Route
from batchrun.retrying import OutageWatch, RetryPolicy, Sleep

# What an endpoint takes from its own part of --endpoint, never from the job's options.
OWN_FIELDS = ("backend", "base_url", "api_key_env", "endpoints")


def endpoint_specs(spec: RunSpec) -> list[tuple[EndpointSpec, RunSpec]]:
    """Each endpoint of the job, with the spec its requests go out under."""
    if not spec.endpoints:
        name = "sim" if spec.backend == "sim" else host_port(spec.base_url)
        return [(EndpointSpec(name, spec.base_url), spec)]
    shared = {k: v for k, v in spec.to_json().items() if k not in OWN_FIELDS}
    made = []
    for e in parse_endpoints(spec.endpoints):
        own = {
            "backend": e.backend or "custom",
            "base_url": e.url,
            "api_key_env": e.key,
            "model": e.model or spec.model,
            "rpm": e.rpm or spec.rpm,
            "tpm": e.tpm or spec.tpm,
        }
        made.append((e, resolve(shared, own)))
    return made


@asynccontextmanager
async def opened_routes(
    spec: RunSpec,
    *,
    transport: Transport | None,
    sleep: Sleep,
    clock: Callable[[], float],
    note: Callable[[str, str], None],
) -> AsyncIterator[list[Route]]:
    """The job's routes, each with its model known (asked of the server when not given);
    closed on the way out. With several endpoints, one whose model cannot be learned is left
    out (`note(endpoint, why)`); the job goes on with the others."""
    opened: list[tuple[EndpointSpec, RunSpec, Backend, MetricsReader | None]] = []
    try:
        for e, lane_spec in endpoint_specs(spec):
            own = transport or sim_transport(lane_spec)  # requests and /metrics alike
            backend = build_backend(lane_spec, own)
            opened.append((e, lane_spec, backend, metrics_reader(lane_spec, own)))
        picked: dict[str, RunSpec | FatalError] = {}

        async def pick(e: EndpointSpec, lane_spec: RunSpec, backend: Backend) -> None:
            policy = RetryPolicy(
                lane_spec.max_attempts, OutageWatch(lane_spec.outage_timeout, clock), sleep=sleep
            )
            try:
                picked[e.name] = await pick_model(backend, lane_spec, policy)
            except FatalError as exc:
                picked[e.name] = exc

        async with anyio.create_task_group() as tg:
            for e, lane_spec, backend, _reader in opened:
                tg.start_soon(pick, e, lane_spec, backend)
        routes = []
        for e, _lane_spec, backend, reader in opened:
            got = picked[e.name]
            if isinstance(got, FatalError):
                if len(opened) == 1:
                    raise got
                note(e.name, str(got))
                continue
            server_load = reader.read if reader is not None else None
            routes.append(Route(e.name, got, backend, e.weight, server_load))
        if not routes:
            raise FatalError("no endpoint could be used: " + "; ".join(map(str, picked.values())))
        yield routes
    finally:
        with anyio.CancelScope(shield=True):
            for _e, _spec, backend, reader in opened:
                await backend.aclose()
                if reader is not None:
                    await reader.aclose()


def by_prefix(spec: RunSpec, routes: list[Route]) -> bool:
    """Whether this run claims prefix groups together. `auto`: yes, except against llama.cpp's
    server, whose slots each cache their own last prompt (and keep older ones in RAM only
    once a slot moves on): a group's first wave then computes its prefix cold in every slot,
    where input order lets its RAM cache serve each prefix about once (measured:
    benchmarks/prefix_order.py, 3.3x the prompt tokens computed, 1.24-1.29x the time)."""
    if spec.order != "auto":
        return spec.order == "prefix"
    return not any(route.spec.backend == "llamacpp" for route in routes)


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
        raise EndpointDown(
            f"cannot list models at {shown_endpoint(spec.base_url)}: {exc}"
        ) from None
    if not models:
        raise FatalError(f"{shown_endpoint(spec.base_url)}/models lists no model; give --model")
    return replace(spec, model=models[0])
