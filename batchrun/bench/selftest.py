"""The client self-test: how much this process can drive, so results near it are not read as the
server's limit. A short closed-loop run against `batchrun sim` (zero latency, 16-token streamed
answers) on 127.0.0.1 in a child process measures requests and streamed chunks per second at
the sweep's highest concurrency. The simulator shares the machine, so this is a floor on what
the client can do; a cell that reaches half of it is flagged `client-bound?`.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import anyio

from batchrun.backends import OpenAICompatBackend
from batchrun.bench.load import LoadPlan, run_cell
from batchrun.bench.metrics import summarize
from batchrun.bench.suite import BenchClass
from batchrun.errors import UsageError

CLIENT_BOUND_SHARE = 0.5
SIM_ARGS = [
    "--ttft-ms",
    "0",
    "--tpot-ms",
    "0",
    "--min-output-tokens",
    "16",
    "--max-output-tokens",
    "16",
]


def _start_sim() -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchrun", "sim", "--host", "127.0.0.1", "--port", "0", *SIM_ARGS],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # "batchrun sim: serving http://127.0.0.1:PORT/v1 ..."
    if "serving" not in line:
        proc.kill()
        raise UsageError(
            "the built-in simulator did not start for the client self-test; run with --no-self-test"
        )
    return proc, line.split()[3]


async def self_test(concurrency: int, requests: int = 300) -> dict[str, Any]:
    proc, url = await anyio.to_thread.run_sync(_start_sim)
    backend = OpenAICompatBackend(url, max_connections=concurrency)
    try:
        cls = BenchClass("selftest", 16, tuple(f"self-test prompt {i}" for i in range(64)))
        plan = LoadPlan(levels=(concurrency,), repeat=requests, warmup=min(20, requests))
        cell = await run_cell(backend, "selftest", cls, concurrency, plan)
    finally:
        await backend.aclose()
        proc.kill()
        proc.wait()
    summary = summarize(cell.records, cell.wall_s)
    return {
        "concurrency": concurrency,
        "requests": summary["requests"],
        "request_throughput": summary["request_throughput"],
        "chunk_rate": summary["chunk_rate"],
        "server": url,
    }


def client_bound(cell: dict[str, Any], selftest: dict[str, Any] | None) -> bool:
    if not selftest:
        return False
    near = [
        (cell["request_throughput"], selftest["request_throughput"]),
        (cell["chunk_rate"], selftest["chunk_rate"]),
    ]
    return any(got is not None and most and got >= CLIENT_BOUND_SHARE * most for got, most in near)
