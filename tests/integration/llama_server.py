"""llama.cpp's C++ `llama-server` with the tiny model from tests/models, started on a free
127.0.0.1 port: the continuous-batching engine llama.cpp users actually run (`--parallel` slots
decoded together, `usage` in streams, Prometheus `/metrics`), unlike llama-cpp-python's server,
which answers one request at a time.

The binary is built once per machine by `.ci/build-llama-server` from the llama.cpp tree vendored
in the same llama-cpp-python release the `llamacpp` extra pins, and found through
$BATCHRUN_LLAMA_SERVER or that script's cache folder. When it is missing the tests say so and
skip, except where BATCHRUN_REQUIRE_LLAMA_SERVER=1 (CI), where a missing engine is a failure
rather than a silent skip.
"""

from __future__ import annotations

import os
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.integration.helpers import free_port
from tests.integration.llamacpp import MODEL

# The llama-cpp-python release whose vendored llama.cpp the build script compiles: keep it equal
# to the `llamacpp` extra's pin in pyproject.toml and the script's default.
VERSION = os.environ.get("LLAMA_CPP_PYTHON_VERSION", "0.3.36")
STARTUP_TIMEOUT = 60.0
SLOTS = 8  # --parallel: requests decoded together, each with CONTEXT / SLOTS tokens of context
CONTEXT = 4096


def _cache_dir() -> Path:
    """The folder `.ci/build-llama-server` caches into, by the same rule as the script."""
    if os.environ.get("BATCHRUN_ENGINE_CACHE"):
        return Path(os.environ["BATCHRUN_ENGINE_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "batchrun"


def find_binary() -> Path:
    """$BATCHRUN_LLAMA_SERVER (what .ci/run exports), else the build script's cache path."""
    if os.environ.get("BATCHRUN_LLAMA_SERVER"):
        return Path(os.environ["BATCHRUN_LLAMA_SERVER"])
    return _cache_dir() / f"llama-server-{VERSION}" / "llama-server"


def require_llama_server() -> Path:
    """The binary's path, or a skip (a failure under BATCHRUN_REQUIRE_LLAMA_SERVER=1) saying
    what is missing and how to get it."""
    binary = find_binary()
    missing = []
    if not os.access(binary, os.X_OK):
        missing.append(f"llama-server is not at {binary} (build it: .ci/build-llama-server)")
    if not MODEL.exists():
        missing.append(f"the model {MODEL} is not there")
    if missing:
        if os.environ.get("BATCHRUN_REQUIRE_LLAMA_SERVER") == "1":
            pytest.fail("llama-server tests required but " + "; ".join(missing))
        pytest.skip("; ".join(missing))
    return binary


class NativeLlamaServer:
    """One C++ `llama-server` process ("native", against llama-cpp-python's Python server in
    llamacpp.py) with SLOTS parallel slots, and /metrics on unless `metrics=False`."""

    def __init__(
        self, binary: Path, log: Path, *, metrics: bool = True, slots: int = SLOTS
    ) -> None:
        self.binary = binary
        self.slots = slots
        self.with_metrics = metrics
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.url = self.base + "/v1"
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        return [
            str(self.binary),
            *("-m", str(MODEL), "--host", "127.0.0.1", "--port", str(self.port)),
            *("-np", str(self.slots), "-c", str(CONTEXT)),
            *(["--metrics"] if self.with_metrics else []),
            # --threads-http left at its default, as users run it: max(SLOTS + 2, cores - 1)
        ]

    def start(self) -> None:
        """Start it and wait for /health to answer 200 (503 while the model loads)."""
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"llama-server exited: {self._tail()}")
            if self._healthy():
                return
            time.sleep(0.2)
        self.kill()
        raise AssertionError(f"llama-server not ready: {self._tail()}")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base + "/health", timeout=2) as resp:
                return bool(resp.status == 200)
        except OSError:  # refused while starting; HTTPError 503 while loading
            return False

    def _tail(self) -> str:
        return self.log.read_text(errors="replace")[-2000:]

    def metrics(self) -> str:
        """The Prometheus text at /metrics (served because of --metrics)."""
        with urllib.request.urlopen(self.base + "/metrics", timeout=10) as resp:
            text: str = resp.read().decode()
        return text

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
