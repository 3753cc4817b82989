"""Stale keep-alive connections (issue 11 item 5), against a real server on 127.0.0.1 that
closes them as cpp-httplib does, racing the client's next request (see server.py).

A request that meets a pooled connection the server had already closed, before a byte of
answer came back, goes again at once on a new connection: the caller never sees it. A server
that drops requests on new connections too still fails them, after one re-send at most; an
answer cut after some bytes is never sent again.
"""

from __future__ import annotations

import time

import anyio
import httpx
import pytest

from batchrun.backends import CompletionRequest, OpenAICompatBackend
from batchrun.bench.load import LoadPlan, run_cell
from batchrun.bench.suite import BenchClass
from batchrun.errors import ConnectionFailed, EmptyStream, RequestError, StreamCut
from tests.hostile.server import Behaviour, HostileServer

JOB = 1500  # the job that met 2-4% of stale connections against llama-server (streamed)
CONCURRENCY = 8


def chat(prompt: str) -> CompletionRequest:
    return CompletionRequest(
        "chat", {"model": "m", "messages": [{"role": "user", "content": prompt}]}
    )


def backend_for(server: HostileServer, *, stream: bool = True) -> OpenAICompatBackend:
    return OpenAICompatBackend(server.url, stream=stream, timeout=10, max_connections=CONCURRENCY)


async def run_job(
    backend: OpenAICompatBackend, count: int
) -> tuple[dict[str, str], list[RequestError]]:
    """Every item once, CONCURRENCY at a time, as the runner sends them: answers and errors."""
    answers: dict[str, str] = {}
    errors: list[RequestError] = []
    todo = iter(range(count))

    async def worker() -> None:
        for i in todo:
            try:
                answers[f"item {i}"] = (await backend.complete(chat(f"item {i}"))).text
            except RequestError as exc:
                errors.append(exc)

    async with anyio.create_task_group() as tg:
        for _ in range(CONCURRENCY):
            tg.start_soon(worker)
    return answers, errors


@pytest.mark.anyio
@pytest.mark.parametrize("reset", [False, True], ids=["fin", "rst"])
@pytest.mark.parametrize(
    ("stream", "count"), [(True, JOB), (False, JOB // 3)], ids=["streamed", "plain"]
)
async def test_a_job_over_connections_the_server_closes_gets_every_answer_without_an_error(
    stream: bool, count: int, reset: bool
) -> None:
    async with HostileServer(Behaviour(keep=3, reset=reset)) as server:
        backend = backend_for(server, stream=stream)
        try:
            with anyio.fail_after(120):
                answers, errors = await run_job(backend, count)
        finally:
            await backend.aclose()
    assert errors == []
    assert answers == {f"item {i}": f"echo: item {i}" for i in range(count)}
    assert server.counts.answered == count
    # Every fourth request on a pooled connection met it closed: the race, hundreds of times.
    assert server.counts.dropped > count // 10
    assert backend.stale_resends == server.counts.dropped


@pytest.mark.anyio
@pytest.mark.parametrize("reset", [False, True], ids=["fin", "rst"])
async def test_a_server_that_drops_every_request_still_fails_each_fast(reset: bool) -> None:
    async with HostileServer(Behaviour(drop_all=True, reset=reset)) as server:
        backend = backend_for(server)
        started = time.perf_counter()
        try:
            for i in range(20):
                with pytest.raises(ConnectionFailed):
                    await backend.complete(chat(f"item {i}"))
        finally:
            await backend.aclose()
        elapsed = time.perf_counter() - started
    # Each went once, on a new connection: a new connection closed unanswered is the
    # server's failure, not a stale one.
    assert server.counts.dropped == server.counts.connections == 20
    assert backend.stale_resends == 0
    assert elapsed < 5


@pytest.mark.anyio
async def test_a_server_that_breaks_with_idle_connections_pooled_gets_one_resend_only() -> None:
    async with HostileServer(Behaviour()) as server:
        backend = backend_for(server)
        try:
            async with anyio.create_task_group() as tg:  # CONCURRENCY connections, all pooled
                for i in range(CONCURRENCY):
                    tg.start_soon(backend.complete, chat(f"warm {i}"))
            assert server.counts.connections == CONCURRENCY
            server.behaviour.drop_all = True
            started = time.perf_counter()
            with pytest.raises(ConnectionFailed):
                await backend.complete(chat("after"))
            elapsed = time.perf_counter() - started
        finally:
            await backend.aclose()
    # Once on a pooled connection, once more on a new one, and no more: not once per idle
    # connection the pool still holds.
    assert server.counts.prompts.count("after") == 2
    assert server.counts.connections == CONCURRENCY + 1
    assert backend.stale_resends == 1
    assert elapsed < 2


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "plain"])
async def test_an_answer_cut_after_some_bytes_is_stream_cut_and_not_sent_again(
    stream: bool,
) -> None:
    async with HostileServer(Behaviour()) as server:
        backend = backend_for(server, stream=stream)
        try:
            assert (await backend.complete(chat("first"))).text == "echo: first"
            server.behaviour.cut = True  # the cut comes on the pooled connection
            with pytest.raises(StreamCut) as caught:
                await backend.complete(chat("second"))
        finally:
            await backend.aclose()
    assert not isinstance(caught.value, EmptyStream)
    assert server.counts.prompts == ["first", "second"]
    assert server.counts.cut == 1
    assert backend.stale_resends == 0


@pytest.mark.anyio
async def test_an_answer_that_is_not_http_is_a_connection_failure_and_not_sent_again() -> None:
    async with HostileServer(Behaviour()) as server:
        backend = backend_for(server)
        try:
            await backend.complete(chat("first"))
            server.behaviour.garbage = True  # bytes came back on the pooled connection
            with pytest.raises(ConnectionFailed):
                await backend.complete(chat("second"))
        finally:
            await backend.aclose()
    assert server.counts.prompts == ["first", "second"]
    assert backend.stale_resends == 0


@pytest.mark.anyio
async def test_bench_counts_no_stale_connection_as_the_servers_failure() -> None:
    async with HostileServer(Behaviour(keep=2)) as server:
        backend = backend_for(server)
        plan = LoadPlan(levels=(4,), repeat=12, warmup=2)
        try:
            cell = await run_cell(backend, "hostile", BenchClass("short", 8, ("hi",)), 4, plan)
        finally:
            await backend.aclose()
    assert [r.error for r in cell.records if not r.ok] == []
    assert len(cell.records) == 12
    assert server.counts.dropped > 0


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "plain"])
async def test_httpxs_own_transport_still_serves_the_backend(stream: bool) -> None:
    """httpx stays the interface: its own pool (httpcore, which refuses a request without a
    Host header) works under the backend as aiohttp's does."""
    async with HostileServer(Behaviour()) as server:
        transport = httpx.AsyncHTTPTransport()
        backend = OpenAICompatBackend(server.url, stream=stream, transport=transport)
        try:
            assert (await backend.complete(chat("own pool"))).text == "echo: own pool"
        finally:
            await backend.aclose()
            await transport.aclose()
