"""Seeded fault injection: FaultPlan, each fault kind through the real client, and SimServer."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
import orjson
import pytest

from batchrun.backends import Completion, CompletionRequest, OpenAICompatBackend
from batchrun.errors import (
    ConnectionFailed,
    Overloaded,
    RateLimited,
    RequestError,
    RequestTimeout,
    StreamCut,
)
from batchrun.sim import SimConfig, SimModel, SimServer, SimTransport, prompt_tag
from batchrun.sim.faults import FAULT_KINDS, FaultPlan, check_rates

BASE = "http://llm.test/v1"
HANG_TIMEOUT = 0.2  # the client timeout used wherever a "hang" must end
SEED = 7

# The error type the client must raise for each fault kind, streamed or not.
EXPECTED_ERROR: dict[str, type[RequestError]] = {
    "429": RateLimited,
    "500": Overloaded,
    "502": Overloaded,
    "503": Overloaded,
    "504": Overloaded,
    "reset": ConnectionFailed,
    "hang": RequestTimeout,
    "cut": StreamCut,
    "nonjson": StreamCut,
    "empty": StreamCut,
}


def chat(content: str) -> CompletionRequest:
    return CompletionRequest(
        "chat", {"model": "sim-1", "messages": [{"role": "user", "content": content}]}
    )


def find_prompt(
    rates: dict[str, float], pattern: list[str | None], seed: int = SEED, prefix: str = "p"
) -> str:
    """A prompt whose first len(pattern) picks under FaultPlan(rates, seed) are `pattern`.

    A single-message chat request's prompt text is its content, so the model's tag for the
    request is prompt_tag(content); a fresh plan predicts exactly what the model will pick.
    """
    for i in range(100_000):
        content = f"{prefix}-{i}"
        plan = FaultPlan(rates, seed)
        tag = prompt_tag(content)
        if [plan.pick(tag) for _ in pattern] == pattern:
            return content
    raise AssertionError(f"no prompt found for {pattern}")


def transport_backend(
    model: SimModel, *, stream: bool = True, timeout: float = 5.0
) -> OpenAICompatBackend:
    return OpenAICompatBackend(BASE, transport=SimTransport(model), stream=stream, timeout=timeout)


# --- FaultPlan ----------------------------------------------------------------------------------

MIXED = {"429": 0.2, "500": 0.15, "reset": 0.1, "cut": 0.1}


def test_same_seed_same_sequence_per_prompt_regardless_of_order() -> None:
    prompts = [prompt_tag(f"prompt {i}") for i in range(5)]
    n = 40
    order_a = [p for _ in range(n) for p in prompts]  # round robin
    order_b = [p for p in reversed(prompts) for _ in range(n)]  # one prompt at a time, reversed

    def sequences(order: list[str]) -> dict[str, list[str | None]]:
        plan = FaultPlan(MIXED, seed=123)
        seqs: dict[str, list[str | None]] = {p: [] for p in prompts}
        for tag in order:
            seqs[tag].append(plan.pick(tag))
        return seqs

    a, b = sequences(order_a), sequences(order_b)
    assert a == b
    for seq in a.values():
        assert len(seq) == n
        assert None in seq  # both faults and clean answers, so the comparison means something
        assert any(kind is not None for kind in seq)
    # the sequences differ between prompts: the prompt is part of the draw
    assert len({tuple(seq) for seq in a.values()}) == len(prompts)


def test_two_interleaved_prompts_keep_their_sequences() -> None:
    x, y = prompt_tag("x"), prompt_tag("y")
    plan1, plan2 = FaultPlan(MIXED, seed=5), FaultPlan(MIXED, seed=5)
    seq1: dict[str, list[str | None]] = {x: [], y: []}
    seq2: dict[str, list[str | None]] = {x: [], y: []}
    for tag in [x, x, y, x, y, y, y, x, x, y] * 5:
        seq1[tag].append(plan1.pick(tag))
    for tag in [y, y, y, x, y, x, x, y, x, x] * 5:
        seq2[tag].append(plan2.pick(tag))
    assert seq1 == seq2


def test_different_seed_gives_a_different_pattern() -> None:
    tags = [prompt_tag(f"q{i}") for i in range(300)]

    def pattern(seed: int) -> list[str | None]:
        plan = FaultPlan(MIXED, seed=seed)
        return [plan.pick(tag) for tag in tags for _ in range(2)]

    assert pattern(1) == pattern(1)
    p1, p2 = pattern(1), pattern(2)
    differing = sum(a != b for a, b in zip(p1, p2, strict=True))
    assert differing > len(p1) // 10


def test_observed_frequencies_match_the_rates() -> None:
    rates = {
        "429": 0.10,
        "500": 0.05,
        "502": 0.05,
        "503": 0.05,
        "504": 0.05,
        "reset": 0.05,
        "hang": 0.02,
        "cut": 0.05,
        "nonjson": 0.03,
        "empty": 0.05,
    }
    plan = FaultPlan(rates, seed=42)
    n = 20_000
    picks: Counter[str | None] = Counter()
    for i in range(n // 4):
        tag = prompt_tag(f"item {i}")
        for _ in range(4):  # first tries and re-sends alike
            picks[plan.pick(tag)] += 1
    assert sum(picks.values()) == n
    for kind, rate in rates.items():
        tolerance = 5 * math.sqrt(rate * (1 - rate) / n)
        assert abs(picks[kind] / n - rate) <= tolerance, (kind, picks[kind])
    clean = 1 - sum(rates.values())
    assert abs(picks[None] / n - clean) <= 5 * math.sqrt(clean * (1 - clean) / n)
    # injected counts exactly what was handed out
    assert dict(plan.injected) == {k: v for k, v in picks.items() if k is not None}
    assert sum(plan.injected.values()) == n - picks[None]


@pytest.mark.parametrize("rates", [{}, {"500": 0.0}, dict.fromkeys(FAULT_KINDS, 0.0)])
def test_zero_rates_never_inject(rates: dict[str, float]) -> None:
    plan = FaultPlan(rates, seed=3)
    for i in range(2_000):
        assert plan.pick(prompt_tag(str(i))) is None
    assert plan.injected == Counter()


def test_rate_one_always_injects() -> None:
    plan = FaultPlan({"502": 1.0}, seed=3)
    assert all(plan.pick(prompt_tag(str(i % 7))) == "502" for i in range(500))
    assert plan.injected == Counter({"502": 500})


def test_check_rates_accepts_valid_tables() -> None:
    assert check_rates({}) == {}
    table = check_rates({"429": 1, "500": 0})
    assert table == {"429": 1.0, "500": 0.0}
    assert all(type(v) is float for v in table.values())
    assert check_rates({"429": 0.5, "reset": 0.5}) == {"429": 0.5, "reset": 0.5}


def test_check_rates_accepts_rates_that_add_up_to_exactly_one() -> None:
    # 0.34 + 0.56 + 0.1 is 1 in decimal, 1.0000000000000002 in binary floating point
    assert check_rates({"429": 0.34, "500": 0.56, "502": 0.1}) == {
        "429": 0.34,
        "500": 0.56,
        "502": 0.1,
    }


@pytest.mark.parametrize(
    ("rates", "words"),
    [
        ({"418": 0.1}, ["unknown fault kind", "418"]),
        ({"timeout": 0.1, "500": 0.1}, ["unknown fault kind", "timeout"]),
        ({"500": -0.1}, ["500", "between 0 and 1", "-0.1"]),
        ({"reset": 1.5}, ["reset", "between 0 and 1", "1.5"]),
        ({"hang": True}, ["hang", "True"]),
        ({"cut": False}, ["cut", "False"]),
        ({"429": "0.5"}, ["429", "'0.5'"]),
        ({"429": None}, ["429", "None"]),
        ({"429": float("nan")}, ["429", "nan"]),
        ({"429": 0.6, "500": 0.5}, ["add up to 1.1", "more than 1"]),
        (dict.fromkeys(FAULT_KINDS, 0.2), ["add up to 2", "more than 1"]),
    ],
)
def test_check_rates_rejects_bad_tables(rates: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        check_rates(rates)
    for word in words:
        assert word in str(info.value)
    with pytest.raises(ValueError):
        FaultPlan(rates)
    with pytest.raises(ValueError):
        SimModel(SimConfig(faults=rates))


# --- each fault kind through the real client, over SimTransport --------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "plain"])
@pytest.mark.parametrize("kind", FAULT_KINDS)
async def test_every_fault_kind_maps_to_its_error(kind: str, stream: bool) -> None:
    model = SimModel(SimConfig(faults={kind: 1.0}, retry_after_ms=1500))
    backend = transport_backend(model, stream=stream, timeout=HANG_TIMEOUT)
    try:
        with anyio.fail_after(5):
            with pytest.raises(RequestError) as info:
                await backend.complete(chat(f"fault {kind}"))
    finally:
        await backend.aclose()
    error = info.value
    assert type(error) is EXPECTED_ERROR[kind], (kind, error)
    if kind in ("429", "500", "502", "503", "504"):
        assert error.status == int(kind)
        assert kind in str(error)
    if kind == "429":
        assert isinstance(error, RateLimited)
        assert error.retry_after == pytest.approx(1.5)
    assert model.stats()["faults"] == {kind: 1}
    assert model.stats()["requests"] == 1
    assert model.stats()["answered"] == 0


@pytest.mark.anyio
@pytest.mark.parametrize("retry_after_ms", [50.0, 250.0, 2500.0])
async def test_rate_limit_retry_after_follows_the_config(retry_after_ms: float) -> None:
    model = SimModel(SimConfig(faults={"429": 1.0}, retry_after_ms=retry_after_ms))
    backend = transport_backend(model)
    try:
        with pytest.raises(RateLimited) as info:
            await backend.complete(chat("slow down"))
    finally:
        await backend.aclose()
    assert info.value.retry_after == pytest.approx(retry_after_ms / 1000)
    assert info.value.status == 429


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "plain"])
@pytest.mark.parametrize("kind", FAULT_KINDS)
async def test_same_model_answers_once_the_plan_says_no_fault(kind: str, stream: bool) -> None:
    rates = {kind: 0.5}
    content = find_prompt(rates, [kind, None], prefix=f"recover-{kind}")
    model = SimModel(SimConfig(faults=rates, fault_seed=SEED))
    backend = transport_backend(model, stream=stream, timeout=HANG_TIMEOUT)
    try:
        with anyio.fail_after(5):
            with pytest.raises(EXPECTED_ERROR[kind]):
                await backend.complete(chat(content))
            result = await backend.complete(chat(content))
    finally:
        await backend.aclose()
    assert isinstance(result, Completion)
    assert result.text.startswith(prompt_tag(content))
    assert result.finish_reason == "stop"
    assert model.stats() == {
        "requests": 2,
        "answered": 1,
        "resent_after_success": 0,
        "faults": {kind: 1},
    }


# --- SimModel.stats() ---------------------------------------------------------------------------


@pytest.mark.anyio
async def test_stats_count_requests_faults_and_resends() -> None:
    rates = {"500": 0.3, "cut": 0.3}
    twice = find_prompt(rates, [None, "500", "cut", None], prefix="twice")
    once = find_prompt(rates, [None], prefix="once")
    model = SimModel(SimConfig(faults=rates, fault_seed=SEED))
    backend = transport_backend(model)
    try:
        await backend.complete(chat(twice))
        assert model.stats() == {
            "requests": 1,
            "answered": 1,
            "resent_after_success": 0,
            "faults": {},
        }
        with pytest.raises(Overloaded):
            await backend.complete(chat(twice))
        with pytest.raises(StreamCut):
            await backend.complete(chat(twice))
        # faulted replies to an answered prompt are not re-sent answers
        assert model.stats() == {
            "requests": 3,
            "answered": 1,
            "resent_after_success": 0,
            "faults": {"500": 1, "cut": 1},
        }
        await backend.complete(chat(once))
        assert model.stats()["resent_after_success"] == 0
        assert model.stats()["answered"] == 2
        await backend.complete(chat(twice))  # a complete answer, again
        assert await backend.list_models() == ["sim-1"]  # not a completion request
    finally:
        await backend.aclose()
    assert model.stats() == {
        "requests": 5,
        "answered": 2,
        "resent_after_success": 1,
        "faults": {"500": 1, "cut": 1},
    }


def test_stats_cut_after_success_is_not_a_resend() -> None:
    rates = {"cut": 0.5}
    content = find_prompt(rates, [None, "cut", "cut"], prefix="cut-after")
    model = SimModel(SimConfig(faults=rates, fault_seed=SEED))
    body = {"model": "sim-1", "messages": [{"role": "user", "content": content}]}
    first = model.complete("chat", dict(body))
    assert first.fault is None and first.status == 200
    for stream in (False, True):
        reply = model.complete("chat", {**body, "stream": stream})
        assert reply.fault == "cut"
    assert model.stats() == {
        "requests": 3,
        "answered": 1,
        "resent_after_success": 0,
        "faults": {"cut": 2},
    }


# --- the real HTTP server on 127.0.0.1 ----------------------------------------------------------


@asynccontextmanager
async def serving(model: SimModel) -> AsyncIterator[str]:
    """Run SimServer on 127.0.0.1 on a free port; yields its root URL."""
    ready = anyio.Event()
    ports: list[int] = []

    def on_ready(port: int) -> None:
        ports.append(port)
        ready.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(SimServer(model).serve, "127.0.0.1", 0, on_ready)
        await ready.wait()
        try:
            yield f"http://127.0.0.1:{ports[0]}"
        finally:
            tg.cancel_scope.cancel()


def server_backend(root: str, *, stream: bool, timeout: float = 5.0) -> OpenAICompatBackend:
    return OpenAICompatBackend(f"{root}/v1", stream=stream, timeout=timeout)


async def raw_exchange(port: int, request: bytes, *, wait: float = 5.0) -> bytes:
    """Send one raw request on a new connection and read until the server closes it."""
    data = b""
    async with await anyio.connect_tcp("127.0.0.1", port) as sock:
        await sock.send(request)
        with anyio.move_on_after(wait):
            while True:
                try:
                    data += await sock.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    break
    return data


def raw_post(content: str, *, stream: bool) -> bytes:
    body = orjson.dumps(
        {"model": "sim-1", "messages": [{"role": "user", "content": content}], "stream": stream}
    )
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def port_of(root: str) -> int:
    return int(root.rsplit(":", 1)[1])


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "plain"])
async def test_server_reset_is_a_connection_failure(stream: bool) -> None:
    model = SimModel(SimConfig(faults={"reset": 1.0}))
    with anyio.fail_after(10):
        async with serving(model) as root:
            backend = server_backend(root, stream=stream)
            try:
                with pytest.raises(ConnectionFailed):
                    await backend.complete(chat("reset me"))
                with pytest.raises(ConnectionFailed):
                    await backend.complete(chat("reset me"))
            finally:
                await backend.aclose()
            # a reset closes without a single byte of answer
            assert await raw_exchange(port_of(root), raw_post("raw", stream=stream)) == b""
            async with httpx.AsyncClient() as client:
                stats = (await client.get(f"{root}/sim/stats")).json()
    assert stats == {
        "requests": 3,
        "answered": 0,
        "resent_after_success": 0,
        "faults": {"reset": 3},
    }


@pytest.mark.anyio
async def test_server_streamed_cut_ends_without_done() -> None:
    model = SimModel(SimConfig(faults={"cut": 1.0}))
    with anyio.fail_after(10):
        async with serving(model) as root:
            backend = server_backend(root, stream=True)
            try:
                with pytest.raises(StreamCut):
                    await backend.complete(chat("cut me"))
            finally:
                await backend.aclose()

            lines: list[str] = []
            body = chat("cut me").body | {"stream": True}
            async with httpx.AsyncClient() as client:
                with pytest.raises(httpx.RemoteProtocolError):
                    async with client.stream(
                        "POST", f"{root}/v1/chat/completions", json=body
                    ) as resp:
                        assert resp.status_code == 200
                        assert resp.headers["content-type"] == "text/event-stream"
                        async for line in resp.aiter_lines():
                            if line:
                                lines.append(line)
    assert lines, "part of the stream arrives before the cut"
    assert all(line.startswith("data: {") for line in lines)
    assert "data: [DONE]" not in lines
    chunks = [orjson.loads(line[len("data: ") :]) for line in lines]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
    assert model.stats()["faults"] == {"cut": 2}


@pytest.mark.anyio
async def test_server_plain_cut_is_an_incomplete_body() -> None:
    model = SimModel(SimConfig(faults={"cut": 1.0}))
    with anyio.fail_after(10):
        async with serving(model) as root:
            backend = server_backend(root, stream=False)
            try:
                with pytest.raises(StreamCut):
                    await backend.complete(chat("cut me"))
            finally:
                await backend.aclose()
            data = await raw_exchange(port_of(root), raw_post("cut me", stream=False))
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    headers = dict(line.split(": ", 1) for line in head.decode("latin-1").split("\r\n")[1:] if line)
    promised = int(headers["content-length"])
    assert 0 < len(body) < promised
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(body)


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "plain"])
async def test_server_hang_times_out_and_server_keeps_serving(stream: bool) -> None:
    rates = {"hang": 0.5}
    content = find_prompt(rates, [None, "hang", None], prefix="hang")
    model = SimModel(SimConfig(faults=rates, fault_seed=SEED))
    with anyio.fail_after(10):
        async with serving(model) as root:
            backend = server_backend(root, stream=stream, timeout=HANG_TIMEOUT)
            try:
                first = await backend.complete(chat(content))
                with pytest.raises(RequestTimeout):
                    await backend.complete(chat(content))
                # the same client goes on, on a new connection: the hung one was dropped
                again = await backend.complete(chat(content))
            finally:
                await backend.aclose()
            async with httpx.AsyncClient() as client:
                stats = (await client.get(f"{root}/sim/stats")).json()
    assert first.text == again.text
    assert again.text.startswith(prompt_tag(content))
    assert stats == {
        "requests": 3,
        "answered": 1,
        "resent_after_success": 1,
        "faults": {"hang": 1},
    }


@pytest.mark.anyio
async def test_server_hang_sends_no_bytes_then_serves_a_new_connection() -> None:
    rates = {"hang": 0.5}
    content = find_prompt(rates, ["hang", None], prefix="raw-hang")
    model = SimModel(SimConfig(faults=rates, fault_seed=SEED))
    with anyio.fail_after(10):
        async with serving(model) as root:
            port = port_of(root)
            hung = await raw_exchange(port, raw_post(content, stream=False), wait=HANG_TIMEOUT)
            assert hung == b""
            answered = await raw_exchange(port, raw_post(content, stream=False))
    head, _, body = answered.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    payload = orjson.loads(body)
    assert payload["choices"][0]["message"]["content"].startswith(prompt_tag(content))
    assert model.stats()["faults"] == {"hang": 1}


@pytest.mark.anyio
async def test_server_status_and_body_faults_over_http() -> None:
    model = SimModel(
        SimConfig(faults={"429": 0.25, "503": 0.25, "empty": 0.25}, retry_after_ms=800)
    )
    seen: Counter[str] = Counter()
    with anyio.fail_after(10):
        async with serving(model) as root:
            backend = server_backend(root, stream=True)
            try:
                for i in range(40):
                    try:
                        await backend.complete(chat(f"mixed {i}"))
                        seen["ok"] += 1
                    except RateLimited as exc:
                        assert exc.retry_after == pytest.approx(0.8)
                        seen["429"] += 1
                    except Overloaded as exc:
                        assert exc.status == 503
                        seen["503"] += 1
                    except StreamCut:
                        seen["empty"] += 1
            finally:
                await backend.aclose()
            async with httpx.AsyncClient() as client:
                response = await client.get(f"{root}/sim/stats")
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    stats = response.json()
    assert stats["requests"] == 40
    assert stats["answered"] == seen["ok"]
    assert stats["faults"] == {k: v for k, v in seen.items() if k != "ok"}
    assert stats["resent_after_success"] == 0
    assert stats == model.stats()
    assert all(seen[k] > 0 for k in ("ok", "429", "503", "empty"))
