"""One endpoint as a job sends to it (Route), its state in a run (Lane: fleet.py moves it between
up, down and out), and what it did, for the summary and `status` (EndpointUse)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass

from batchrun.backends import Backend
from batchrun.config import RunSpec, preset_for
from batchrun.progress import JobLog
from batchrun.retrying import OutageWatch
from batchrun.server_metrics import ServerLoad
from batchrun.throttle import Throttle

PROBE_FIRST_S = 1.0  # a lane gone down is probed this long after, then twice as long each time
PROBE_MOST_S = 30.0  # up to this


@dataclass(frozen=True)
class Route:
    """One endpoint as the job sends to it: its name, its spec (URL, preset, key variable,
    model, pacing), its backend, and where its server's load can be read."""

    name: str
    spec: RunSpec
    backend: Backend
    weight: float = 1.0
    server_load: Callable[[], Awaitable[ServerLoad | None]] | None = None
    waiting: str = ""  # why its model is not known yet: its server was away as the job started

    @property
    def guided_style(self) -> str:
        """How its server takes a schema to decode by (its preset's: llama.cpp's own shape)."""
        return preset_for(self.spec).guided_style


@dataclass(frozen=True)
class EndpointUse:
    """What one endpoint did in a run, for the summary and `status`."""

    name: str
    state: str  # up | down | out
    answered: int  # requests it answered
    errors: int  # requests that failed on it
    limit: int  # its concurrency limit at the end
    reason: str = ""  # why it is down or out


@dataclass(eq=False)
class Lane:
    route: Route
    throttle: Throttle
    outage: OutageWatch
    answer_spec: str  # recorded with its results, for later reuse
    state: str = "up"
    reason: str = ""
    sent: int = 0  # requests it was picked for
    answered: int = 0
    errors: int = 0
    probe: Hashable = None  # the item whose request probes this lane now, if one does
    probe_at: float = 0.0
    probe_wait: float = PROBE_FIRST_S
    refusal: str = ""  # the latest refusal's error
    refusals: int = 0  # lines it refused that others then answered, since its last answer
    refused_lately: int = 0  # lines it refused since its last answer
    refusing = False  # down for refusing (REFUSALS_TO_DRAIN): only an answer brings it back
    rests_until = 0.0  # after a 429: others are sent to first until then (its Retry-After)

    @property
    def name(self) -> str:
        return self.route.name

    @property
    def backend(self) -> Backend:
        return self.route.backend

    def lost(self, now: float, grace: float) -> bool:
        """Down for an outage, past the grace period."""
        since = self.outage.down_since
        down = self.state == "down" and not self.refusing
        return down and since is not None and now - since > grace

    def load(self) -> tuple[float, float]:
        """Slots taken (on the wire or waiting for the pacer) per unit of weight, then requests
        sent so far per unit of weight (idle endpoints take turns)."""
        weight = self.route.weight or 1.0
        return ((self.throttle.busy + 1) / weight, self.sent / weight)

    def wait_for_model(self, now: float) -> None:
        """Its server was away as the job started (Route.waiting): down for an outage since
        now, probed as a lane gone down is, each probe asking its model before its line goes
        (sender.py), until one is `learned`."""
        self.state, self.reason, self.probe_at = "down", self.route.waiting, now + self.probe_wait
        self.outage.down_since, self.outage.last_error = now, self.route.waiting

    def learned(self, route: Route, answer_spec: str) -> None:
        """Its server named its model (`route`'s): its requests and answers are under it."""
        self.route, self.answer_spec = route, answer_spec
        self.outage.success()

    def use(self) -> EndpointUse:
        return EndpointUse(
            self.name, self.state, self.answered, self.errors, self.throttle.limit, self.reason
        )


def every_lane_lost(live: list[Lane], now: float, grace: float) -> str | None:
    """Why the job cannot go on, when every live lane is down past the grace or drained for
    refusing lines (some down past it: the drained alone are no reason to stop); else None."""
    lost = [lane for lane in live if lane.lost(now, grace)]
    if not lost or len(lost) + sum(lane.refusing for lane in live) != len(live):
        return None
    return "last errors: " + "; ".join(
        [f"{lane.name}: {lane.outage.last_error}" for lane in lost]
        + [f"{lane.name}: {lane.reason}" for lane in live if lane.refusing]
    )


async def watch_server(lane: Lane, log: JobLog) -> None:
    """Drive the lane's limit from its server's own load page, and say in the log which page
    of which engine it is (or that it has none)."""
    read = lane.route.server_load
    assert read is not None
    found = False

    async def logged() -> ServerLoad | None:
        nonlocal found
        load = await read()
        if load is not None and not found:  # which page of which engine drives the limit
            found = True
            log.event("server_metrics", available=True, source=load.source, endpoint=lane.name)
        return load

    if not await lane.throttle.watch_server(logged):
        log.event("server_metrics", available=False, endpoint=lane.name)
