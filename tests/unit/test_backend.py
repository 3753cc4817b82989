"""OpenAICompatBackend against the simulator's transport and against httpx.MockTransport."""

from __future__ import annotations

import email.utils
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import httpx
import orjson
import pytest

from batchrun.backends import Completion, CompletionRequest, OpenAICompatBackend
from batchrun.backends.errors_http import error_for_status, hide_secret, retry_after, server_message
from batchrun.errors import (
    AuthFailed,
    BadRequest,
    ConnectionFailed,
    FatalError,
    NotFound,
    Overloaded,
    PermanentError,
    RateLimited,
    RequestTimeout,
    StreamCut,
    TransientError,
)
from batchrun.sim import SimConfig, SimModel, SimTransport

BASE = "http://llm.test/v1"
KEY = "sk-test-SECRET-0123456789"
Handler = Callable[[httpx.Request], httpx.Response]


def chat(content: str = "Say something", **extra: Any) -> CompletionRequest:
    return CompletionRequest(
        "chat", {"model": "sim-1", "messages": [{"role": "user", "content": content}], **extra}
    )


def completion(prompt: str = "Once upon a time", **extra: Any) -> CompletionRequest:
    return CompletionRequest("completions", {"model": "sim-1", "prompt": prompt, **extra})


def expected(request: CompletionRequest) -> dict[str, Any]:
    """What SimModel answers to this request when not streamed."""
    reply = SimModel(SimConfig()).complete(request.endpoint, dict(request.body))
    data: dict[str, Any] = orjson.loads(reply.body)
    return data


def expected_text(request: CompletionRequest) -> str:
    choice = expected(request)["choices"][0]
    text = choice["message"]["content"] if request.endpoint == "chat" else choice["text"]
    assert isinstance(text, str)
    return text


def sim_backend(**kwargs: Any) -> OpenAICompatBackend:
    return OpenAICompatBackend(BASE, transport=SimTransport(SimModel(SimConfig())), **kwargs)


def mock_backend(handler: Handler, **kwargs: Any) -> OpenAICompatBackend:
    return OpenAICompatBackend(BASE, transport=httpx.MockTransport(handler), **kwargs)


def error_json(status: int, message: str, **headers: str) -> Handler:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, headers=headers, json={"error": {"message": message}})

    return handler


def sse(*chunks: Any, done: bool = True) -> httpx.Response:
    lines = [b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks]
    if done:
        lines.append(b"data: [DONE]\n\n")
    return httpx.Response(
        200, headers={"content-type": "text/event-stream"}, content=b"".join(lines)
    )


def delta(content: str | None, finish: str | None = None) -> dict[str, Any]:
    d: dict[str, Any] = {} if content is None else {"content": content}
    return {"choices": [{"index": 0, "delta": d, "finish_reason": finish}]}


def sim_handler(model: SimModel, seen: list[dict[str, Any]]) -> Handler:
    """A MockTransport handler that answers like the simulator and records request bodies."""

    def handler(request: httpx.Request) -> httpx.Response:
        if request.content:
            seen.append(orjson.loads(request.content))
        headers = {k.lower(): v for k, v in request.headers.items()}
        reply = model.handle(request.method, request.url.path, headers, request.content)
        content = reply.body if reply.events is None else b"".join(e for _, e in reply.events)
        return httpx.Response(reply.status, headers=reply.headers, content=content)

    return handler


async def answers(backend: OpenAICompatBackend, request: CompletionRequest) -> Completion:
    try:
        return await backend.complete(request)
    finally:
        await backend.aclose()


async def fails_with(backend: OpenAICompatBackend, request: CompletionRequest) -> Exception:
    try:
        result = await backend.complete(request)
    except Exception as exc:
        return exc
    finally:
        await backend.aclose()
    raise AssertionError(f"expected an error, got {result!r}")


