"""Answers that are not whole, or not text (issue 13 items 1, 2 and 4), from a real server on
127.0.0.1 that sends exactly the bytes a test wrote (see server.py).

An answer is whole only with a finish reason (an error event anywhere fails the attempt with the
server's words: tests/unit/test_backend.py); after `[DONE]` nothing more is waited for; bytes
that are not UTF-8 fail the attempt the same way streamed or not, saying where.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from batchrun.backends import Completion, OpenAICompatBackend, openai_compat
from batchrun.errors import RequestError, StreamCut
from tests.hostile.server import Behaviour, HostileServer
from tests.hostile.test_stale_connections import chat


def sse(*events: dict[str, Any] | bytes) -> bytes:
    """A stream's body: dicts as JSON `data:` events, bytes as written."""
    return b"".join(
        e if isinstance(e, bytes) else b"data: " + orjson.dumps(e) + b"\n\n" for e in events
    )


def delta(text: str, finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}


DONE = b"data: [DONE]\n\n"


async def complete(behaviour: Behaviour, *, stream: bool = True, timeout: float = 5) -> Completion:
    async with HostileServer(behaviour) as server:
        backend = OpenAICompatBackend(server.url, stream=stream, timeout=timeout)
        try:
            return await backend.complete(chat("hi"))
        finally:
            await backend.aclose()


async def answer(behaviour: Behaviour, *, stream: bool = True, timeout: float = 5) -> str:
    return (await complete(behaviour, stream=stream, timeout=timeout)).text


@pytest.mark.anyio
async def test_part_of_an_answer_then_done_without_a_finish_reason_is_not_whole() -> None:
    with pytest.raises(StreamCut, match="finish_reason"):
        await answer(Behaviour(body=sse(delta("The cat sat"), DONE)))


@pytest.mark.anyio
@pytest.mark.parametrize("after", ["hold", "drop"])
async def test_a_whole_answer_then_a_connection_held_open_or_dropped_is_recorded(
    after: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: "no complete answer within 5s" on every attempt (held), or a cut stream (dropped).
    monkeypatch.setattr(openai_compat, "DONE_GRACE_S", 3.0)
    body = sse(delta("The cat "), delta("sat.", "stop"), DONE)
    completion = await complete(Behaviour(body=body, after=after), timeout=20)
    assert completion.text == "The cat sat."
    assert completion.latency_s < openai_compat.DONE_GRACE_S  # the wait is not the answer's


@pytest.mark.anyio
async def test_the_wait_after_done_never_outlasts_the_requests_deadline() -> None:
    body = sse(delta("The cat "), delta("sat.", "stop"), DONE)
    completion = await complete(Behaviour(body=body, after="hold"), timeout=0.8)
    assert completion.text == "The cat sat."


@pytest.mark.anyio
async def test_a_finish_reason_then_a_held_connection_without_done_still_times_out() -> None:
    # Only [DONE] says nothing more comes (usage may follow the finish reason).
    body = sse(delta("The cat "), delta("sat.", "stop"))
    with pytest.raises(RequestError, match="within 2s"):
        await answer(Behaviour(body=body, after="hold"), timeout=2)


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not streamed"])
async def test_invalid_utf8_fails_alike_streamed_or_not_and_says_where(stream: bool) -> None:
    text = b'"The \xff cat"'
    if stream:
        body = b'data: {"choices": [{"index": 0, "delta": {"content": ' + text + b"}}]}\n\n"
        body += sse(delta("", "stop"), DONE)
        at = body.index(b"\xff") - len(b"data: ")
    else:
        body = b'{"choices": [{"index": 0, "message": {"content": ' + text + b"}, "
        body += b'"finish_reason": "stop"}]}'
        at = body.index(b"\xff")
    with pytest.raises(StreamCut, match=f"invalid UTF-8 at byte {at}"):
        await answer(Behaviour(body=body), stream=stream)
