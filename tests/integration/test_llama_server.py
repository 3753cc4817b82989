"""Real jobs against a real continuous-batching engine: llama.cpp's C++ `llama-server` with 8
parallel slots and the tiny stories model, through the CLI as a user runs it: a job under the
adaptive `--concurrency auto`, streamed; one at a fixed 8, not streamed; a bench sweep; doctor.

Assertions are on counts, statuses, files and the server's own counters, never on time.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path
from typing import Any

import httpx

from batchrun.backends.answers import StreamedAnswer
from tests.integration.helpers import CLI, write_prompts
from tests.integration.llama_server import SLOTS, NativeLlamaServer, require_llama_server

PNG = b"\x89PNG\r\n\x1a\n"
ITEMS = 300
WORKING_PROBES = (
    "reachable",
    "API key",
    "model",
    "chat",
    "usage (not streamed)",
    "streaming",
    "usage (streamed)",
    "completions",
)


def _submit(cli: CLI, server: NativeLlamaServer, inp: Path, *args: str) -> list[dict[str, Any]]:
    """Run `batchrun submit` to the end; the output rows, after checking it exited 0."""
    target = ("--backend", "llamacpp", "--base-url", server.url)
    result = cli.run(
        "submit", str(inp), *target, "--max-tokens", "16", "--quiet", *args, timeout=600
    )
    assert result.returncode == 0, result.stderr
    return cli.output(inp.stem)


def _attempts(cli: CLI, job: str) -> list[dict[str, Any]]:
    """The job log's attempt lines (one per request sent; batchrun/progress.py JobLog)."""
    lines = (cli.home / "logs" / f"{job}.log").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == "attempt"]


def _metric(text: str, name: str) -> float:
    """One sample of a Prometheus metric from llama-server's /metrics text."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics:\n{text}")


def _delta(before: str, after: str, name: str) -> float:
    return _metric(after, name) - _metric(before, name)


def _busy_slots(text: str) -> float:
    """Slots decoded, summed over every llama_decode() call since the server started (it
    reports only their mean per call, and the number of calls)."""
    decodes = _metric(text, "llamacpp:n_decode_total")
    return _metric(text, "llamacpp:n_busy_slots_per_decode") * decodes


def _busy_slots_per_decode(before: str, after: str) -> float:
    """The mean number of slots decoded together by the calls between two scrapes."""
    calls = _delta(before, after, "llamacpp:n_decode_total")
    return (_busy_slots(after) - _busy_slots(before)) / max(calls, 1.0)


def _check_complete(rows: list[dict[str, Any]], cli: CLI, job: str) -> None:
    """Every item done, once, with text; the ledger agrees with the output file; each line was
    answered exactly once (a retry follows only an error)."""
    assert len(rows) == ITEMS
    assert [r["id"] for r in rows] == [f"item-{i}" for i in range(ITEMS)]
    assert [r["status"] for r in rows] == ["done"] * ITEMS
    assert all(r["output"] for r in rows)
    assert {r["finish_reason"] for r in rows} <= {"stop", "length"}
    assert cli.counts(job) == {"done": ITEMS}
    answered = sorted(e["line"] for e in _attempts(cli, job) if e["status"] == "ok")
    assert len(answered) == ITEMS and len(set(answered)) == ITEMS


def test_a_300_item_job_streams_to_completion_under_auto_concurrency(
    cli: CLI, tmp_path: Path, native_llama_server: NativeLlamaServer
) -> None:
    inp = tmp_path / "auto.jsonl"
    write_prompts(inp, ITEMS)
    rows = _submit(cli, native_llama_server, inp, "--stream")  # --concurrency auto: the default
    _check_complete(rows, cli, "auto")
    assert all(r["ttft_ms"] is not None for r in rows)
    # llama-server honours stream_options.include_usage: real token counts, streamed
    assert all(r["usage"]["completion_tokens"] >= 1 for r in rows)
    assert all(r["usage"]["prompt_tokens"] >= 1 for r in rows)
    # The only failed attempts allowed are connections llama-server closed before answering
    # ("Server disconnected without sending a response"), seen here when `auto` holds more
    # connections than the server has HTTP threads (max(--parallel + 2, cores - 1) = 10).
    errors = [e for e in _attempts(cli, "auto") if e["status"] != "ok"]
    assert {e["error_kind"] for e in errors} <= {"ConnectionFailed"}, errors[:3]
    found, _changes = _server_metrics(cli, "auto")
    assert [(e["available"], e["source"]) for e in found] == [(True, "llamacpp")]


def _server_metrics(cli: CLI, job: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The job log's server_metrics events, and its concurrency changes."""
    lines = (cli.home / "logs" / f"{job}.log").read_text().splitlines()
    events = [json.loads(line) for line in lines]
    found = [e for e in events if e["event"] == "server_metrics"]
    return found, [e for e in events if e["event"] == "concurrency"]


