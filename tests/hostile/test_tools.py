"""The commands around a job, attacked: `batchrun doctor`, `batchrun sim` as a server for
testing faults, and the job's progress and `status`. Each test fails on the code as reviewed,
and names the defect."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from click.testing import CliRunner

import batchrun
from batchrun import cli_sim, jobs
from batchrun.config import resolve
from batchrun.doctor import diagnose, ready
from batchrun.errors import BatchrunError
from batchrun.jobs import Home
from batchrun.ledger import Ledger
from batchrun.run_state import RunnerSettings
from batchrun.sim import SimConfig, SimModel, SimServer, SimTransport

CHAT = {"model": "sim-1", "messages": [{"role": "user", "content": "hello there"}]}


# --- batchrun sim: one bad request, or an accepted option, takes the whole server down -----


async def _serving(model: SimModel, body: bytes) -> tuple[list[int], list[BaseException]]:
    """Serve `model` on 127.0.0.1, send `body` to the chat endpoint, then a good request;
    the statuses the client got (0: no answer) and what the server raised."""
    crashed: list[BaseException] = []
    statuses: list[int] = []
    port: list[int] = []
    started = anyio.Event()

    async def serve() -> None:
        try:
            await SimServer(model).serve("127.0.0.1", 0, lambda p: (port.append(p), started.set()))
        except Exception as exc:  # the server's task ended: it no longer serves anyone
            crashed.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(serve)
        await started.wait()
        url = f"http://127.0.0.1:{port[0]}/v1/chat/completions"
        async with httpx.AsyncClient(timeout=2) as client:
            for content in (body, json.dumps(CHAT).encode()):
                try:
                    response = await client.post(url, content=content)
                    statuses.append(response.status_code)
                except httpx.HTTPError:
                    statuses.append(0)
        tg.cancel_scope.cancel()
    return statuses, crashed


@pytest.mark.anyio
async def test_sim_server_survives_a_malformed_request() -> None:
    """`batchrun sim` is the server users point their clients at to test faults. One request
    whose `messages` is not a list (`{"messages": 5}`, a typo in a curl line or a client bug)
    raises inside the request handler, and anyio's listener lets that end the whole server:
    the sim process exits 1 with a traceback, and every later request (the test job's) gets
    'connection refused'. A server answers such a request 400 and goes on serving."""
    statuses, crashed = await _serving(SimModel(SimConfig()), b'{"messages": 5}')
    assert not crashed, f"one bad request ended `batchrun sim`: {crashed[0]!r}"
    assert statuses[0] in (400, 422), f"the malformed request got {statuses[0]}"
    assert statuses[1] == 200, f"the next, good request got {statuses[1]} (0: no server)"


def test_sim_min_output_tokens_above_the_default_max_is_refused_or_works(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`batchrun sim --min-output-tokens 64` (longer answers; the default max is 48) is
    accepted and the server starts, then its first request raises `ValueError: empty range
    for randrange()` and ends the server with a traceback (see the test above). It should be
    refused at start (exit 2, naming the two options), or serve answers."""
    served: list[SimModel] = []

    class NotServed:  # the model the command would serve; no socket
        def __init__(self, model: SimModel) -> None:
            served.append(model)

        async def serve(self, *_args: Any) -> None:
            return None

    monkeypatch.setattr(cli_sim, "SimServer", NotServed)
    result = CliRunner().invoke(cli_sim.sim, ["--port", "0", "--min-output-tokens", "64"])
    if result.exit_code == 2:
        return  # refused up front: fine
    assert result.exit_code == 0, result.output
    try:
        reply = served[0].handle("POST", "/v1/chat/completions", {}, json.dumps(CHAT).encode())
    except ValueError as exc:
        pytest.fail(f"accepted at start, then every request raises: {exc!r}")
    assert reply.status == 200


@pytest.mark.parametrize(
    "options",
    [{"slots": "8"}, {"slots": 0}, {"min_output_tokens": 64}],
    ids=["slots-as-string", "zero-slots", "min-above-max"],
)
def test_in_process_sim_options_are_checked_before_the_run(
    tmp_path: Path, options: dict[str, Any]
) -> None:
    """README: `sim_options` in a spec file takes `slots`, `tpot_slope`, `queue_limit`, ...;
    "one type check for spec files, options and simulator options". The options whose default
    is None (slots, queue_limit, rpm, tpm, api_key, json_schema) are not checked at all
    (`type(None).__name__` has no rule in `checked`), nor are ranges: `slots = "8"` (a quoted
    TOML number), `slots = 0` or a min_output_tokens above max_output_tokens are accepted,
    the job starts, and the first request raises TypeError / IndexError / ValueError out of the
    run (the CLI prints a traceback, exit 1). Expected: a UsageError before anything runs."""
    rows = [{"id": "a", "prompt": "hello"}]
    try:
        batchrun.submit(rows, home=tmp_path, backend="sim", sim_options=options, concurrency=1)
    except BatchrunError:
        return  # refused with batchrun's own error: what the CLI turns into exit 2
    except BaseException as exc:
        pytest.fail(f"sim_options {options} gave {type(exc).__name__}: {exc!r}"[:400])
    pytest.fail(f"sim_options {options} was accepted")


# --- batchrun doctor: verdicts that differ from what a job does -----------------------------


def _doctor(transport: httpx.AsyncBaseTransport, **options: Any) -> list[Any]:
    spec = resolve({"base_url": "http://127.0.0.1:9/v1", "server_metrics": "off", **options})
    return anyio.run(diagnose, spec, transport)


async def _job(
    tmp_path: Path, transport: httpx.AsyncBaseTransport, **options: Any
) -> dict[str, int]:
    home = Home.at(tmp_path, None)
    ledger = Ledger(home.ledger_url)
    spec = resolve(
        {"base_url": "http://127.0.0.1:9/v1", "concurrency": 1, "server_metrics": "off", **options}
    )
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"id": str(n), "prompt": f"p{n}"}) + "\n" for n in range(3)))
    jobs.create_job(ledger, "j", path, spec)
    await jobs.run_job(ledger, home, "j", spec, transport=transport, settings=RunnerSettings())
    counts = ledger.counts("j")
    ledger.close()
    return counts


