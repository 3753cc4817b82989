"""What a run reports (RunStats) and what it can be tuned with (RunnerSettings)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio

from batchrun.retrying import Sleep

if TYPE_CHECKING:
    from batchrun.lanes import EndpointUse

LEASE_TTL = 60.0  # a runner whose heartbeat is older than this is taken for dead


@dataclass
class RunStats:
    reclaimed: int = 0
    recorded: int = 0
    by_status: dict[str, int] = field(default_factory=dict)
    requests: int = 0
    retries: int = 0
    output_tokens: int = 0
    repairs: int = 0  # follow-up requests for invalid answers, and what they cost
    repair_tokens: int = 0
    guided_refused: str | None = None  # the server's 400 to response_format, if it refused it
    started: float = field(default_factory=time.monotonic)
    elapsed: float = 0.0
    aborted: str | None = None  # the fatal error that stopped the job
    interrupted: bool = False
    stopped_by: int | None = None  # the signal that stopped it (SIGINT, SIGTERM), if one did
    reused: int = 0  # items answered from earlier jobs before sending
    duplicates: int = 0  # lines that waited for an identical line's answer
    endpoints: list[EndpointUse] = field(default_factory=list)  # what each endpoint did
    batches: int = 0  # hosted Batch API batches created (--mode batch)
    batch_tokens: int = 0  # tokens their answers used, billed at the batch rate
    followups: int = 0  # batch answers left for a follow-up (a repair) that only online sends


BUSY_PATIENCE_S = 600.0  # how long to wait for another process's ledger lock (a long ingest)


@dataclass(frozen=True)
class RunnerSettings:
    lease_ttl: float = LEASE_TTL
    worker: str | None = None  # the id the run joined under already (jobs._reuse), else new
    commit_interval: float = 0.2
    drain_timeout: float = 10.0
    busy_patience: float = BUSY_PATIENCE_S
    # Waiting and telling time, for retries, outages and pacing; tests pass fakes.
    sleep: Sleep = anyio.sleep
    clock: Callable[[], float] = time.monotonic