def test_auto_reads_the_slots_page_of_a_server_started_without_metrics(
    cli: CLI, tmp_path: Path
) -> None:
    """llama-server as most users start it (no --metrics) still says, on /slots, how many slots
    it has and how many are busy: `auto` settles just above the slots, not where first tokens
    happened to rise."""
    server = NativeLlamaServer(require_llama_server(), tmp_path / "server.log", metrics=False)
    try:
        server.start()
        inp = tmp_path / "slots.jsonl"
        write_prompts(inp, ITEMS)
        rows = _submit(cli, server, inp, "--stream")
        _status, report, probes = _doctor(cli, server)
    finally:
        server.kill()
    assert probes["server load"][0] == "ok", report
    assert re.fullmatch(rf"llamacpp-slots: \d of {SLOTS} slots busy", probes["server load"][1])
    _check_complete(rows, cli, "slots")
    found, changes = _server_metrics(cli, "slots")
    assert [(e["available"], e["source"]) for e in found] == [(True, "llamacpp-slots")]
    queued = [e for e in changes if e["reason"] == "queue"]
    assert queued and queued[0]["signal"] == "server metrics"
    assert queued[0]["limit"] == SLOTS + 1  # the busy slots, and one on its way
    assert all(e["limit"] <= 2 * SLOTS for e in changes[changes.index(queued[0]) :])


def test_a_300_item_job_without_streaming_at_a_fixed_8_fills_the_slots(
    cli: CLI, tmp_path: Path, native_llama_server: NativeLlamaServer
) -> None:
    before = native_llama_server.metrics()
    inp = tmp_path / "fixed.jsonl"
    write_prompts(inp, ITEMS)
    rows = _submit(cli, native_llama_server, inp, "--no-stream", "--concurrency", str(SLOTS))
    _check_complete(rows, cli, "fixed")
    assert all(r["usage"]["completion_tokens"] >= 1 for r in rows)
    cut = [r for r in rows if r["finish_reason"] == "length"]
    assert all(r["usage"]["completion_tokens"] == 16 for r in cut)
    after = native_llama_server.metrics()
    predicted = _delta(before, after, "llamacpp:tokens_predicted_total")
    # every token the client was given was generated by the server (a retried request may add
    # a few it generated for an answer that was lost)
    assert predicted >= sum(r["usage"]["completion_tokens"] for r in rows)
    # continuous batching at work: on average at least two requests shared each decode step
    assert _busy_slots_per_decode(before, after) >= 2


