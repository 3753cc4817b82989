"""`batchrun bench` against a real engine: llama.cpp's server with the tiny stories model."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from tests.integration.helpers import CLI
from tests.integration.llamacpp import LlamaServer

PNG = b"\x89PNG\r\n\x1a\n"


def test_a_small_sweep_completes_and_writes_every_file(
    cli: CLI, tmp_path: Path, llama_server: LlamaServer
) -> None:
    out = tmp_path / "bench"
    result = cli.run(
        "bench",
        "--backend",
        "llamacpp",
        "--base-url",
        llama_server.url,
        "--classes",
        "short,json",
        "--concurrency",
        "1,2",
        "--repeat",
        "4",
        "--max-tokens",
        "48",
        "-o",
        str(out),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    data = json.loads((out / "results.json").read_text())
    assert data["endpoints"][0]["model"].endswith("stories260K.gguf")
    assert len(data["cells"]) == 4
    for cell in data["cells"]:
        assert cell["success_rate"] == 1.0, cell["errors"]
        assert cell["ttft_ms"]["p50"] > 0 and cell["e2e_ms"]["p50"] >= cell["ttft_ms"]["p50"]
        assert cell["output_throughput"] > 0
        # llama-cpp-python streams no usage: tokens are counted from the streamed chunks
        assert cell["tokens_from_chunks"] is True
    json_cells = [c for c in data["cells"] if c["class"] == "json"]
    assert all(c["schema_valid_rate"] is not None for c in json_cells)
    assert len(list(csv.DictReader((out / "summary.csv").open()))) == 4
    assert "Recommended concurrency" in (out / "report.md").read_text()
    for chart in ("throughput.png", "latency_p95.png", "ttft_cdf.png"):
        assert (out / chart).read_bytes().startswith(PNG)
    assert "client self-test" in result.stdout
