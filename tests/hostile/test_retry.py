"""A hostile review of failures and retries of single requests: which statuses are retried,
`--max-attempts` across runs, `--timeout`, Retry-After, the error kept for a failed line and
the attempt log. Each test fails on the code as reviewed and passes once the defect is fixed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from batchrun import jobs
from batchrun import runner as runner_module
from batchrun.config import resolve
from batchrun.jobs import Home
from batchrun.ledger import Ledger
from batchrun.run_state import RunnerSettings, RunStats
from tests.fakes import FakeTime
from tests.unit.test_runner import ScriptedTransport, rows, write_prompts

POISON = b"prompt number 1"


async def run_job(
    tmp_path: Path,
    transport: httpx.AsyncBaseTransport,
    *,
    create: bool,
    n: int = 3,
    fake: FakeTime | None = None,
    **options: Any,
) -> tuple[Ledger, RunStats]:
    """One run of job `j` (made first when `create`) over `transport`, in fake time."""
    home = Home.at(tmp_path, None)
    ledger = Ledger(home.ledger_url)
    spec = resolve({"backend": "sim", "concurrency": 1, "max_attempts": 3, **options})
    if create:
        write_prompts(tmp_path / "in.jsonl", n)
        jobs.create_job(ledger, "j", tmp_path / "in.jsonl", spec)
    fake = fake or FakeTime()
    settings = RunnerSettings(sleep=fake.sleep, clock=fake.clock, drain_timeout=0.0)
    stats = await jobs.run_job(
        ledger, home, "j", spec, transport=transport, settings=settings, handle_signals=False
    )
    return ledger, stats


def attempt_lines(tmp_path: Path, line: int) -> list[dict[str, Any]]:
    said = [json.loads(x) for x in (tmp_path / "logs" / "j.log").read_text().splitlines()]
    return [e for e in said if e.get("line") == line and "attempt" in e]


def capture_runners(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    made: list[Any] = []
    real_init = runner_module.Runner.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(runner_module.Runner, "__init__", init)
    return made


def stopped_during_second_attempt(made: list[Any]) -> ScriptedTransport:
    """Line 2 fails with a 500 every time; the first run is stopped (Ctrl-C) while its second
    request for it is on the wire."""

    def broken(request: httpx.Request, call: int) -> httpx.Response | None:
        if POISON in request.content:
            if call == 2 and len(made) == 1:
                made[0].request_stop()
            return httpx.Response(500, json={"error": {"message": "kaput"}})
        return None

    return ScriptedTransport(broken)


# --- attempts across a stop and a resume ------------------------------------------------------


@pytest.mark.anyio
async def test_attempts_sent_before_a_stop_still_count_after_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # README: `attempts` "counts every request sent for the item", and after --max-attempts (3
    # here) the item is failed. Before the fix the two requests of the stopped run were
    # forgotten: the resume sent 3 more (5 in all) and the result said `attempts: 3`.
    made = capture_runners(monkeypatch)
    transport = stopped_during_second_attempt(made)
    ledger, stats = await run_job(tmp_path, transport, create=True)
    assert stats.interrupted
    assert rows(ledger)[1]["status"] == "pending"
    ledger, stats = await run_job(tmp_path, transport, create=False)
    sent = transport.calls["prompt number 1"]
    poison = rows(ledger)[1]
    assert poison["status"] == "failed"
    assert poison["attempts"] == sent, f"{sent} requests sent, attempts says {poison['attempts']}"
    assert sent == 3, f"--max-attempts 3, but {sent} requests were sent for the line"


@pytest.mark.anyio
async def test_attempt_numbers_in_the_log_go_on_after_a_stop_and_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The log's attempt number is how a user reads what happened to a line. Before the fix
    # the resumed run numbered its requests from 1 again.
    made = capture_runners(monkeypatch)
    transport = stopped_during_second_attempt(made)
    await run_job(tmp_path, transport, create=True)
    await run_job(tmp_path, transport, create=False)
    numbers = [e["attempt"] for e in attempt_lines(tmp_path, 2)]
    assert numbers == [1, 2, 3]  # one line per request sent, numbered across both runs


@pytest.mark.anyio
async def test_retry_gives_a_stopped_and_failed_line_its_attempts_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `batchrun retry` puts a failed line back with a fresh --max-attempts; its `attempts`
    # still counts every request ever sent for it.
    made = capture_runners(monkeypatch)
    transport = stopped_during_second_attempt(made)
    await run_job(tmp_path, transport, create=True)
    ledger, _stats = await run_job(tmp_path, transport, create=False)
    assert rows(ledger)[1]["status"] == "failed"
    assert ledger.requeue("j") == 1
    ledger, _stats = await run_job(tmp_path, transport, create=False)
    assert transport.calls["prompt number 1"] == 6
    assert (rows(ledger)[1]["status"], rows(ledger)[1]["attempts"]) == ("failed", 6)


@pytest.mark.anyio
async def test_an_outage_before_a_stop_costs_the_lines_no_attempts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Failures while the endpoint is down for everyone cost no attempts (README, "Outages");
    # carried across a stop they still cost none: the resumed run has all 3 for each line.
    made = capture_runners(monkeypatch)
    down = {"on": True}

    def outage(request: httpx.Request, call: int) -> httpx.Response | None:
        if down["on"]:
            if sum(transport.calls.values()) >= 8 and len(made) == 1:
                made[0].request_stop()
            return httpx.Response(503, text="down")
        return httpx.Response(500, text="kaput") if POISON in request.content else None

    transport = ScriptedTransport(outage)
    ledger, stats = await run_job(tmp_path, transport, create=True, concurrency=2)
    assert stats.interrupted and stats.aborted is None
    before = transport.calls["prompt number 1"]
    down["on"] = False
    ledger, _stats = await run_job(tmp_path, transport, create=False, concurrency=2)
    poison = rows(ledger)[1]
    assert poison["status"] == "failed"
    assert transport.calls["prompt number 1"] - before == 3  # all of --max-attempts again
    assert poison["attempts"] == transport.calls["prompt number 1"]


# --- the asks again inside one attempt ---------------------------------------------------------


@pytest.mark.anyio
async def test_the_plain_ask_after_an_empty_stream_is_counted_and_logged(tmp_path: Path) -> None:
    # llama-cpp-python answers a prompt it cannot take with an empty stream; batchrun asks
    # again unstreamed. That is a second request, paid for and seen by the server: before the
    # fix `attempts` said 1 and the log had one attempt line for the two.
    def empty_stream(request: httpx.Request, _call: int) -> httpx.Response | None:
        if POISON in request.content and json.loads(request.content).get("stream"):
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=b"")
        return None

    transport = ScriptedTransport(empty_stream)
    ledger, stats = await run_job(tmp_path, transport, create=True)
    assert transport.calls["prompt number 1"] == 2  # the empty stream, then the plain ask
    line = rows(ledger)[1]
    assert (line["status"], line["attempts"]) == ("done", 2)
    logged = attempt_lines(tmp_path, 2)
    assert [(e["attempt"], e["status"]) for e in logged] == [(1, "error"), (2, "ok")]
    assert "without a single event" in logged[0]["error"]
    assert stats.requests == 4 and stats.retries == 0  # 3 lines, one of them asked twice


@pytest.mark.anyio
async def test_a_plain_ask_that_fails_counts_both_requests(tmp_path: Path) -> None:
    # The plain ask says why the stream was empty: a 400 naming the context limit. The line
    # fails at once with the server's words, after 2 requests (both counted).
    def too_long(request: httpx.Request, _call: int) -> httpx.Response | None:
        if POISON not in request.content:
            return None
        if json.loads(request.content).get("stream"):
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=b"")
        return httpx.Response(400, json={"error": {"message": "exceeds the context window"}})

    transport = ScriptedTransport(too_long)
    ledger, _stats = await run_job(tmp_path, transport, create=True)
    line = rows(ledger)[1]
    assert (line["status"], line["attempts"]) == ("failed", 2)
    assert "context window" in line["error"]
    assert [e["attempt"] for e in attempt_lines(tmp_path, 2)] == [1, 2]


@pytest.mark.anyio
async def test_the_ask_without_a_refused_stream_options_is_counted(tmp_path: Path) -> None:
    refused: list[int] = []

    def no_stream_options(request: httpx.Request, _call: int) -> httpx.Response | None:
        if "stream_options" in json.loads(request.content):
            refused.append(1)
            message = "Unrecognized request argument supplied: stream_options"
            return httpx.Response(400, json={"error": {"message": message}})
        return None

    transport = ScriptedTransport(no_stream_options)
    ledger, _stats = await run_job(tmp_path, transport, create=True, n=2)
    assert len(refused) == 1  # refused once, then never asked for again this run
    first = rows(ledger)[0]
    assert (first["status"], first["attempts"]) == ("done", 2)
    assert rows(ledger)[1]["attempts"] == 1


# --- what a failed line keeps as its error ----------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not streamed"])
async def test_a_200_whose_body_is_an_error_keeps_the_servers_words(
    tmp_path: Path, stream: bool
) -> None:
    # A proxy (LiteLLM, OpenRouter and others) answers some failures with a 200 whose JSON body
    # is an error object. A streamed answer's error object fails the attempt "with the
    # server's words" (README, "Whole answers only"); a plain JSON body's is thrown away: the
    # failed line's error says only "response has no usable choices", not why.
    said = "upstream provider refused: prompt is 9000 tokens, context is 4096"

    def error_body(request: httpx.Request, _call: int) -> httpx.Response | None:
        if POISON in request.content:
            return httpx.Response(200, json={"error": {"message": said, "code": 400}})
        return None

    ledger, _stats = await run_job(
        tmp_path, ScriptedTransport(error_body), create=True, stream=stream
    )
    poison = rows(ledger)[1]
    assert poison["status"] == "failed"
    assert said in poison["error"], poison["error"]


# --- a spent rate budget ------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_429_saying_when_its_spent_budget_resets_is_waited_out(tmp_path: Path) -> None:
    # A hosted API's requests-per-minute budget is spent: it answers 429 with
    # `x-ratelimit-remaining-requests: 0` and `x-ratelimit-reset-requests: 30s` (OpenAI's and
    # Groq's headers), no Retry-After, until the budget refills 30 s later. README: the
    # `x-ratelimit-*` headers pace the run, and a 429 whose remaining is 0 makes everyone
    # wait. The client waits 1 s (its default when there is no Retry-After) plus its backoff,
    # runs out of --max-attempts within a few seconds and fails lines the API would answer.
    fake = FakeTime()
    refills_at = fake.now + 30.0
    spent = {
        "x-ratelimit-limit-requests": "30",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "30s",
    }

    def budget(_request: httpx.Request, _call: int) -> httpx.Response | None:
        if fake.now < refills_at:
            return httpx.Response(429, headers=spent, json={"error": {"message": "rate limit"}})
        return None

    ledger, _stats = await run_job(
        tmp_path, ScriptedTransport(budget), create=True, fake=fake, max_attempts=5
    )
    statuses = [r["status"] for r in rows(ledger)]
    assert statuses == ["done"] * 3, (statuses, rows(ledger)[0]["error"], fake.sleeps)


# --- the grace given to a server that does not list its models yet -----------------------------


class ModelsUnavailable(httpx.AsyncBaseTransport):
    """A server behind a maintenance page: every request is a 503 asking for 250 s."""

    def __init__(self) -> None:
        self.requests = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.requests += 1
        return httpx.Response(503, headers={"retry-after": "250"}, text="maintenance")


@pytest.mark.anyio
async def test_no_model_given_the_server_gets_the_outage_grace_not_its_retry_after(
    tmp_path: Path,
) -> None:
    # README: with no --model "the server gets the same grace to answer /v1/models", and "in
    # an outage the outage's own looks keep their pace whatever [Retry-After] says, so
    # --outage-timeout stops the job when it says". Before the fix the first 503's
    # Retry-After (250 s, taken up to 300) is slept in full: a job with --outage-timeout 60
    # stops only after 250 s, and a 300 s page would hold it 5 minutes.
    fake = FakeTime()
    started = fake.now
    _ledger, stats = await run_job(
        tmp_path, ModelsUnavailable(), create=True, fake=fake, outage_timeout=60.0, model=None
    )
    assert stats.aborted is not None and "models" in stats.aborted
    waited = fake.now - started
    assert waited <= 60 + 30, f"stopped after {waited:g} s with --outage-timeout 60 ({fake.sleeps})"


# --- answers that say they are not whole ------------------------------------------------------


def sse_answer(text: str, finish: str) -> bytes:
    events = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": text}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]},
    ]
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    return body + b"data: [DONE]\n\n"


@pytest.mark.anyio
@pytest.mark.parametrize("finish", ["error", "abort"])
async def test_an_answer_the_engine_ended_with_an_error_is_retried_not_done(
    tmp_path: Path, finish: str
) -> None:
    # vLLM's finish reasons are part of its API: "stop", "length", "abort", "error" (a
    # retryable internal error, a KV-cache load failure say) and "repetition". An answer that
    # ends with "error" or "abort" is the engine giving up halfway, not an answer: README,
    # "Whole answers only". Before the fix it is recorded `done` with the half it had, and
    # never asked for again (the next night's reuse copies it too).
    def broken_once(request: httpx.Request, call: int) -> httpx.Response | None:
        if POISON in request.content and call == 1:
            headers = {"content-type": "text/event-stream"}
            return httpx.Response(
                200, headers=headers, content=sse_answer("The capital of", finish)
            )
        return None

    transport = ScriptedTransport(broken_once)
    ledger, _stats = await run_job(tmp_path, transport, create=True)
    line = rows(ledger)[1]
    assert line["output"] != "The capital of", (line["status"], line["finish_reason"])
    assert line["status"] == "done" and line["attempts"] == 2


# --- the attempt log ----------------------------------------------------------------------------


@pytest.mark.anyio
async def test_every_attempt_line_has_its_http_code_and_latency(tmp_path: Path) -> None:
    # README, "Logs, progress and secrets": one line per attempt with "attempt number, status,
    # HTTP code, latency, time to first token, tokens, error". Before the fix an answered
    # attempt has no HTTP code and a failed one no latency: `jq 'select(.http_status==200)'`
    # finds nothing, and a 504 after 60 s of waiting reads the same as an instant one.
    def once(request: httpx.Request, call: int) -> httpx.Response | None:
        if POISON in request.content and call == 1:
            return httpx.Response(504, text="upstream timed out")
        return None

    await run_job(tmp_path, ScriptedTransport(once), create=True)
    failed, answered = attempt_lines(tmp_path, 2)
    assert (failed["status"], answered["status"]) == ("error", "ok")
    assert failed.get("http_status") == 504
    assert answered.get("http_status") == 200, answered
    assert failed.get("latency_ms") is not None, failed