def test_a_bench_sweep_completes_with_every_request_answered_and_every_file_written(
    cli: CLI, tmp_path: Path, native_llama_server: NativeLlamaServer
) -> None:
    out = tmp_path / "bench"
    target = ("--backend", "llamacpp", "--base-url", native_llama_server.url)
    sweep = ("--classes", "short", "--concurrency", "1,4,8", "--repeat", "8", "--max-tokens", "32")
    result = cli.run("bench", *target, *sweep, "--no-self-test", "-o", str(out), timeout=600)
    assert result.returncode == 0, result.stderr
    data = json.loads((out / "results.json").read_text())
    assert data["endpoints"][0]["model"].endswith("stories260K.gguf")
    assert [c["concurrency"] for c in data["cells"]] == [1, 4, 8]
    for cell in data["cells"]:
        assert cell["success_rate"] == 1.0, cell["errors"]
        assert cell["requests"] == 8
        assert cell["output_throughput"] > 0
        assert cell["tokens_from_chunks"] is False  # usage streamed: counted by the server
    assert len(list(csv.DictReader((out / "summary.csv").open()))) == 3
    assert "Recommended concurrency" in (out / "report.md").read_text()
    for chart in ("throughput.png", "latency_p95.png", "ttft_cdf.png"):
        assert (out / chart).read_bytes().startswith(PNG)


def _doctor(cli: CLI, server: NativeLlamaServer) -> tuple[int, str, dict[str, tuple[str, str]]]:
    """Exit status, stdout, and each probe's mark ("ok", "FAIL", "-") and detail, read from the
    report's `MARK  NAME  DETAIL` columns (batchrun/doctor.py render)."""
    result = cli.run("doctor", "--backend", "llamacpp", "--base-url", server.url)
    probes = {}
    for line in result.stdout.splitlines():
        mark, name, detail = line[:4].strip(), line[6:28].strip(), line[29:]
        probes[name] = (mark, detail)
    return result.returncode, result.stdout + result.stderr, probes


def test_doctor_finds_the_endpoint_ready_with_usage_streamed_and_not(
    cli: CLI, native_llama_server: NativeLlamaServer
) -> None:
    status, report, probes = _doctor(cli, native_llama_server)
    assert status == 0, report
    assert "ready: a job can run against this endpoint" in report
    for probe in WORKING_PROBES:
        assert probes.get(probe, ("missing", ""))[0] == "ok", report
    assert probes["model"][1].endswith("stories260K.gguf")
    assert probes["usage (streamed)"][1].endswith(" completion")  # "N prompt + M completion"
    assert probes["server load"][0] == "ok", report
    assert re.fullmatch(r"llamacpp: \d running, \d waiting", probes["server load"][1])


def test_doctor_finds_guided_json_enforced(
    cli: CLI, native_llama_server: NativeLlamaServer
) -> None:
    # Before: mostly `FAIL JSON schema: ... truncated` (a free string ran past 64 tokens).
    _status, report, probes = _doctor(cli, native_llama_server)
    assert probes["JSON schema"] == ("ok", "accepted and enforced (json_object)"), report


def _read(raw: bytes, endpoint: str, *, frames: bool) -> tuple[object, ...]:
    """An answer read from a stream's bytes in one network read, as a client behind its
    server reads it: with frames (backends/frames.py) or every event parsed on its own."""
    answer = StreamedAnswer(endpoint, 0.0, None)
    if not frames:
        answer.frames_left = 0
    answer.feed(raw)
    answer.close()
    done = answer.completion()
    framed = answer.frame is not None
    return (done.text, done.finish_reason, len(answer.times), done.completion_tokens, framed)


def test_its_streamed_events_read_the_same_framed_or_one_by_one(
    native_llama_server: NativeLlamaServer,
) -> None:
    # llama-server's own bytes: its field order (choices first), its escapes, its usage event.
    paths = {"chat": "/chat/completions", "completions": "/completions"}
    for endpoint, path in paths.items():
        for prompt in ("Once upon a time", 'She said "hi",\nand then'):
            ask = {"role": "user", "content": prompt}
            body = {"messages": [ask]} if endpoint == "chat" else {"prompt": prompt}
            body |= {"max_tokens": 40, "ignore_eos": True, "stream": True}  # 40 tokens, always
            body["stream_options"] = {"include_usage": True}
            raw = httpx.post(native_llama_server.url + path, json=body, timeout=60).content
            framed = _read(raw, endpoint, frames=True)
            assert framed[:4] == _read(raw, endpoint, frames=False)[:4]
            assert framed[0] and framed[2] >= 4 and framed[3] == 40 and framed[4], framed
