"""Test doubles shared across test files."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import anyio
import pytest
from click.testing import CliRunner

from batchrun import cli_sim
from batchrun.config import InputGuards
from batchrun.inputs import InputReader
from batchrun.sim import SimModel


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


def input_reader(path: Path, **options: Any) -> InputReader:
    """An InputReader with the guards given as plain keywords (max_input_chars=10, ...)."""
    names = {f.name for f in dataclasses.fields(InputGuards)}
    guards = InputGuards(**{k: v for k, v in options.items() if k in names})
    rest = {k: v for k, v in options.items() if k not in names}
    return InputReader(path, guards=guards, **rest)


def served_by_sim_cli(monkeypatch: pytest.MonkeyPatch, flags: list[str]) -> SimModel:
    """The simulator model `batchrun sim FLAGS` would serve (its server not started)."""
    served: list[SimModel] = []

    class FakeServer:
        def __init__(self, model: SimModel) -> None:
            served.append(model)

        async def serve(self, *_args: Any) -> None:
            return None

    monkeypatch.setattr(cli_sim, "SimServer", FakeServer)
    result = CliRunner().invoke(cli_sim.sim, ["--port", "0", *flags])
    assert result.exit_code == 0, result.output
    return served[0]
