"""The verbs of `--mode batch` (hosted.py runs the batches): run a job's batches to the end,
or to Ctrl-C/SIGTERM; cancel them."""

from __future__ import annotations

import contextlib
import signal
import time
import uuid
from collections.abc import Awaitable, Callable
from functools import partial

import anyio

from batchrun.backends.base import Transport
from batchrun.backends.batch_api import BatchAPI
from batchrun.config import RunSpec
from batchrun.errors import FatalError, LedgerError, NotFound, RequestError, single_error
from batchrun.hosted import FINISHED, HostedRun, T, patiently
from batchrun.ledger import Ledger
from batchrun.progress import JobLog
from batchrun.reuse import SAME, joined
from batchrun.run_state import RunStats
from batchrun.structured import OutputRules


async def run_batches(
    ledger: Ledger,
    name: str,
    spec: RunSpec,
    *,
    log: JobLog,
    rules: OutputRules,
    transport: Transport | None = None,
    handle_signals: bool = True,
    worker: str | None = None,
) -> RunStats:
    """Run the job's batches to the end (or to Ctrl-C/SIGTERM: the batches go on at the
    provider, and `resume` picks up polling), as `worker` (the id its reuse pass joined
    under, if it ran one)."""
    stats = RunStats()
    api = BatchAPI(spec, transport)
    run = HostedRun(ledger, api, name, spec, rules=rules, log=log)
    # Joined as a worker, with a heartbeat however long the provider takes: what dead workers
    # held comes back to be batched too, this run's options (--mode batch) become the job's
    # for the next `resume`, and a worker asking other answers is refused meanwhile.
    worker = worker or uuid.uuid4().hex
    join = partial(ledger.join, name, worker, ttl=spec.lease, spec=joined(spec))
    try:
        await anyio.to_thread.run_sync(partial(join, same=SAME))
        log.event("batch_mode_started", max_requests=spec.batch_max_requests)
        async with anyio.create_task_group() as tg:
            tg.start_soon(_beat, ledger, name, worker, spec.lease)
            if handle_signals:
                tg.start_soon(_stop_on_signals, tg.cancel_scope, stats)
            await _until_done(run, stats, log)
            tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        raise single_error(group) from None
    finally:
        with anyio.CancelScope(shield=True):
            await api.aclose()
        with contextlib.suppress(LedgerError):  # the error that stopped the run is kept
            ledger.chunks.let_go(name, owner=run.owner, keep=run.sent)
        with contextlib.suppress(LedgerError):  # else its heartbeat stops: gone in a lease
            ledger.release(name, worker)
    h = run.stats
    stats.recorded, stats.batches = h.recorded, h.batches
    stats.batch_tokens = h.prompt_tokens + h.completion_tokens
    stats.followups = ledger.chunks.followups(name)
    stats.elapsed = time.monotonic() - stats.started
    return stats


async def _beat(ledger: Ledger, name: str, worker: str, lease: float) -> None:
    """The batch run's heartbeat: alive to `status` and to the workers that join meanwhile."""
    while True:
        await anyio.sleep(lease / 3)
        with contextlib.suppress(LedgerError):  # a missed beat: the next one may land
            await anyio.to_thread.run_sync(partial(ledger.heartbeat, name, worker, lease_ttl=lease))


async def _until_done(run: HostedRun, stats: RunStats, log: JobLog) -> None:
    """The run, its provider's refusal (a wrong key, an unknown endpoint) as the abort."""
    try:
        await run.run(send=run.spec.mode == "batch")
    except RequestError as exc:
        stats.aborted = str(exc)
        log.event("abort", error=str(exc), kind=type(exc).__name__)


async def _stop_on_signals(scope: anyio.CancelScope, stats: RunStats) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            stats.interrupted, stats.stopped_by = True, signum
            scope.cancel()
            return


async def cancel_batches(
    ledger: Ledger,
    name: str,
    spec: RunSpec,
    *,
    forget: bool = False,
    transport: Transport | None = None,
) -> list[str]:
    """Ask the provider to cancel the job's running batches (a chunk without a recorded id
    is looked for by its metadata); the ids of those that no longer run. What they answered
    before stopping is collected by the next run (`resume`), the rest goes back to pending.
    A batch the provider does not know (404) stops the command: a key of another project
    or a wrong URL says that too, and the batch would run on, paid for, while its lines were
    sent again. With `forget` (the user knows it is gone) its lines go back to pending.
    Transient errors are waited out (--outage-timeout); any other refusal stops the command
    with the provider's reason."""
    api = BatchAPI(spec, transport)
    cancelled = []

    async def patient(call: Callable[[], Awaitable[T]]) -> T:
        return await patiently(call, within=spec.outage_timeout)

    try:
        for chunk in ledger.chunks.listed(name, open_only=True):
            batch_id = chunk.batch_id
            if batch_id is None:
                meta = {
                    "batchrun_job": name,
                    "batchrun_chunk": str(chunk.chunk),
                    "batchrun_key": chunk.key,
                }
                found = await patient(partial(api.find, meta, chunk.created_at))
                batch_id = found["id"] if found else None
            if chunk.state in FINISHED:  # finished, and its answers not had (see `resume`)
                if forget:
                    ledger.chunks.close(name, chunk.chunk)
                    cancelled.append(batch_id or f"chunk {chunk.chunk}")
                continue
            if batch_id is None:
                continue
            try:
                batch = await patient(partial(api.cancel, batch_id))
            except NotFound as exc:
                if not forget:
                    raise FatalError(
                        f"batch {batch_id} (chunk {chunk.chunk}) is not found with this key at "
                        f"this URL ({exc}); if it is gone for good, `batchrun cancel {name} "
                        "--forget` puts its lines back to pending"
                    ) from None
                ledger.chunks.close(name, chunk.chunk)
                cancelled.append(batch_id)
                continue
            ledger.chunks.note(
                name, chunk.chunk, batch_id=batch_id, state=batch.get("status", "cancelling")
            )
            cancelled.append(batch_id)
    finally:
        await api.aclose()
    return cancelled
