"""`batchrun bench` through the real CLI against `batchrun sim` servers with known latency models.

Tolerances: the simulator sleeps the modelled time before each token, so what the client
measures can only be longer; the allowance above the model covers the event loops of two
processes on a shared 2-core machine (TTFT +60 ms, TPOT +12 ms per token at the median).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batchrun.bench.selftest import client_bound
from tests.integration.helpers import CLI

PNG = b"\x89PNG\r\n\x1a\n"
CHARTS = ("throughput.png", "latency_p95.png", "ttft_cdf.png")


def _bench(cli: CLI, out: Path, *args: str) -> dict[str, Any]:
    result = cli.run("bench", "--no-self-test", "-o", str(out), *args, timeout=300)
    assert result.returncode == 0, result.stderr
    data: dict[str, Any] = json.loads((out / "results.json").read_text())
    return data


def _cell(data: dict[str, Any], cls: str, level: int) -> dict[str, Any]:
    return next(c for c in data["cells"] if c["class"] == cls and c["concurrency"] == level)


def test_measured_ttft_and_tpot_match_the_latency_model(
    cli: CLI, tmp_path: Path, sim_server: Callable[..., str]
) -> None:
    url = sim_server(
        "--ttft-ms",
        "100",
        "--tpot-ms",
        "20",
        "--min-output-tokens",
        "20",
        "--max-output-tokens",
        "20",
    )
    data = _bench(
        cli,
        tmp_path / "run",
        "--base-url",
        url,
        "--classes",
        "short",
        "--concurrency",
        "1,2",
        "--repeat",
        "6",
    )
    for level in (1, 2):
        cell = _cell(data, "short", level)
        assert cell["success_rate"] == 1.0 and cell["requests"] == 6
        assert 100 <= cell["ttft_ms"]["p50"] <= 160, cell["ttft_ms"]
        assert 20 <= cell["tpot_ms"]["p50"] <= 32, cell["tpot_ms"]
        assert 480 <= cell["e2e_ms"]["p50"] <= 480 + 60 + 19 * 12, cell["e2e_ms"]
        assert cell["itl_ms"]["n"] == 6 * 19
    requests = [r for r in data["requests"] if r["cls"] == "short"]
    assert len(requests) == 12 and all(r["output_tokens"] == 20 for r in requests)
    host_port = url.removeprefix("http://").removesuffix("/v1")  # the name, not "endpoint"
    assert data["endpoints"][0]["name"] == host_port
    assert {c["endpoint"] for c in data["cells"]} == {host_port}


def test_the_knee_is_found_where_the_server_runs_out_of_slots(
    cli: CLI, tmp_path: Path, sim_server: Callable[..., str]
) -> None:
    url = sim_server(
        "--slots",
        "4",
        "--ttft-ms",
        "20",
        "--tpot-ms",
        "10",
        "--min-output-tokens",
        "20",
        "--max-output-tokens",
        "20",
    )
    data = _bench(
        cli,
        tmp_path / "run",
        "--base-url",
        url,
        "--classes",
        "short",
        "--concurrency",
        "1,2,4,8,16",
        "--repeat",
        "16",
        "--warmup",
        "0",
    )
    (found,) = data["knees"]
    assert found["concurrency"] == 4, (
        found,
        [(c["concurrency"], c["output_throughput"], c["e2e_ms"]["p95"]) for c in data["cells"]],
    )


def test_every_file_is_written_and_compare_puts_two_runs_side_by_side(
    cli: CLI, tmp_path: Path, sim_server: Callable[..., str]
) -> None:
    fast = sim_server("--ttft-ms", "10", "--tpot-ms", "5")
    slow = sim_server("--ttft-ms", "10", "--tpot-ms", "10")
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    common = [
        "--classes",
        "short,json",
        "--concurrency",
        "1,2",
        "--repeat",
        "3",
        "--max-tokens",
        "40",
    ]
    a = _bench(cli, run_a, "--endpoint", f"fast={fast}", *common)
    b = _bench(cli, run_b, "--endpoint", f"slow={slow}", *common)
    for run, data in ((run_a, a), (run_b, b)):
        assert len(data["cells"]) == 4 and len(data["requests"]) == 14  # 3, 4 (2 rounds of 2)
        rows = list(csv.DictReader((run / "summary.csv").open()))
        assert [(r["class"], r["concurrency"]) for r in rows] == [
            ("short", "1"),
            ("short", "2"),
            ("json", "1"),
            ("json", "2"),
        ]
        report = (run / "report.md").read_text()
        assert "Recommended concurrency" in report and "P99 from 3 samples" in report
        for chart in CHARTS:
            assert (run / chart).read_bytes().startswith(PNG)
        assert _cell(data, "json", 1)["schema_valid_rate"] == 1.0
    result = cli.run("bench", "compare", str(run_a), str(run_b), "-o", str(tmp_path / "cmp"))
    assert result.returncode == 0, result.stderr
    assert "B / A" in result.stdout and "short" in result.stdout
    short_row = next(line for line in result.stdout.splitlines() if line.startswith("short"))
    throughput_ratio = float(short_row.split()[2].rstrip("x"))
    assert throughput_ratio < 1.0  # the slow server makes fewer tokens per second
    for chart in CHARTS:
        assert (tmp_path / "cmp" / chart).read_bytes().startswith(PNG)


def test_several_endpoints_in_one_run_and_the_client_self_test(
    cli: CLI, tmp_path: Path, sim_server: Callable[..., str]
) -> None:
    one = sim_server("--ttft-ms", "0", "--tpot-ms", "0")
    two = sim_server("--ttft-ms", "5", "--tpot-ms", "1")
    out = tmp_path / "run"
    result = cli.run(
        "bench",
        "-o",
        str(out),
        "--endpoint",
        f"one={one}",
        "--endpoint",
        f"two={two},model=sim-1",
        "--classes",
        "short",
        "--concurrency",
        "4",
        "--repeat",
        "40",
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    data = json.loads((out / "results.json").read_text())
    assert [e["name"] for e in data["endpoints"]] == ["one", "two"]
    assert {c["endpoint"] for c in data["cells"]} == {"one", "two"}
    st = data["selftest"]
    assert st["request_throughput"] > 0 and st["chunk_rate"] > 0
    # Each verdict must follow from the recorded figures and the self-test's (its rule is tested
    # in test_bench.py). Whether a zero-latency server reads as client-bound depends on the load on
    # this machine at that moment, so the verdict itself is not pinned.
    for cell in data["cells"]:
        assert cell["client_bound"] is client_bound(cell, st)
    assert "client self-test" in result.stdout


def test_bad_options_are_usage_errors(cli: CLI, tmp_path: Path) -> None:
    result = cli.run("bench", "--base-url", "http://127.0.0.1:9/v1", "--concurrency", "0,x")
    assert result.returncode == 2 and "--concurrency" in result.stderr
    result = cli.run("bench")
    assert result.returncode == 2 and "nothing to measure" in result.stderr
    result = cli.run("bench", "compare", str(tmp_path), str(tmp_path))
    assert result.returncode == 2 and "no results.json" in result.stderr


def test_without_o_a_run_goes_under_the_homes_outputs(
    cli: CLI, sim_server: Callable[..., str]
) -> None:
    url = sim_server("--ttft-ms", "0", "--tpot-ms", "0")
    args = ("--base-url", url, "--classes", "short", "--concurrency", "1", "--repeat", "2")
    result = cli.run("bench", "--no-self-test", "--label", "here", *args, timeout=300)
    assert result.returncode == 0, result.stderr
    (folder,) = (cli.home / "outputs").glob("bench-here-*")
    assert json.loads((folder / "results.json").read_text())["cells"]
