"""Integration fixtures: the real CLI in a subprocess, real servers on 127.0.0.1."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.integration.helpers import CLI
from tests.integration.llama_server import NativeLlamaServer, require_llama_server
from tests.integration.llamacpp import LlamaServer, require_llamacpp


@pytest.fixture
def cli(tmp_path: Path) -> CLI:
    home = tmp_path / "home"
    home.mkdir()
    return CLI(home)


@pytest.fixture
def sim_server() -> Iterator[Callable[..., str]]:
    """Start `batchrun sim --port 0 ...` on 127.0.0.1; returns its base URL."""
    procs: list[subprocess.Popen[str]] = []

    def start(*args: str, env: dict[str, str] | None = None) -> str:
        proc = subprocess.Popen(
            [sys.executable, "-m", "batchrun", "sim", "--host", "127.0.0.1", "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        procs.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if "serving" not in line:
            proc.kill()
            raise AssertionError(f"sim did not start: {line!r} {proc.stderr.read()}")
        return line.split()[3]  # "batchrun sim: serving http://127.0.0.1:PORT/v1 ..."

    yield start
    for proc in procs:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    """llama.cpp's server with the tiny model, shared by one test module."""
    require_llamacpp()
    server = LlamaServer(tmp_path_factory.mktemp("llama") / "server.log")
    server.start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def native_llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NativeLlamaServer]:
    """llama.cpp's C++ llama-server (8 slots, /metrics) with the tiny model, shared by one test
    module; killed whatever the tests did."""
    binary = require_llama_server()
    server = NativeLlamaServer(binary, tmp_path_factory.mktemp("llama-server") / "server.log")
    try:
        server.start()
        yield server
    finally:
        server.kill()