# --- against the simulator ------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("make", [chat, completion], ids=["chat", "completions"])
async def test_sim_roundtrip(stream: bool, make: Callable[..., CompletionRequest]) -> None:
    request = make()
    backend = sim_backend(stream=stream)
    try:
        result = await backend.complete(request)
    finally:
        await backend.aclose()
    assert isinstance(result, Completion)
    want = expected(request)
    assert result.text == expected_text(request)
    assert result.text.startswith("[sim:")
    assert result.finish_reason == "stop"
    assert result.prompt_tokens == want["usage"]["prompt_tokens"]
    assert result.completion_tokens == want["usage"]["completion_tokens"]
    assert result.latency_s >= 0
    if stream:
        assert result.ttft_s is not None
        assert 0 <= result.ttft_s <= result.latency_s
    else:
        assert result.ttft_s is None


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("make", [chat, completion], ids=["chat", "completions"])
async def test_sim_small_max_tokens_is_length(
    stream: bool, make: Callable[..., CompletionRequest]
) -> None:
    request = make(max_tokens=3)
    backend = sim_backend(stream=stream)
    try:
        result = await backend.complete(request)
    finally:
        await backend.aclose()
    assert result.finish_reason == "length"
    assert result.completion_tokens == 3
    assert len(result.text.split()) == 3
    assert result.text == expected_text(request)