def test_doctor_model_not_in_the_list_but_served_is_not_a_failure(tmp_path: Path) -> None:
    """llama.cpp's server (and Ollama, vLLM aliases) answers whatever `model` a request names
    and lists only the GGUF path in /v1/models. Checked against the real llama-server here:
    `doctor --base-url ... --model stories260K` says `FAIL model 'stories260K' is not among
    the listed models: /work/shared/models/stories260K.gguf` and exits 3, while `submit
    --model stories260K` runs every line `done` (a job never checks the list when --model is
    given). The simulator without --strict-models behaves the same. Doctor should ask the
    server (the chat probe) and judge by its answer: a 404 fails, an answer does not."""
    model = SimModel(SimConfig())  # like llama-server: any model name is answered
    counts = anyio.run(functools.partial(_job, tmp_path, SimTransport(model), model="stories260K"))
    assert counts["done"] == 3  # the job runs
    checks = _doctor(SimTransport(model), model="stories260K")
    failed = [f"{c.name}: {c.detail}" for c in checks if c.ok is False]
    assert ready(checks), f"doctor says not ready (exit 3): {failed}"


class NoStreaming(httpx.AsyncBaseTransport):
    """The simulator, but a streamed request gets 400 (a gateway or server that does not
    stream)."""

    def __init__(self) -> None:
        self.sim = SimTransport(SimModel(SimConfig()))

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and json.loads(request.content).get("stream"):
            return httpx.Response(400, json={"error": {"message": "streaming is not supported"}})
        return await self.sim.handle_async_request(request)


def test_doctor_is_not_ready_when_the_default_streamed_job_would_fail(tmp_path: Path) -> None:
    """A job streams by default (`--stream/--no-stream`, on). Against an endpoint that refuses
    streamed requests, doctor prints `FAIL streaming` but counts it inessential and ends with
    "ready: a job can run against this endpoint" (exit 0), and the night's job, run with the
    same options, fails every line. With the spec streaming, streaming is essential (or the
    verdict should say to run with --no-stream)."""
    counts = anyio.run(_job, tmp_path, NoStreaming())
    assert counts["failed"] == 3 and counts["done"] == 0  # the default job fails every line
    checks = _doctor(NoStreaming())
    assert any(c.name == "streaming" and c.ok is False for c in checks)
    assert not ready(checks), "doctor says ready (exit 0), the job with these options fails"


def test_doctor_reads_the_in_process_simulators_load() -> None:
    """`batchrun doctor --backend sim` says `- server load  none published (ConnectError;
    ConnectError): auto reads first tokens and throughput`: its /metrics reader is built
    without the simulator's transport and goes to the real network (sim.batchrun.invalid).
    A job with `--backend sim` reads the simulator's /metrics (its log: `server_metrics
    available: true, source: vllm`), so doctor tells the wrong thing about what `auto`
    will use."""
    spec = resolve({"backend": "sim"})
    checks = anyio.run(diagnose, spec)
    load = [c for c in checks if c.name == "server load"]
    assert load and load[0].ok is True, f"server load: {load[0].detail if load else 'absent'}"


