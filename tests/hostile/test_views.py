"""The commands that read and change a job after or beside a run (status, export, retry,
cancel, gc, doctor) and what they tell the user, attacked: each test fails on the code as
reviewed, and names the defect."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

import batchrun
from batchrun.cli import main


def _cli(home: Path, *args: str) -> Result:
    return CliRunner().invoke(main, ["--home", str(home), *args])


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _age(home: Path, job: str, seconds: float) -> None:
    """The job was last touched `seconds` ago (as if nights had gone by)."""
    with sqlite3.connect(home / "jobs" / "ledger.db") as conn:
        conn.execute(
            "UPDATE jobs SET updated_at = ?, created_at = ? WHERE name = ?",
            (time.time() - seconds, time.time() - seconds, job),
        )


ROWS = [{"id": f"r{n}", "prompt": f"describe product {n}"} for n in range(4)]


# --- gc ----------------------------------------------------------------------------------------


def test_gc_older_than_a_bare_number_is_not_taken_for_seconds(tmp_path: Path) -> None:
    """`batchrun gc --older-than 30` (the README's `gc [--older-than 30d]` with the unit left
    off, a cron line written from memory): the Python API refuses a bare 30 ("days or
    seconds? Asking is cheaper than a wrong guess that deletes"), and the CLI's own error
    says the age is "a number with s, m, h, d or w". The CLI takes "30" as 30 seconds and
    deletes a job finished two minutes ago: its results file, its log and its items."""
    source = _write(tmp_path / "night.jsonl", ROWS)
    report = batchrun.submit(source, home=tmp_path, backend="sim", concurrency=2)
    assert report.ok and report.output is not None
    _age(tmp_path, "night", 120)  # finished two minutes ago

    result = _cli(tmp_path, "gc", "--older-than", "30")

    state = batchrun.status("night", home=tmp_path)["state"]
    assert not state.startswith("collected"), (
        f"`gc --older-than 30` (exit {result.exit_code}: {result.output.strip()!r}) collected "
        f"a job finished 2 minutes ago; results file still there: {report.output.exists()}"
    )
    assert report.output.exists()


def test_gc_never_deletes_a_users_own_input_file_named_rows(tmp_path: Path) -> None:
    """README (Retention): gc removes "the HOME/inputs/rows-*.jsonl files written for rows from
    Python ... (a user's own input files are never touched)". A user's own nightly file that
    happens to be named `inputs/rows-2026-11.jsonl` (submitted from the CLI, not from rows)
    is deleted with its job: gc tells batchrun's files from the user's by the name's prefix
    alone."""
    source = _write(tmp_path / "inputs" / "rows-2026-11.jsonl", ROWS)
    result = _cli(tmp_path, "submit", str(source), "--backend", "sim", "-q")
    assert result.exit_code == 0, result.output
    _age(tmp_path, "rows-2026-11", 40 * 86400)

    result = _cli(tmp_path, "gc", "--older-than", "30d")
    assert result.exit_code == 0, result.output
    assert "removed 1 job" in result.output
    assert source.exists(), "gc deleted the user's own input file inputs/rows-2026-11.jsonl"


# --- export ------------------------------------------------------------------------------------


def test_export_during_the_last_moments_of_a_run_does_not_leave_a_stale_results_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README: `export` "writes it at any time", and the results file is written when the job
    finishes. A user exports a running job to look at it (the default place is the results
    file itself); export reads the ledger page by page (seconds for a big job), and the run
    finishes meanwhile and writes the complete results file; export's rename lands last, with
    lines still `pending`. The job is marked finished, so nothing writes the file again: a
    second `submit` says "nothing left to do" and the results file keeps the pending lines for
    good, while `status` says complete."""
    import batchrun.jobs as verbs

    source = _write(tmp_path / "night.jsonl", ROWS)
    batchrun.submit(source, home=tmp_path, run=False)
    real = verbs.write_results
    calls: list[str] = []

    def write_results(path: Path, items: Any, **kw: Any) -> int:
        calls.append(str(path))
        if len(calls) == 1:  # the user's export: it has read the ledger as it stood...
            snapshot = list(items)
            # ... when the run finishes and writes the complete results file
            batchrun.resume("night", home=tmp_path, backend="sim", concurrency=2)
            return real(path, snapshot, **kw)
        return real(path, items, **kw)

    monkeypatch.setattr(verbs, "write_results", write_results)
    batchrun.export("night", home=tmp_path)
    monkeypatch.setattr(verbs, "write_results", real)
    assert len(calls) >= 2, calls  # the export's and the run's (and the export's again)

    again = batchrun.submit(source, home=tmp_path, backend="sim")  # nothing left to do
    assert again.ok and again.output is not None
    statuses = [line["status"] for line in _lines(again.output)]
    assert statuses == ["done"] * 4, (
        f"status says complete, the results file says {statuses}, and stays so"
    )


# --- retry -------------------------------------------------------------------------------------

FAILING = {"sim_options": {"faults": {"500": 1.0}}, "max_attempts": 1, "outage_timeout": 0}


def test_retry_while_the_run_finishes_does_not_leave_the_old_results_file_for_good(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A nightly job ends with failed lines; the user, watching it, runs `batchrun retry` as
    the run writes its results file (seconds for a big job). The retry puts the lines back to
    pending, then the run marks the job finished anyway (`mark_finished` does not look at
    what is left). `resume` then answers every line, but finish() sees the job marked finished
    and a results file there, and never writes it again: the results file says `failed` for
    lines that `status` and `export` say are `done`."""
    from batchrun.ledger import Ledger

    source = _write(tmp_path / "night.jsonl", ROWS)
    real = Ledger.mark_finished
    retried: list[int] = []

    def mark_finished(self: Ledger, name: str, finished: bool) -> bool:
        if not retried:  # the results file is written; the user's retry comes now
            retried.append(batchrun.retry(name, home=tmp_path))
        return real(self, name, finished)

    monkeypatch.setattr(Ledger, "mark_finished", mark_finished)
    first = batchrun.submit(source, home=tmp_path, backend="sim", concurrency=2, **FAILING)
    monkeypatch.setattr(Ledger, "mark_finished", real)
    assert first.counts["failed"] == 4 and retried == [4]

    again = batchrun.resume("night", home=tmp_path, backend="sim", sim_options={})
    assert again.ok and again.output is not None, again.counts
    statuses = [line["status"] for line in _lines(again.output)]
    assert statuses == ["done"] * 4, f"every line is done; the results file says {statuses}"


# --- doctor ------------------------------------------------------------------------------------


class _NoStreamServer:
    """An OpenAI-compatible server that answers plain requests and refuses every streamed one
    (a proxy that buffers, an old server): a job with `--no-stream` runs fine against it."""

    def __enter__(self) -> str:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_args: Any) -> None:
                pass

            def _send(self, status: int, payload: Any) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": "m", "object": "model"}]})
                else:
                    self._send(404, {"error": {"message": "not found"}})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                if body.get("stream"):
                    self._send(400, {"error": {"message": "streaming is not supported here"}})
                    return
                usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
                if self.path.endswith("/chat/completions"):
                    content = '{"answer": "yes"}' if "response_format" in body else "Hello there."
                    choice = {
                        "index": 0,
                        "finish_reason": "stop",
                        "message": {"role": "assistant", "content": content},
                    }
                    self._send(
                        200,
                        {
                            "id": "x",
                            "object": "chat.completion",
                            "model": "m",
                            "choices": [choice],
                            "usage": usage,
                        },
                    )
                else:
                    choice = {"index": 0, "finish_reason": "stop", "text": " there was"}
                    self._send(
                        200,
                        {
                            "id": "x",
                            "object": "text_completion",
                            "model": "m",
                            "choices": [choice],
                            "usage": usage,
                        },
                    )

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __exit__(self, *_exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def test_doctor_says_ready_for_a_no_stream_job_against_a_server_that_cannot_stream(
    tmp_path: Path,
) -> None:
    """README (Point it at a real server): doctor "exits 0 when a job can run (reachable, key
    accepted, a model, chat answered, and streaming unless `--no-stream`: a job streams by
    default) and 3 otherwise". Against a server that answers plain requests and refuses
    streams, a `--no-stream` job runs (checked here), but doctor has no `--no-stream`: it
    refuses the flag (exit 2), and without it says "not ready" (exit 3) for good. It also
    sends its JSON schema probe streamed, and reports the stream's refusal as `FAIL  JSON
    schema  refused (json_schema)`: a server that takes response_format is said to refuse it."""
    with _NoStreamServer() as url:
        source = _write(tmp_path / "in.jsonl", ROWS)
        job = _cli(
            tmp_path,
            "submit",
            str(source),
            "--base-url",
            url,
            "--no-stream",
            "--concurrency",
            "1",
            "--server-metrics",
            "off",
            "-q",
        )
        assert job.exit_code == 0, job.output  # the job runs against it

        result = _cli(tmp_path, "doctor", "--base-url", url, "--no-stream", "--timeout", "5")
    assert result.exit_code == 0, (
        f"doctor --no-stream: exit {result.exit_code}: {result.output.strip()}"
    )
    assert "FAIL" not in result.output, result.output


def test_gc_does_not_collect_a_job_a_resume_has_started_but_not_yet_joined(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README (Retention): "A job with a live worker ... is never touched", and a collected
    job "is never run ... again (that would pass its kept answers off as the whole job)".
    A nightly `resume` of a job loaded weeks ago (with `--no-run`) starts by asking the
    server's /v1/models (up to --outage-timeout on a server still loading); it has checked
    that the job is not collected, and has not joined it yet. The nightly `gc --older-than
    30d` runs then and deletes every item (none was done). The resume goes on, finds nothing
    left, writes an EMPTY results file, and says the job is complete: exit 0, `ok`, the four
    lines silently gone."""
    from batchrun.sim import SimTransport

    source = _write(tmp_path / "night.jsonl", ROWS)
    batchrun.submit(source, home=tmp_path, run=False)
    _age(tmp_path, "night", 40 * 86400)
    real = SimTransport.handle_async_request
    collected: list[Any] = []

    async def handle(self: SimTransport, request: Any) -> Any:
        if request.url.path.endswith("/models") and not collected:  # the cron's gc, now
            collected.append(batchrun.gc("30d", home=tmp_path))
        return await real(self, request)

    monkeypatch.setattr(SimTransport, "handle_async_request", handle)
    outcome: Any
    try:
        outcome = batchrun.resume("night", home=tmp_path, backend="sim", concurrency=2)
    except batchrun.BatchrunError as exc:  # refused: the job was collected under it (fine)
        outcome = exc
    assert collected, "the run asked /v1/models"
    if isinstance(outcome, batchrun.BatchrunError):
        return
    lines = _lines(outcome.output) if outcome.output else []
    assert not (outcome.ok and len(lines) < len(ROWS)), (
        f"resume says ok, complete, counts {outcome.counts}, and wrote {len(lines)} of "
        f"{len(ROWS)} lines to {outcome.output}; gc collected {collected[0].jobs} under it"
    )


# --- the end-of-run summary --------------------------------------------------------------------


def test_the_summary_of_a_worker_stopped_beside_another_counts_the_items_it_still_runs() -> None:
    """Two workers run a nightly job (README: "Several workers"); one is stopped with Ctrl-C
    while the other still holds 300 items. The stopped one's summary line reads the job's
    counts but leaves `running` out: "job nightly: 500 done, 200 pending" for a job of
    1,000 lines, and where nothing is pending (the other holds the rest) not even the
    "interrupted; run resume" hint: it reads like a job that is over."""
    from batchrun.cli_report import summary_line
    from batchrun.report import JobReport
    from batchrun.run_state import RunStats

    counts = {
        "pending": 0,
        "running": 300,
        "batched": 0,
        "done": 700,
        "failed": 0,
        "invalid": 0,
        "rejected": 0,
    }
    stats = RunStats(requests=40, recorded=40, elapsed=2.0, interrupted=True)
    line = summary_line(JobReport("nightly", counts, False, None, stats=stats, workers=2))
    assert "300" in line, f"the other worker's 300 items are not said: {line!r}"


def test_submit_no_run_quiet_still_says_what_a_run_would_send(tmp_path: Path) -> None:
    """README: `submit FILE --no-run` "says what a run would do: requests to send, with their
    tokens at most ..."; `--quiet` is "No progress bar" (and "always a one-line summary at
    the end"). A cron script's `submit night.jsonl --no-run -q >> cron.log` logs nothing at
    all: with --quiet the preview (and the load message) are dropped, and --no-run never
    reaches the summary that prints the notes a quiet run held back."""
    source = _write(tmp_path / "night.jsonl", ROWS)
    result = _cli(tmp_path, "submit", str(source), "--no-run", "-q")
    assert result.exit_code == 0, result.output
    assert "would send 4 requests" in result.output, f"said: {result.output!r}"
