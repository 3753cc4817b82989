"""A job's endpoints made ready to send to: each one's spec, backend, metrics reader and model.

One endpoint (--backend/--base-url) is the job's own spec. Several (`--endpoint NAME=URL,...`,
see endpoints.py) each get the job's options with their own URL, preset, key variable, model
and rpm/tpm: a job's key never goes to another endpoint's host.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import replace

import anyio

from batchrun.backends import Backend, Transport
from batchrun.backends.build import build_backend, metrics_reader, sim_transport
from batchrun.backends.metrics_reader import MetricsReader
from batchrun.config import RunSpec, resolve
from batchrun.endpoints import EndpointSpec, host_port, parse_endpoints, shown_endpoint
from batchrun.errors import EndpointDown, FatalError, RequestError, TransientError
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
    out (`note(endpoint, why)`); the job goes on with the others. One whose server is away is
    waited for only until another is ready: its route is `waiting`, its lane down, and the
    lane's probes ask its model (named_model) while the others work."""
    opened: list[tuple[EndpointSpec, RunSpec, Backend, MetricsReader | None]] = []
    try:
        for e, lane_spec in endpoint_specs(spec):
            own = transport or sim_transport(lane_spec)  # requests and /metrics alike
            backend = build_backend(lane_spec, own)
            opened.append((e, lane_spec, backend, metrics_reader(lane_spec, own)))
        picked: dict[str, RunSpec | FatalError] = {}
        away: dict[str, str] = {}  # endpoint -> why its model could not be asked (yet)
        several = len(opened) > 1 and spec.outage_timeout > 0  # outages handled: it may wait
        names = {e.name for e, *_ in opened}

        async with anyio.create_task_group() as tg:

            def settle() -> None:  # one ready, and every other answered or found away
                ready = any(isinstance(got, RunSpec) for got in picked.values())
                if several and ready and picked.keys() | away.keys() >= names:
                    tg.cancel_scope.cancel()

            async def pick(e: EndpointSpec, lane_spec: RunSpec, backend: Backend) -> None:
                async def ask() -> list[str]:
                    try:
                        return await backend.list_models()
                    except TransientError as exc:
                        away[e.name] = str(exc)
                        settle()
                        raise

                watch = OutageWatch(lane_spec.outage_timeout, clock)
                policy = RetryPolicy(lane_spec.max_attempts, watch, sleep=sleep)
                try:
                    picked[e.name] = await pick_model(ask, lane_spec, policy)
                except FatalError as exc:
                    picked[e.name] = exc
                settle()

            for e, lane_spec, backend, _reader in opened:
                tg.start_soon(pick, e, lane_spec, backend)
        routes = []
        for e, lane_spec, backend, reader in opened:
            got = picked.get(e.name) or lane_spec
            if isinstance(got, FatalError):
                if len(opened) == 1:
                    raise got
                note(e.name, str(got))
                continue
            waiting = "" if e.name in picked else f"its model not known yet: {away[e.name]}"
            server_load = reader.read if reader is not None else None
            routes.append(Route(e.name, got, backend, e.weight, server_load, waiting))
        if not routes:
            raise FatalError("no endpoint could be used: " + "; ".join(map(str, picked.values())))
        yield routes
    finally:
        with anyio.CancelScope(shield=True):
            for _e, _spec, backend, reader in opened:
                await backend.aclose()
                if reader is not None:
                    await reader.aclose()


async def named_model(route: Route) -> Route:
    """A `waiting` route with the model its server names now (the lane's probe asks it before
    its line goes). Raises what listing the models raises: a failed probe, or FatalError
    (401/403/404, or none listed)."""
    models = await route.backend.list_models()
    return replace(route, spec=first_model(models, route.spec), waiting="")


def by_prefix(spec: RunSpec, routes: list[Route]) -> bool:
    """Whether this run claims prefix groups together. `auto`: yes, except against llama.cpp's
    server, whose slots each cache their own last prompt (and keep older ones in RAM only
    once a slot moves on): a group's first wave then computes its prefix cold in every slot,
    where input order lets its RAM cache serve each prefix about once (measured:
    benchmarks/prefix_order.py, 3.3x the prompt tokens computed, 1.24-1.29x the time)."""
    if spec.order != "auto":
        return spec.order == "prefix"
    return not any(route.spec.backend == "llamacpp" for route in routes)


async def pick_model(
    list_models: Callable[[], Awaitable[list[str]]], spec: RunSpec, policy: RetryPolicy
) -> RunSpec:
    """With no --model, use the one model a local server serves (llama.cpp, vLLM...).

    A server that is still starting gets the outage grace period to answer."""
    if spec.model:
        return spec
    try:
        models = await policy.call_within(list_models, spec.outage_timeout)
    except FatalError:
        raise
    except RequestError as exc:
        raise EndpointDown(
            f"cannot list models at {shown_endpoint(spec.base_url)}: {exc}"
        ) from None
    return first_model(models, spec)


def first_model(models: list[str], spec: RunSpec) -> RunSpec:
    """`spec` with the first model its server lists (a local server serves one)."""
    if not models:
        raise FatalError(f"{shown_endpoint(spec.base_url)}/models lists no model; give --model")
    return replace(spec, model=models[0])