# --- progress and status ---------------------------------------------------------------------


def test_progress_reaches_the_total_when_lines_repeat(tmp_path: Path) -> None:
    """20 rows, 5 distinct prompts: the run sends 5 requests and the 15 repeats take their
    first line's answer (`ledger.record` fans them out). The job ends 20 done, but the last
    progress update says done 5 of 20 (the bar stops at 25%): `Progress.update` is given the
    group's length, not what the commit finished. The same count feeds the summary's items/s
    and the worker's `recorded` in `status`."""
    rows = [{"id": f"r{n}", "prompt": f"same prompt {n % 5}"} for n in range(20)]
    updates: list[Any] = []
    report = batchrun.submit(
        rows, home=tmp_path, backend="sim", on_progress=updates.append, concurrency=2
    )
    assert report.counts["done"] == 20
    last = updates[-1]
    assert last.done == last.total == 20, f"last progress update: {last.done}/{last.total}"


def test_status_of_a_job_that_ran_and_was_stopped_is_not_not_started(tmp_path: Path) -> None:
    """A nightly job sent its first request and was aborted (a 401: the key was rotated), or
    was interrupted after 29 failed requests (seen by hand: `timeout` at 60 s against an
    endpoint answering 500). `status` says `not started` and `requests 0 attempts`, the state
    README gives a `submit --no-run` job: the morning's reader concludes cron never fired.
    `_state` decides from the attempts recorded on finished items only; the worker row in the
    same output says `requests: 1`. It should say `stopped`."""
    rows = [{"id": f"r{n}", "prompt": f"prompt {n}"} for n in range(3)]
    with pytest.raises(batchrun.JobAborted) as stopped:
        batchrun.submit(
            rows,
            job="nightly",
            home=tmp_path,
            backend="sim",
            model="sim-1",
            sim_options={"api_key": "the-servers-key"},
            concurrency=1,
        )
    assert stopped.value.report.stats.requests >= 1  # it did run and send
    detail = batchrun.status("nightly", home=tmp_path)
    assert detail["state"] != "not started", (
        f"state {detail['state']!r}, attempts {detail['attempts']}, "
        f"workers {[(w['state'], w['requests']) for w in detail['workers']]}"
    )


def test_sim_stats_count_only_the_faults_actually_injected() -> None:
    """README: `curl 127.0.0.1:8089/sim/stats  # requests, faults injected by kind`. The fault
    is drawn before the capacity model admits the request, and a request that the rate limit
    or the queue gate then refuses is answered with that 429, not with the fault, yet the
    fault is counted as injected. With `--rpm 1 --fault cut=1`, ten requests get one cut
    answer and nine 429s, and /sim/stats says `faults: {cut: 10}`: a tester matching the
    client's retries against the faults the server says it injected finds nine phantom ones."""
    now = [1000.0]
    model = SimModel(SimConfig(rpm=1, faults={"cut": 1.0}), clock=lambda: now[0])
    replies = []
    for n in range(10):
        body = {"messages": [{"role": "user", "content": f"prompt {n}"}]}
        replies.append(model.handle("POST", "/v1/chat/completions", {}, json.dumps(body).encode()))
    cut = sum(r.fault == "cut" for r in replies)
    refused = sum(r.status == 429 for r in replies)
    assert (cut, refused) == (1, 9)
    reported = model.stats()["faults"].get("cut", 0)
    assert reported == cut, f"/sim/stats says {reported} cut faults; {cut} request was cut"


def test_doctor_against_the_real_llama_server_with_a_model_alias(tmp_path: Path) -> None:
    """The same against llama.cpp's C++ `llama-server` (skipped where it is not built): the
    job with `--model stories260K` completes, doctor with the same options exits 3."""
    from tests.integration.llama_server import NativeLlamaServer, require_llama_server

    server = NativeLlamaServer(require_llama_server(), tmp_path / "server.log", metrics=False)
    server.start()
    try:
        options = {"base_url": server.url, "model": "stories260K", "max_tokens": 8}
        rows = [{"id": str(n), "prompt": f"Once upon a time {n}"} for n in range(3)]
        report = batchrun.submit(rows, home=tmp_path, concurrency=1, **options)
        assert report.counts["done"] == 3  # the job runs with this model name
        spec = resolve({**options, "server_metrics": "off"})
        checks = anyio.run(diagnose, spec)
        failed = [f"{c.name}: {c.detail}" for c in checks if c.ok is False]
        assert ready(checks), f"doctor says not ready (exit 3): {failed}"
    finally:
        server.kill()
