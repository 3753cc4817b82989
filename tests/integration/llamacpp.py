"""llama.cpp's OpenAI-compatible server (`python -m llama_cpp.server`) with the tiny real model
shipped in tests/models, started on a free 127.0.0.1 port for the tests that need a real engine.

Installed by the `llamacpp` extra (`pip install -e '.[dev,llamacpp]'`, as .ci/run does). When
it is missing the tests say so and skip, except where BATCHRUN_REQUIRE_LLAMACPP=1 (CI), where
a missing engine is a failure rather than a silent skip.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.integration.helpers import free_port


def _find_model() -> Path:
    """BATCHRUN_TEST_MODEL, else the copy shipped in tests/models/."""
    if os.environ.get("BATCHRUN_TEST_MODEL"):
        return Path(os.environ["BATCHRUN_TEST_MODEL"])
    return Path(__file__).resolve().parents[1] / "models" / "stories260K.gguf"


MODEL = _find_model()
STARTUP_TIMEOUT = 60.0


def require_llamacpp() -> None:
    missing = []
    if importlib.util.find_spec("llama_cpp") is None:
        missing.append("llama-cpp-python is not installed (pip install -e '.[dev,llamacpp]')")
    if not MODEL.exists():
        missing.append(f"the model {MODEL} is not there")
    if not missing:
        return
    if os.environ.get("BATCHRUN_REQUIRE_LLAMACPP") == "1":
        pytest.fail("llama.cpp tests required but " + "; ".join(missing))
    pytest.skip("; ".join(missing))


class LlamaServer:
    """One server process; `start()` again after `kill()` serves on the same port."""

    def __init__(self, log: Path, n_ctx: int = 512, *, interrupt: bool = False) -> None:
        self.interrupt = interrupt  # its own default: a new request cuts the running stream
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.log = log
        self.n_ctx = n_ctx
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "llama_cpp.server",
                    "--model",
                    str(MODEL),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                    "--n_ctx",
                    str(self.n_ctx),
                    # by default a new request cuts the stream in progress; queue it instead
                    "--interrupt_requests",
                    str(self.interrupt),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"llama.cpp server exited: {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/models", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"llama.cpp server not ready: {self.log.read_text()[-2000:]}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