class Heard:
    """A backends.base.Watch that writes down what it was told, in order."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def accepted(self) -> None:
        self.events.append("accepted")

    def first_token(self, ttft: float) -> None:
        assert ttft >= 0
        self.events.append("first token")


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [True, False])
async def test_the_watch_hears_acceptance_then_the_first_token(stream: bool) -> None:
    heard = Heard()
    backend = sim_backend(stream=stream)
    await backend.complete(chat(), watch=heard)
    refused = Heard()
    gate = mock_backend(error_json(429, "busy"))
    with pytest.raises(RateLimited):
        await gate.complete(chat(), watch=refused)
    await backend.aclose()
    await gate.aclose()
    assert heard.events == (["accepted", "first token"] if stream else ["accepted"])
    assert refused.events == []  # a refusal is not an acceptance


@pytest.mark.anyio
async def test_sim_list_models() -> None:
    model = SimModel(SimConfig(models=("m-one", "m-two")))
    backend = OpenAICompatBackend(BASE, transport=SimTransport(model))
    try:
        assert await backend.list_models() == ["m-one", "m-two"]
    finally:
        await backend.aclose()


@pytest.mark.anyio
async def test_sim_api_key_checked() -> None:
    model = SimModel(SimConfig(api_key=KEY))
    good = OpenAICompatBackend(BASE, api_key=KEY, transport=SimTransport(model))
    try:
        assert (await good.complete(chat())).text == expected_text(chat())
    finally:
        await good.aclose()
    bad = OpenAICompatBackend(BASE, api_key="sk-wrong", transport=SimTransport(model))
    exc = await fails_with(bad, chat())
    assert isinstance(exc, AuthFailed)


@pytest.mark.anyio
async def test_sim_strict_unknown_model_is_not_found() -> None:
    model = SimModel(SimConfig(models=("sim-1",), strict_models=True))
    backend = OpenAICompatBackend(BASE, transport=SimTransport(model))
    request = CompletionRequest("chat", {"model": "nope", "messages": []})
    exc = await fails_with(backend, request)
    assert isinstance(exc, NotFound)
    assert "nope" in str(exc)


@pytest.mark.anyio
async def test_request_bodies_streamed_and_not() -> None:
    seen: list[dict[str, Any]] = []
    streamed = mock_backend(sim_handler(SimModel(), seen))
    plain = mock_backend(sim_handler(SimModel(), seen), stream=False)
    no_opts = mock_backend(sim_handler(SimModel(), seen), stream_options=False)
    try:
        await streamed.complete(chat(max_tokens=5))
        await plain.complete(chat(max_tokens=5))
        result = await no_opts.complete(chat(max_tokens=5))
    finally:
        for b in (streamed, plain, no_opts):
            await b.aclose()
    original = dict(chat(max_tokens=5).body)
    assert seen[0] == {**original, "stream": True, "stream_options": {"include_usage": True}}
    assert seen[1] == original
    assert seen[2] == {**original, "stream": True}
    # without include_usage the simulator sends no usage chunk, so no token counts
    assert result.prompt_tokens is None and result.completion_tokens is None
    assert result.text == expected_text(chat(max_tokens=5))


@pytest.mark.anyio
async def test_server_ignoring_stream_flag_still_works() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            200,
            json={
                "choices": [{"message": {"content": "plain"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 4, "completion_tokens": 1},
            },
        )

    result = await answers(mock_backend(handler), chat())
    assert result.text == "plain"
    assert result.ttft_s is None
    assert (result.prompt_tokens, result.completion_tokens) == (4, 1)


# --- HTTP errors ----------------------------------------------------------------------------


@pytest.mark.anyio
async def test_400_is_bad_request_with_server_message() -> None:
    message = "This model's maximum context length is 4096 tokens."
    exc = await fails_with(mock_backend(error_json(400, message)), chat())
    assert isinstance(exc, BadRequest)
    assert isinstance(exc, PermanentError)
    assert exc.status == 400
    assert message in str(exc)


@pytest.mark.anyio
@pytest.mark.parametrize("status", [401, 403])
async def test_auth_failed(status: int) -> None:
    exc = await fails_with(mock_backend(error_json(status, "Incorrect API key")), chat())
    assert isinstance(exc, AuthFailed)
    assert isinstance(exc, FatalError)
    assert exc.status == status
    assert "Incorrect API key" in str(exc)


@pytest.mark.anyio
async def test_402_out_of_credit_stops_the_job() -> None:
    # OpenRouter's answer to an account with no credit left: every other line would meet it
    # too, so it stops the job (exit 3) rather than failing the lines one by one.
    exc = await fails_with(mock_backend(error_json(402, "Insufficient credits")), chat())
    assert isinstance(exc, FatalError)
    assert exc.status == 402
    assert "Insufficient credits" in str(exc) and "out of credit" in str(exc)


@pytest.mark.anyio
async def test_404_is_not_found() -> None:
    exc = await fails_with(mock_backend(error_json(404, "model does not exist")), chat())
    assert isinstance(exc, NotFound)
    assert isinstance(exc, FatalError)
    assert exc.status == 404
    assert "model does not exist" in str(exc)
    assert f"{BASE}/chat/completions" in str(exc)


@pytest.mark.anyio
async def test_list_models_errors_are_mapped() -> None:
    backend = mock_backend(error_json(401, "no key"))
    try:
        with pytest.raises(AuthFailed):
            await backend.list_models()
    finally:
        await backend.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("headers", "wanted"),
    [
        ({"retry-after": "3"}, 3.0),
        ({"retry-after-ms": "1500"}, 1.5),
        ({"retry-after-ms": "1500", "retry-after": "9"}, 1.5),
        ({}, None),
    ],
)
async def test_429_is_rate_limited(headers: dict[str, str], wanted: float | None) -> None:
    exc = await fails_with(mock_backend(error_json(429, "slow down", **headers)), chat())
    assert isinstance(exc, RateLimited)
    assert isinstance(exc, TransientError)
    assert exc.status == 429
    assert exc.retry_after == wanted


@pytest.mark.anyio
async def test_429_with_http_date() -> None:
    when = datetime.now(UTC) + timedelta(seconds=60)
    date = email.utils.format_datetime(when, usegmt=True)
    exc = await fails_with(mock_backend(error_json(429, "slow", **{"retry-after": date})), chat())
    assert isinstance(exc, RateLimited)
    assert exc.retry_after is not None
    assert 55.0 <= exc.retry_after <= 61.0


@pytest.mark.anyio
@pytest.mark.parametrize("status", [500, 502, 503, 504, 408, 409])
async def test_transient_statuses_are_overloaded(status: int) -> None:
    exc = await fails_with(mock_backend(error_json(status, "try later")), chat())
    assert isinstance(exc, Overloaded)
    assert isinstance(exc, TransientError)
    assert exc.status == status
    assert exc.retry_after is None


@pytest.mark.anyio
async def test_503_retry_after_is_kept() -> None:
    exc = await fails_with(mock_backend(error_json(503, "busy", **{"retry-after": "2"})), chat())
    assert isinstance(exc, Overloaded)
    assert exc.retry_after == 2.0


@pytest.mark.anyio
async def test_stream_options_refused_falls_back_once_and_remembers() -> None:
    seen: list[dict[str, Any]] = []
    sim = sim_handler(SimModel(), seen)

    def handler(request: httpx.Request) -> httpx.Response:
        body = orjson.loads(request.content)
        if "stream_options" in body:
            seen.append(body)
            return httpx.Response(
                400,
                json={"error": {"message": "Unrecognized request argument: stream_options"}},
            )
        return sim(request)

    backend = mock_backend(handler)
    try:
        first = await backend.complete(chat("one"))
        second = await backend.complete(chat("two"))
    finally:
        await backend.aclose()
    assert first.text == expected_text(chat("one"))
    assert second.text == expected_text(chat("two"))
    assert len(seen) == 3
    assert "stream_options" in seen[0]
    assert all("stream_options" not in body and body["stream"] is True for body in seen[1:])
    assert backend.stream_options is False


@pytest.mark.anyio
async def test_other_400_is_not_retried_without_stream_options() -> None:
    seen: list[bytes] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.content)
        return httpx.Response(400, json={"error": {"message": "prompt too long"}})

    exc = await fails_with(mock_backend(handler), chat())
    assert isinstance(exc, BadRequest)
    assert len(seen) == 1


# --- broken answers -------------------------------------------------------------------------


@pytest.mark.anyio
async def test_stream_without_done_or_finish_is_cut() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return sse(delta("Hello"), delta(" wor"), done=False)

    exc = await fails_with(mock_backend(handler), chat())
    assert isinstance(exc, StreamCut)


@pytest.mark.anyio
async def test_stream_with_finish_but_no_done_is_accepted() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return sse(delta("Hello"), delta(" world"), delta(None, "stop"), done=False)

    result = await answers(mock_backend(handler), chat())
    assert result.text == "Hello world"
    assert result.finish_reason == "stop"


@pytest.mark.anyio
async def test_empty_choices_is_stream_cut() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"choices": [], "usage": {"prompt_tokens": 1}})

    exc = await fails_with(mock_backend(handler, stream=False), chat())
    assert isinstance(exc, StreamCut)


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [True, False])
async def test_non_json_200_is_stream_cut(stream: bool) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/html"}, content=b"<html>oops")

    exc = await fails_with(mock_backend(handler, stream=stream), chat())
    assert isinstance(exc, StreamCut)


def raw_sse(body: bytes) -> Handler:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body)

    return handler


@pytest.mark.anyio
async def test_an_event_split_over_data_lines_with_crlf_is_read_whole() -> None:
    body = (
        b': keep-alive\r\n\r\ndata: {"choices": [{"index": 0,\r\n'
        b'data: "delta": {"content": "Hi"}, "finish_reason": "stop"}]}\r\n\r\n'
        b"data: [DONE]\r\n\r\n"
    )
    result = await answers(mock_backend(raw_sse(body)), chat())
    assert (result.text, result.finish_reason) == ("Hi", "stop")


@pytest.mark.anyio
async def test_an_sse_error_event_is_a_failed_attempt_with_the_servers_message() -> None:
    body = (
        b'data: {"choices": [{"index": 0, "delta": {"content": "Hel"}}]}\n\n'
        b'event: error\ndata: {"message": "KV cache full"}\n\n'
        b"data: [DONE]\n\n"
    )
    exc = await fails_with(mock_backend(raw_sse(body)), chat())
    assert isinstance(exc, Overloaded) and "KV cache full" in str(exc)


@pytest.mark.anyio
async def test_done_with_spaces_ends_the_stream_and_each_piece_has_its_time() -> None:
    body = (
        b'data: {"choices": [{"index": 0, "delta": {"content": "a"}}]}\n\n'
        b'data: {"choices": [{"index": 0, "delta": {"content": "b"}}]}\n\n'
        b'data: {"choices": [{"index": 0, "delta": {"content": "c"}, "finish_reason": "stop"}]}'
        b"\n\ndata:  [DONE] \n\n"
    )
    result = await answers(mock_backend(raw_sse(body)), chat())
    assert (result.text, result.finish_reason) == ("abc", "stop")
    # three pieces in one read: three times (bench counts tokens by them without usage)
    assert len(result.chunk_times) == 3


@pytest.mark.anyio
async def test_payloads_that_parse_only_when_joined_are_unreadable() -> None:
    body = b'data: "a\n\ndata: b"\n\ndata: {"choices": [{"index": 0, "finish_reason": "stop"}]}\n\n'
    exc = await fails_with(mock_backend(raw_sse(body)), chat())
    assert isinstance(exc, StreamCut) and "unreadable stream chunk" in str(exc)


@pytest.mark.anyio
async def test_mid_stream_error_chunk_is_overloaded() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return sse(delta("Hel"), {"error": {"message": "engine died"}})

    exc = await fails_with(mock_backend(handler), chat())
    assert isinstance(exc, Overloaded)
    assert "engine died" in str(exc)


class _DroppingStream(httpx.AsyncByteStream):
    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield b"data: " + orjson.dumps(delta("Hel")) + b"\n\n"
        raise httpx.ReadError("connection reset by peer")


@pytest.mark.anyio
async def test_connection_dropped_mid_stream_is_stream_cut() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            200, headers={"content-type": "text/event-stream"}, stream=_DroppingStream()
        )

    exc = await fails_with(mock_backend(handler), chat())
    assert isinstance(exc, StreamCut)


@pytest.mark.anyio
async def test_connect_error_is_connection_failed() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused")

    exc = await fails_with(mock_backend(handler), chat())
    assert isinstance(exc, ConnectionFailed)
    assert "connection refused" in str(exc)
    backend = mock_backend(handler)
    try:
        with pytest.raises(ConnectionFailed):
            await backend.list_models()
    finally:
        await backend.aclose()


@pytest.mark.anyio
async def test_read_timeout_is_request_timeout() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out")

    exc = await fails_with(mock_backend(handler), chat())
    assert isinstance(exc, RequestTimeout)
    assert isinstance(exc, TransientError)


@pytest.mark.anyio
async def test_a_connect_timeout_says_no_connection_and_its_own_limit() -> None:
    # The connection gets 10 s of --timeout; the error said "no complete answer within 120s".
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectTimeout("timed out")

    exc = await fails_with(mock_backend(handler, timeout=120), chat())
    assert isinstance(exc, RequestTimeout)
    assert str(exc) == f"no connection within 10s ({BASE}/chat/completions)"
    backend = mock_backend(handler, timeout=4)
    try:
        with pytest.raises(RequestTimeout, match=r"^no connection within 4s \("):
            await backend.list_models()
    finally:
        await backend.aclose()


@pytest.mark.anyio
async def test_a_transports_own_timeout_error_is_request_timeout() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise TimeoutError

    exc = await fails_with(mock_backend(handler), chat())
    assert isinstance(exc, RequestTimeout)


@pytest.mark.anyio
async def test_the_deadline_covers_the_whole_answer() -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        async def slow() -> AsyncIterator[bytes]:
            yield b'data: {"choices": [{"index": 0, "delta": {"content": "a"}}]}\n\n'
            await anyio.sleep(10)

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=slow())

    with anyio.fail_after(5):
        exc = await fails_with(mock_backend(handler, timeout=0.2), chat())
    assert isinstance(exc, RequestTimeout) and "0.2s" in str(exc)


# --- the API key ----------------------------------------------------------------------------


@pytest.mark.anyio
async def test_authorization_header_carries_key() -> None:
    auth: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        auth.append(request.headers.get("authorization"))
        return sse(delta("ok", "stop"))

    with_key = mock_backend(handler, api_key=KEY)
    without = mock_backend(handler)
    try:
        await with_key.complete(chat())
        await without.complete(chat())
    finally:
        await with_key.aclose()
        await without.aclose()
    assert auth == [f"Bearer {KEY}", None]


def _echo_status(status: int) -> Handler:
    def handler(request: httpx.Request) -> httpx.Response:
        sent = request.headers["authorization"]
        return httpx.Response(status, json={"error": {"message": f"bad credentials: {sent}"}})

    return handler


def _echo_connect(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError(f"refused while sending {request.headers['authorization']}")


def _echo_mid_stream(request: httpx.Request) -> httpx.Response:
    return sse(delta("Hel"), {"error": {"message": f"bad key {KEY}"}})


def _echo_non_json(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, headers={"content-type": "text/plain"}, content=f"key={KEY}")


def _echo_bad_chunk(request: httpx.Request) -> httpx.Response:
    return httpx.Response(
        200, headers={"content-type": "text/event-stream"}, content=f"data: key={KEY}\n\n"
    )


@pytest.mark.anyio
@pytest.mark.parametrize(
    "handler",
    [
        _echo_status(400),
        _echo_status(401),
        _echo_status(404),
        _echo_status(429),
        _echo_status(500),
        _echo_connect,
        _echo_mid_stream,
        _echo_non_json,
        _echo_bad_chunk,
    ],
    ids=[
        "400",
        "401",
        "404",
        "429",
        "500",
        "connect-error",
        "mid-stream-error",
        "non-json-200",
        "unreadable-chunk",
    ],
)
async def test_echoed_key_does_not_leak(handler: Handler) -> None:
    exc = await fails_with(mock_backend(handler, api_key=KEY), chat())
    assert isinstance(exc, Exception)
    assert KEY not in str(exc)
    assert all(KEY not in str(arg) for arg in exc.args)
    assert KEY not in repr(exc)


@pytest.mark.anyio
async def test_a_password_in_the_url_never_reaches_an_error() -> None:
    def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    url = "http://bob:hunter2secret@127.0.0.1:9/v1"
    for handler in (refused, error_json(404, "no route")):  # messages that name the URL
        backend = OpenAICompatBackend(url, transport=httpx.MockTransport(handler))
        exc = await fails_with(backend, chat())
        assert "127.0.0.1:9" in str(exc) and "hunter2secret" not in str(exc)


@pytest.mark.anyio
async def test_echoed_key_in_list_models_does_not_leak() -> None:
    backend = mock_backend(_echo_status(401), api_key=KEY)
    try:
        with pytest.raises(AuthFailed) as info:
            await backend.list_models()
    finally:
        await backend.aclose()
    assert KEY not in str(info.value)


# --- errors_http helpers --------------------------------------------------------------------


def test_retry_after_seconds_and_ms() -> None:
    assert retry_after({"retry-after": "3"}) == 3.0
    assert retry_after({"retry-after": "2.5"}) == 2.5
    assert retry_after({"retry-after-ms": "1500"}) == 1.5
    assert retry_after({"retry-after-ms": "250", "retry-after": "10"}) == 0.25
    assert retry_after({"retry-after-ms": "soon", "retry-after": "10"}) == 10.0
    assert retry_after({"retry-after": "-5"}) == 0.0
    assert retry_after({"retry-after-ms": "-5"}) == 0.0
    assert retry_after({}) is None
    assert retry_after({"retry-after": ""}) is None
    assert retry_after({"retry-after": "whenever"}) is None


def test_retry_after_http_date() -> None:
    when = datetime(2015, 10, 21, 7, 28, 0, tzinfo=UTC)
    header = {"retry-after": email.utils.format_datetime(when, usegmt=True)}
    assert header["retry-after"] == "Wed, 21 Oct 2015 07:28:00 GMT"
    assert retry_after(header, now=when.timestamp() - 30) == pytest.approx(30.0)
    assert retry_after(header, now=when.timestamp() + 30) == 0.0


def test_retry_after_reads_httpx_headers_case_insensitively() -> None:
    headers = httpx.Headers({"Retry-After": "4", "X-Other": "1"})
    assert retry_after(headers) == 4.0
    assert retry_after(httpx.Headers({"Retry-After-Ms": "700"})) == 0.7


@pytest.mark.parametrize(
    ("body", "wanted"),
    [
        (b'{"error": {"message": "context too long", "type": "x"}}', "context too long"),
        (b'{"error": {"detail": "from detail"}}', "from detail"),
        (b'{"error": {"msg": "from msg"}}', "from msg"),
        (b'{"error": "plain string error"}', "plain string error"),
        (b'{"detail": "fastapi style"}', "fastapi style"),
        (b'{"message": "top-level message"}', "top-level message"),
        (b"  upstream connect error  \n", "upstream connect error"),
        (b"", ""),
        (b"[1, 2]", "[1, 2]"),
        (b'{"error": {"code": 500}}', '{"error": {"code": 500}}'),
    ],
)
def test_server_message_shapes(body: bytes, wanted: str) -> None:
    assert server_message(body) == wanted


def test_server_message_is_truncated() -> None:
    long = "x" * 2000
    assert server_message(orjson.dumps({"error": {"message": long}})) == "x" * 500
    assert server_message(orjson.dumps({"error": long})) == "x" * 500
    assert server_message(long.encode()) == "x" * 500


def test_error_for_status_without_message() -> None:
    exc = error_for_status(502, {}, b"", "http://x/v1/chat/completions")
    assert isinstance(exc, Overloaded)
    assert "HTTP 502" in str(exc)
    assert "no message" in str(exc)
    assert isinstance(error_for_status(422, {}, b"{}", "u"), BadRequest)
    assert isinstance(error_for_status(413, {}, b"{}", "u"), BadRequest)


@pytest.mark.anyio
@pytest.mark.parametrize(
    "payload",
    [{"choices": {"0": {"message": {"content": "x"}}}}, {"choices": ["x"]}, {"choices": []}],
    ids=["dict", "string-choice", "empty"],
)
async def test_malformed_choices_are_a_retryable_stream_cut(payload: dict[str, Any]) -> None:
    def handler(_request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=payload)

    backend = OpenAICompatBackend(
        "http://x/v1", stream=False, transport=httpx.MockTransport(handler)
    )
    with pytest.raises(StreamCut):
        await backend.complete(CompletionRequest("chat", {"messages": []}))
    await backend.aclose()


@pytest.mark.anyio
async def test_a_key_cut_off_by_the_message_limit_is_still_scrubbed() -> None:
    key = "sk-" + "k" * 40
    message = "x" * 490 + key  # server_message keeps 500 characters: the key is cut mid-way

    def handler(_request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": {"message": message}})

    backend = OpenAICompatBackend(
        "http://x/v1", api_key=key, stream=False, transport=httpx.MockTransport(handler)
    )
    with pytest.raises(BadRequest) as caught:
        await backend.complete(CompletionRequest("chat", {"messages": []}))
    await backend.aclose()
    assert key[:8] not in str(caught.value)


@pytest.mark.anyio
async def test_the_first_characters_of_the_key_echoed_mid_message_are_scrubbed() -> None:
    key = "sk-proj-Abc123Def456Ghi789Jkl012"

    def handler(request: httpx.Request) -> httpx.Response:
        echoed = request.headers["authorization"].removeprefix("Bearer ")[:20]
        return httpx.Response(401, json={"error": {"message": f"bad key {echoed}... (revoked)"}})

    backend = OpenAICompatBackend(
        "http://x/v1", api_key=key, stream=False, transport=httpx.MockTransport(handler)
    )
    with pytest.raises(AuthFailed) as caught:
        await backend.complete(CompletionRequest("chat", {"messages": []}))
    await backend.aclose()
    assert "bad key ***... (revoked)" in str(caught.value)


@pytest.mark.parametrize(
    ("text", "hidden"),
    [
        ("key sk-ABCDEFGHIJKL!", "key ***!"),  # whole
        ("starts ABCDEFGH, ends", "starts ***, ends"),  # 8 characters from the middle
        ("short ABCDEFG stays", "short ABCDEFG stays"),  # 7: too short to say anything
        ("two sk-ABCDEFGH and GHIJKL", "two *** and GHIJKL"),
        ("sk-ABCDEFGHIJKLsk-ABCDEFGHIJKL", "***"),  # runs that touch are one
        ("nothing here", "nothing here"),
    ],
)
def test_hide_secret_hides_every_run_of_eight_or_more_of_its_characters(
    text: str, hidden: str
) -> None:
    assert hide_secret(text, "sk-ABCDEFGHIJKL") == hidden


@pytest.mark.anyio
async def test_an_empty_event_stream_is_asked_again_unstreamed_to_learn_why() -> None:
    """llama-cpp-python answers a prompt over its context with an empty 200 stream; the plain
    request that follows gets the 400 with the server's reason."""
    bodies: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = orjson.loads(request.content)
        bodies.append(body)
        if body.get("stream"):
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=b"")
        return httpx.Response(400, json={"error": {"message": "maximum context length is 512"}})

    error = await fails_with(mock_backend(handler), chat("word " * 900))
    assert isinstance(error, BadRequest) and "maximum context length is 512" in str(error)
    assert [b.get("stream", False) for b in bodies] == [True, False]


@pytest.mark.anyio
async def test_a_stream_with_events_but_no_choices_is_a_cut_stream_not_asked_again() -> None:
    calls: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        return sse({"choices": []})

    error = await fails_with(mock_backend(handler), chat())
    assert isinstance(error, StreamCut) and "no choices" in str(error) and len(calls) == 1
