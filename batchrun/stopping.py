"""How a run is stopped from outside it, and leaves nothing behind when it is: the signals
(Ctrl-C, SIGTERM) and the caller's own handlers of them, and a worker that joined a job."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import anyio

from batchrun.errors import LedgerError
from batchrun.ledger import Ledger

SIGNALS = (signal.SIGINT, signal.SIGTERM)
T = TypeVar("T")


@contextlib.contextmanager
def handlers_put_back() -> Iterator[None]:
    """The process's handlers of SIGINT and SIGTERM as they were when it began: an event loop
    that listened to them leaves the defaults behind (a service's next SIGTERM would kill
    it outright). Only the main thread has handlers."""
    main = threading.current_thread() is threading.main_thread()
    saved = {s: signal.getsignal(s) for s in SIGNALS} if main else {}
    try:
        yield
    finally:
        for signum, handler in saved.items():
            if handler is not None:
                signal.signal(signum, handler)


async def stop_on_signals(request_stop: Callable[[int], None]) -> None:
    with handlers_put_back(), anyio.open_signal_receiver(*SIGNALS) as signals:
        async for signum in signals:
            request_stop(signum)


@contextlib.contextmanager
def leaving_if_stopped(ledger: Ledger, name: str, worker: str | None) -> Iterator[None]:
    """A run stopped before its runner started (a callback raised, a cancel) leaves the job:
    else `status` shows a live worker, and other runs wait out its lease."""
    try:
        yield
    except BaseException:
        if worker is not None:
            with contextlib.suppress(LedgerError):
                ledger.release(name, worker)
        raise


@dataclass(frozen=True)
class Raised:
    """What `carried` hands back in place of a report."""

    error: KeyboardInterrupt | SystemExit


async def carried(call: Callable[[], Awaitable[T]]) -> T | Raised:
    """A callback's KeyboardInterrupt or SystemExit, handed back for the caller to raise once
    the event loop is closed: raised through the loop, it left AnyIO's worker thread
    waiting, and the process never exited."""
    try:
        return await call()
    except (KeyboardInterrupt, SystemExit) as exc:
        return Raised(exc)
