"""Results committed in groups sized by time: a commit at most `interval` seconds after the
oldest result it holds came, or at MAX_GROUP results, so a fast job makes few commits and a
slow one loses little to a kill -9."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

from batchrun.errors import LedgerError
from batchrun.ledger import ItemResult

MAX_GROUP = 1000  # results per commit at most

Commit = Callable[[list[ItemResult]], Awaitable[None]]


async def write_in_groups(
    results: MemoryObjectReceiveStream[ItemResult],
    commit: Commit,
    interval: float,
    *,
    hurry: Callable[[], None],
) -> None:
    """Commit what the workers send until they are done. Cancelled from outside (a caller's
    cancel scope: a notebook's stop, asyncio.wait_for), it still commits the results it holds
    and those the workers sent: those answers were paid for, and a resume would pay again.
    That last commit is tried once (`hurry` makes the ledger calls stop waiting out a lock or
    an outage): a stop is not held for `--outage-timeout`; if it fails, resume sends them."""
    group: list[ItemResult] = []
    async with results:
        try:
            await _collect(results, group, commit, interval)
        except anyio.get_cancelled_exc_class():
            while (result := _received(results)) is not None:
                group.append(result)
            hurry()
            with anyio.CancelScope(shield=True), contextlib.suppress(LedgerError):
                await commit(group)
            raise
    with anyio.CancelScope(shield=True):
        await commit(group)


async def _collect(
    results: MemoryObjectReceiveStream[ItemResult],
    group: list[ItemResult],
    commit: Commit,
    interval: float,
) -> None:
    """Gather results into `group`, committing it whenever it is full or old enough, until
    the stream ends; what is left in it is the caller's to commit."""
    clock = time.monotonic
    oldest = 0.0
    while True:
        if group and (len(group) >= MAX_GROUP or clock() - oldest >= interval):
            taken = group[:]
            group.clear()
            try:
                await commit(taken)
            except anyio.get_cancelled_exc_class():
                # cancelled while it waited out a lock or an outage: tried once more with the
                # rest (recording a result twice changes nothing: the lease guard)
                group[:0] = taken
                raise
            continue
        try:  # what is there already, without a timer per result
            result = results.receive_nowait()
        except anyio.WouldBlock:
            pass
        except anyio.EndOfStream:
            return
        else:
            if not group:
                oldest = clock()
            group.append(result)
            continue
        wait = interval - (clock() - oldest) if group else None
        with anyio.move_on_after(wait):
            try:
                result = await results.receive()
            except anyio.EndOfStream:
                return
            if not group:
                oldest = clock()
            group.append(result)


def _received(results: MemoryObjectReceiveStream[ItemResult]) -> ItemResult | None:
    """A result the workers sent that nobody took yet, if any."""
    try:
        return results.receive_nowait()
    except (anyio.WouldBlock, anyio.EndOfStream):
        return None
