"""A streamed answer read from its events: the same answer however the reads group them."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchrun.backends.answers import StreamedAnswer
from batchrun.errors import StreamCut


def chunk(content: str | None = None, finish: str | None = None, **extra: object) -> bytes:
    delta = {} if content is None else {"content": content}
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return orjson.dumps({"id": "c1", "choices": [choice], **extra})


def answer(*reads: bytes) -> StreamedAnswer:
    streamed = StreamedAnswer("chat", 0.0, None)
    for read in reads:
        streamed.feed(read)
    streamed.close()
    return streamed


def events(*datas: bytes) -> bytes:
    return b"".join(b"data: " + data + b"\n\n" for data in datas)


WORDS = [" the", " [DONE]", ' "quoted"', " caf\u00e9", "\n", ""]


@given(st.lists(st.sampled_from(WORDS), min_size=1, max_size=12), st.data())
def test_the_same_answer_whatever_the_reads(words: list[str], data: st.DataObject) -> None:
    datas = [chunk(w) for w in words] + [chunk(finish="stop"), b"[DONE]"]
    body = events(*datas)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(body)), max_size=4)))
    reads = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
    whole, by_event, cut = answer(body), answer(*map(events, datas)), answer(*reads)
    for streamed in (whole, by_event, cut):
        done = streamed.completion()
        assert done.text == "".join(words) and done.finish_reason == "stop"
        assert streamed.done and streamed.events == len(datas)
    assert len(whole.times) == len(by_event.times) == sum(1 for w in words if w)


def test_events_after_done_in_the_same_read_do_not_count() -> None:
    streamed = answer(events(chunk("a", "stop"), b"[DONE]", chunk("late")))
    assert streamed.completion().text == "a" and streamed.events == 2


def test_a_piece_reading_done_is_text() -> None:
    assert answer(events(chunk("[DONE]"), chunk(finish="stop"))).completion().text == "[DONE]"


def test_done_with_spaces_in_a_read_of_many_events() -> None:
    streamed = answer(events(chunk("a", "stop"), b" [DONE] ", chunk("late")))
    assert streamed.done and streamed.completion().text == "a"


@pytest.mark.parametrize(
    "halves",
    [
        (b'{"choices":[{"delta":{"content":"a', b'"}}]}'),
        # joined by a comma they make exactly one object per event, a finish reason included
        (
            b'{"choices":[{"delta":{"content":"hi"}}]},{"choices":[{"delta":{"content":"',
            b'"},"finish_reason":"stop"}]}',
        ),
    ],
)
def test_events_that_are_json_only_when_joined_are_a_cut_stream(
    halves: tuple[bytes, bytes],
) -> None:
    with pytest.raises(StreamCut, match="unreadable stream chunk"):
        answer(events(*halves))


def test_json_that_is_not_an_object_is_passed_over() -> None:
    streamed = answer(events(b"[1,2]", chunk("a", "stop"), b"7", b"[DONE]"))
    assert streamed.completion().text == "a" and streamed.events == 4


def test_an_error_event_among_chunks_is_overloaded() -> None:
    from batchrun.errors import Overloaded

    body = events(chunk("a")) + b'event: error\ndata: {"message": "busy"}\n\n'
    with pytest.raises(Overloaded, match="busy"):
        answer(body)
