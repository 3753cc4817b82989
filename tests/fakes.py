"""Test doubles shared across test files."""

from __future__ import annotations

import anyio


class FakeTime:
    """A clock that only moves when the fake sleep is asked to wait: pass `clock` (or the
    object itself) as the clock and `sleep` as the sleep, and read what was slept."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        await anyio.lowlevel.checkpoint()
