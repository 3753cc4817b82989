"""What a server sends that a client must not take at its word (a hostile review of the HTTP
path, issue 12), from a real server on 127.0.0.1 (see server.py). Each test failed before its
fix: a response sent on an idle connection was the next request's answer; a body that does
not decode escaped as httpx's exception; the asks again after a refused `stream_options` or
an empty stream each had a deadline of their own; `n` streamed answers were run together; a
stream typed `Text/Event-Stream` was read as JSON; a redirect was read as an answer.
"""

from __future__ import annotations

import anyio
import pytest

from batchrun.backends import OpenAICompatBackend
from batchrun.errors import FatalError, Overloaded, RequestTimeout, StreamCut
from tests.hostile.server import Behaviour, HostileServer
from tests.hostile.test_answers import DONE, answer, complete, sse
from tests.hostile.test_stale_connections import chat


@pytest.mark.anyio
@pytest.mark.parametrize("unasked", ["again", "408"])
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not streamed"])
async def test_a_response_sent_on_an_idle_connection_is_never_the_next_requests_answer(
    unasked: str, stream: bool
) -> None:
    # Before: p1 got p0's answer again ("again"), or failed as a 408 it was never sent.
    async with HostileServer(Behaviour(unasked=unasked)) as server:
        backend = OpenAICompatBackend(server.url, stream=stream, timeout=10, max_connections=4)
        try:
            for i in range(3):
                completion = await backend.complete(chat(f"p{i}"))
                assert completion.text == f"echo: p{i}"
                await anyio.sleep(0.2)  # the unasked response comes while the connection idles
        finally:
            await backend.aclose()
    assert server.counts.prompts == ["p0", "p1", "p2"]  # each sent once, none lost
    assert server.counts.connections == 3  # a connection that spoke unasked is not used again


GZIP = b"content-encoding: gzip\r\n"  # claimed; the bytes are not gzip


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not streamed"])
async def test_a_body_that_does_not_decode_as_its_encoding_says_is_a_cut_answer(
    stream: bool,
) -> None:
    # Before: httpx.DecodingError escaped complete(), and `batchrun submit` died with it.
    with pytest.raises(StreamCut, match="does not decode as its content-encoding says"):
        await answer(Behaviour(head=GZIP), stream=stream)


@pytest.mark.anyio
async def test_an_error_whose_body_does_not_decode_is_still_its_status() -> None:
    with pytest.raises(Overloaded, match="HTTP 503: no message"):
        await answer(Behaviour(head=GZIP, body=b"{}", status=503))


@pytest.mark.anyio
async def test_a_model_list_that_does_not_decode_is_no_model_list() -> None:
    async with HostileServer(Behaviour(head=GZIP, body=b'{"data": []}')) as server:
        backend = OpenAICompatBackend(server.url, timeout=10)
        try:
            with pytest.raises(StreamCut, match="did not return a model list"):
                await backend.list_models()
        finally:
            await backend.aclose()


@pytest.mark.anyio
async def test_an_empty_stream_and_its_plain_ask_again_share_one_deadline() -> None:
    # Each answer comes after 0.6 of the deadline: an empty stream, then (asked again, not
    # streamed) an empty body. Before: the second ask had a deadline of its own and its
    # empty body failed as not JSON at 1.2x the deadline.
    with pytest.raises(RequestTimeout, match="within 1s"):
        await answer(Behaviour(body=b"", delay=0.6), timeout=1)


@pytest.mark.anyio
async def test_a_refused_stream_options_and_its_ask_again_share_one_deadline() -> None:
    refusal = b'{"error": {"message": "stream_options is not supported"}}'
    with pytest.raises(RequestTimeout, match="within 1s"):  # before: the second 400, at 1.2 s
        await answer(Behaviour(body=refusal, status=400, delay=0.6), timeout=1)


def choice(index: int, text: str | None = None, finish: str | None = None) -> dict[str, object]:
    delta = {} if text is None else {"content": text}
    return {"choices": [{"index": index, "delta": delta, "finish_reason": finish}]}


@pytest.mark.anyio
async def test_of_n_streamed_answers_the_first_is_kept_as_when_not_streamed() -> None:
    # Before: "A1B1A2B2", the answers run together.
    body = sse(choice(0, "A1"), choice(1, "B1"), choice(0, "A2"), choice(1, "B2"))
    body += sse(choice(0, None, "stop"), choice(1, None, "length"), DONE)
    completion = await complete(Behaviour(body=body))
    assert (completion.text, completion.finish_reason) == ("A1A2", "stop")


@pytest.mark.anyio
async def test_the_first_of_n_answers_is_whole_only_with_its_own_finish_reason() -> None:
    # Before: the second answer's finish reason made the first, cut short, a whole answer.
    body = sse(choice(0, "A1"), choice(1, "B1"), choice(1, None, "stop"), DONE)
    with pytest.raises(StreamCut, match="finish_reason"):
        await answer(Behaviour(body=body))


@pytest.mark.anyio
async def test_an_event_stream_is_read_whatever_the_case_of_its_media_type() -> None:
    text = await answer(Behaviour(stream_type=b"Text/Event-Stream; charset=UTF-8"))
    assert text == "echo: hi"  # before: "response is not JSON"


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not streamed"])
async def test_a_redirect_stops_the_job_naming_where_it_points(stream: bool) -> None:
    # Before: an empty 301 was an answer that is not JSON, retried on every attempt.
    moved = Behaviour(body=b"", status=301, head=b"location: https://api.example/v1/chat\r\n")
    with pytest.raises(FatalError, match=r"redirects to https://api\.example/v1/chat"):
        await answer(moved, stream=stream)
