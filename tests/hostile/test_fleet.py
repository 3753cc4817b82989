"""Several endpoints in one job and prefix-aware order, attacked: each test failed on the code
before its fix, and names the defect it showed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from batchrun.sim import SimConfig
from tests.unit.test_fleet import (
    SYSTEMS,
    Hosts,
    chat,
    endpoints,
    run,
)


class HeldLead(Hosts):
    """Hosts whose request for `question 0` (a prefix group's first line) hangs until
    `release` is set: a server that took the request and never starts answering it."""

    def __init__(self, hosts: dict[str, SimConfig]) -> None:
        super().__init__(hosts)
        self.release = anyio.Event()
        self.started: list[str] = []  # hosts, as requests came (the held one too)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            self.started.append(request.url.host)
            if b'"question 0"' in request.content:
                await self.release.wait()
        return await super().handle_async_request(request)


@pytest.mark.anyio
async def test_a_hung_group_lead_on_one_endpoint_does_not_idle_the_other(tmp_path: Path) -> None:
    # One prefix group of 60 lines over two endpoints. The group's first line goes to `a`,
    # whose server hangs on it (until --timeout, 120 s by default). Its group's later lines
    # wait for its first token, so every worker parks on that one request and `b` -- whose
    # cache never held the prefix anyway -- is sent nothing: the whole job sends one request
    # for two minutes. README: "a free slot elsewhere is never left idle for the sake of it".
    hosts = HeldLead({"a.test": SimConfig(), "b.test": SimConfig()})
    rows = [{"id": f"q{i}", **chat(SYSTEMS[0], f"question {i}")} for i in range(60)]

    while_held: list[list[str]] = []

    async def watch() -> None:
        with anyio.move_on_after(3):  # real seconds; the whole job needs well under one
            while len(hosts.started) < 10:
                await anyio.sleep(0.01)
        while_held.append(list(hosts.started))
        hosts.release.set()

    got: list[Any] = []

    async def job() -> None:
        got.append(await run(tmp_path, hosts, lines=rows, endpoints=endpoints("a", "b")))

    async with anyio.create_task_group() as tg:
        tg.start_soon(job)
        tg.start_soon(watch)
    ledger, _stats = got[0]
    assert ledger.counts("j")["done"] == 60
    # before: ['a.test'] -- for 3 s nothing but the hung request was sent, on either endpoint
    # (with order="input" the same test sends the other 59 lines meanwhile)
    assert len(while_held[0]) >= 10, while_held[0]


class Bodies(Hosts):
    """Hosts that keep each POST's body, by host."""

    def __init__(self, hosts: dict[str, SimConfig]) -> None:
        super().__init__(hosts)
        self.bodies: dict[str, list[dict[str, Any]]] = {host: [] for host in hosts}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            self.bodies[request.url.host].append(json.loads(request.content))
        return await super().handle_async_request(request)


SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string"}},
    "required": ["name"],
}


@pytest.mark.anyio
async def test_an_endpoint_given_as_backend_llamacpp_gets_llama_cpps_guided_style(
    tmp_path: Path,
) -> None:
    # `--backend llamacpp` sends a schema as response_format {"type": "json_object", "schema"}
    # (presets.py: llama.cpp's style). The same server as `--endpoint a=URL,backend=llamacpp`
    # gets the job's style instead ("json_schema"): output_rules() (jobs.py) takes the guided
    # style from the job's preset, which with several endpoints is always `custom`.
    (tmp_path / "schema.json").write_text(json.dumps(SCHEMA))
    config = SimConfig(json_schema=SCHEMA)
    hosts = Bodies({"a.test": config, "b.test": config})
    names = ["a=http://a.test/v1,backend=llamacpp", "b=http://b.test/v1,backend=vllm"]
    ledger, _ = await run(
        tmp_path, hosts, n=8, endpoints=names, schema=str(tmp_path / "schema.json")
    )
    assert ledger.counts("j")["done"] == 8
    assert hosts.bodies["a.test"] and hosts.bodies["b.test"]
    styles = {
        host: {body["response_format"]["type"] for body in bodies}
        for host, bodies in hosts.bodies.items()
    }
    # before: both json_schema
    assert styles == {"a.test": {"json_object"}, "b.test": {"json_schema"}}


