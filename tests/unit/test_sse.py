"""The SSE decoder: the standard's framing, whatever way the bytes are split."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchrun.backends.sse import Event, SSEDecoder


def decode(*chunks: bytes) -> list[Event]:
    decoder = SSEDecoder()
    events = [event for chunk in chunks for event in decoder.feed(chunk)]
    return events + decoder.close()


def test_one_data_line_per_event() -> None:
    assert decode(b'data: {"a":1}\n\ndata: [DONE]\n\n') == [
        ("message", b'{"a":1}'),
        ("message", b"[DONE]"),
    ]


def test_data_lines_of_one_event_are_joined_with_newlines() -> None:
    body = b'data: {"choices":\ndata: [1,\ndata:2]}\n\n'
    assert decode(body) == [("message", b'{"choices":\n[1,\n2]}')]


def test_crlf_and_cr_line_ends_even_split_between_reads() -> None:
    assert decode(b"data: a\r\n\r\ndata: b\r", b"\r", b"data: c\r", b"\n\r\n") == [
        ("message", b"a"),
        ("message", b"b"),
        ("message", b"c"),
    ]


def test_comments_ids_and_retry_are_not_events() -> None:
    body = b": keep-alive\n\nid: 7\nretry: 1000\n\n: ping\ndata: x\nid: 8\n\n"
    assert decode(body) == [("message", b"x")]


def test_event_names_and_the_space_after_the_colon() -> None:
    body = b'event: error\ndata: {"message": "overloaded"}\n\ndata:no-space\n\n'
    assert decode(body) == [("error", b'{"message": "overloaded"}'), ("message", b"no-space")]


def test_a_byte_order_mark_at_the_start_is_dropped_even_split_between_reads() -> None:
    assert decode(b"\xef\xbb\xbfdata: x\n\n") == [("message", b"x")]
    assert decode(b"\xef", b"\xbb", b"\xbfdata: x\n\n") == [("message", b"x")]
    assert decode(b"", b"\xef\xbb\xbf", b"data: x\n\n") == [("message", b"x")]
    assert decode(b"\xef\xbb\xbfdata: x\n\n\xef\xbb\xbfdata: y\n\n")[0] == ("message", b"x")


def test_the_last_event_without_its_blank_line_is_still_delivered_at_the_end() -> None:
    assert decode(b"data: a\n\ndata: [DONE]\n") == [("message", b"a"), ("message", b"[DONE]")]
    assert decode(b"data: a\n\n") == [("message", b"a")]


lines = st.text(st.characters(blacklist_characters="\r\n", codec="utf-8"), max_size=20)
events = st.lists(
    st.tuples(st.sampled_from(["message", "error", "x"]), st.lists(lines, min_size=1, max_size=3)),
    max_size=6,
)


@given(events, st.sampled_from([b"\n", b"\r\n", b"\r"]), st.data())
def test_any_events_any_line_ends_any_split(
    sent: list[tuple[str, list[str]]], end: bytes, data: st.DataObject
) -> None:
    body = b""
    for kind, parts in sent:
        if kind != "message":
            body += b"event: " + kind.encode() + end
        body += b"".join(b"data: " + p.encode() + end for p in parts) + end
    cuts = sorted(data.draw(st.lists(st.integers(0, len(body)), max_size=5)))
    chunks = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
    wanted = [(kind, "\n".join(parts).encode()) for kind, parts in sent]
    assert decode(*chunks) == wanted


@pytest.mark.parametrize("end", [b"\n", b"\r\n", b"\r"])
def test_one_big_event_in_many_small_reads(end: bytes) -> None:
    # Held as a list of reads until its blank line comes, then joined once.
    text = bytes(range(32, 127)) * 11_000  # a megabyte
    body = b"data: " + text + end + end + b"data: next" + end + end
    reads = [body[i : i + 4096] for i in range(0, len(body), 4096)]
    assert decode(*reads) == [("message", text), ("message", b"next")]