class NoModelsAtB(Hosts):
    """`b.test` refuses the key when asked its models: it is left out at the start."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET" and request.url.host == "b.test":
            return httpx.Response(401, json={"error": {"message": "invalid api key"}})
        return await super().handle_async_request(request)


@pytest.mark.anyio
async def test_a_lines_own_unknown_model_fails_that_line_when_an_endpoint_was_left_out(
    tmp_path: Path,
) -> None:
    # The same job as test_fleet.py's test_a_404_to_a_lines_own_model_fails_that_line_not_the_job,
    # but `b` is left out at the start (its model cannot be learned). With one lane left the
    # fleet "stands aside" (Fleet.only), and sender.py routes a 404 to the line's own model
    # as a FatalError: the whole job aborts (exit 3, 14 lines left pending) instead of failing
    # line p5 alone. README: "the others' results name who answered them, as in any job of
    # several" / "The line fails when no endpoint is left that may take it, and neither the
    # endpoint nor the job stops for it."
    strict = {"a.test": SimConfig(models=("m-a",), strict_models=True), "b.test": SimConfig()}
    rows = [{"id": f"p{i}", "prompt": f"prompt number {i}"} for i in range(20)]
    rows[5]["model"] = "m-nowhere"  # no endpoint has it
    ledger, stats = await run(
        tmp_path, NoModelsAtB(strict), lines=rows, model=None, endpoints=endpoints("a", "b")
    )
    assert {u.name: u.state for u in stats.endpoints} == {"a": "up", "b": "out"}
    assert stats.aborted is None, stats.aborted  # before: "404 ... m-nowhere ..."
    results = {item.item_id: item for item in ledger.iter_results("j")}
    assert results["p5"].status == "failed"
    assert ledger.counts("j")["done"] == 19


@pytest.mark.anyio
@pytest.mark.parametrize("concurrency", [4])  # "auto" fails too (4 of 40), slowly
async def test_an_endpoint_that_answers_429_to_everything_does_not_fail_lines_another_answers(
    tmp_path: Path, concurrency: int | str
) -> None:
    # `b` is over its rate limit for the whole run: it answers every request at once with a
    # 429 (Retry-After 1 s). Answering at once, it is always the endpoint with the fewest
    # requests in flight, so _load() (fleet.py) keeps picking it; a 429 is neither an outage
    # nor a refusal, so it costs the item an attempt, is not re-sent elsewhere at once and
    # never drains `b`. Lines that `a` answers at once run out of attempts on `b` and fail.
    def over_limit(request: httpx.Request, n: int) -> httpx.Response:
        return httpx.Response(
            429, headers={"retry-after": "1"}, json={"error": {"message": "rate limit reached"}}
        )

    hosts = Hosts({"a.test": SimConfig(), "b.test": SimConfig()}, {"b.test": over_limit})
    ledger, stats = await run(
        tmp_path,
        hosts,
        n=40,
        max_attempts=3,
        concurrency=concurrency,
        endpoints=endpoints("a", "b"),
    )
    counts = ledger.counts("j")
    assert stats.aborted is None
    assert counts["failed"] == 0 and counts["done"] == 40, (counts, dict(hosts.posts))


def test_a_line_that_failed_to_connect_goes_to_the_endpoint_that_answers(tmp_path: Path) -> None:
    """Found by the Python API review (4 December): two endpoints, one of them never
    listening. The first line sent there failed to connect, and every retry of it went back
    to the same dead endpoint (it was the least loaded, and one failed line never makes an
    endpoint "down": that takes failures on two lines, and the healthy endpoint had answered
    every other line by then): the line failed after 9 connection errors, all on the dead
    endpoint, 35-65 s of backoff, while the other answered everything at once. A line that
    failed to reach an endpoint goes next to another that may take it, at once."""
    import batchrun

    rows = [{"id": f"r{i}", "prompt": f"say {i}"} for i in range(30)]
    report = batchrun.submit(
        rows,
        home=tmp_path,
        endpoints=["a=http://sim.invalid/v1,backend=sim", "b=http://127.0.0.1:1/v1,model=m"],
        outage_timeout=0.5,
        sim_options={"ttft_ms": 0.0, "tpot_ms": 0.0},
    )
    assert report.ok, report.counts
    log = (tmp_path / "logs" / f"{report.job}.log").read_text().splitlines()
    tries: dict[str, list[str]] = {}
    for entry in map(json.loads, log):
        if entry["event"] == "attempt":
            tries.setdefault(entry["id"], []).append(entry["endpoint"])
    for line, where in tries.items():
        assert where.count("b") <= 1, (line, where)  # never back to the endpoint it missed
