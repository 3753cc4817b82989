"""Framed events (backends/frames.py): read as their texts alone, never differently from
parsing each one. Each test compares an answer read with frames to the same answer read event
by event, on streams whose texts are hostile bytes put between a frame's two ends."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchrun.backends.answers import FRAME_TRIES, StreamedAnswer
from batchrun.backends.frames import Frame, plain_text, texts_of
from tests.streams import body, same_either_way, split

HEAD = b'{"id":"c1","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"'
TAIL = b'"},"finish_reason":null}]}'
FINISH = b'{"id":"c1","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}'
ROLE = b'{"id":"c1","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}'

# Bytes to put between the frame's ends: text, escapes, and what could break out of a string.
PIECES = [b"a", b" the", b"\\n", b"\\u00e9", b"\\\\", b'\\"', "\u00e9".encode()]
HOSTILE = [b'"', b"\\", b",", b'","', b"[", b"]", b"{", b'",["', b'"],"', b"\x01", b"\\u12"]
HOSTILE += [b"\\x", b"\xff", b'"}', *PIECES]


@settings(max_examples=400)
@given(
    st.lists(st.lists(st.sampled_from(HOSTILE), max_size=4).map(b"".join), max_size=10),
    st.lists(st.integers(0, 4000), max_size=3),
)
def test_hostile_texts_read_the_same_framed_or_not(insides: list[bytes], cuts: list[int]) -> None:
    datas = [ROLE, *(HEAD + inside + TAIL for inside in insides), FINISH, b"[DONE]"]
    whole = body(*datas)
    same_either_way([whole])
    same_either_way(split(whole, cuts))


@given(st.lists(st.text(max_size=6), max_size=12))
def test_any_text_reads_back_exactly(texts: list[str]) -> None:
    datas = [HEAD + orjson.dumps(text)[1:-1] + TAIL for text in texts]
    outcome = same_either_way([body(*datas, FINISH, b"[DONE]")])
    assert outcome[:3] == ("".join(texts), "stop", sum(1 for text in texts if text))


def test_two_broken_texts_that_pair_into_valid_strings_are_a_cut_stream() -> None:
    # A lone backslash escapes what follows it and the next text's bare quote closes a string:
    # read together the two could pair into valid strings, yet neither event is JSON alone.
    datas = [HEAD + b"x" + TAIL, HEAD + b"c\\" + TAIL, HEAD + b',"e' + TAIL, FINISH]
    outcome = same_either_way([body(*datas)])
    assert outcome[0] == "cut" and "unreadable stream chunk" in str(outcome[1])


@pytest.mark.parametrize("text", [b" x", b"\\u0001"], ids=["text", "the-marker"])
def test_a_text_that_also_fills_a_later_field_is_framed_where_it_is_read(text: bytes) -> None:
    # The text is found last in "echo", which is not where it is read from: the frame must
    # not be taken there, or the echoes would be read as the texts.
    datas = [HEAD + text + TAIL[:-1] + b',"echo":"%s"}' % echo for echo in (text, b"y", b"z")]
    expected = orjson.loads(b'"%s"' % text) * 3
    assert same_either_way([body(*datas, FINISH)])[0] == expected


def test_an_event_of_two_choices_makes_no_frame() -> None:
    def event(first: bytes, second: bytes) -> bytes:
        return b'{"choices":[{"delta":{"content":"%s"}},{"delta":{"content":"%s"}}]}' % (
            first,
            second,
        )

    datas = [event(b"a", b"b"), event(b"c", b"b"), event(b"e", b"b"), FINISH]
    assert same_either_way([body(*datas)])[0] == "abcbeb"


def test_a_later_answers_events_make_no_frame() -> None:
    # Of `n` answers only the first is kept. Before: a frame taken from the second answer's
    # event read its later events' texts into the first ("axxxb").
    second = HEAD.replace(b'"index":0', b'"index":1')
    datas = [HEAD + b"a" + TAIL, *(second + b"x" + TAIL for _ in range(4)), HEAD + b"b" + TAIL]
    assert same_either_way([body(*datas, FINISH)])[0] == "ab"


@pytest.mark.parametrize(
    "rest",
    [b'"finish_reason":"%s"}]', b'"finish_reason":null}],"usage":{"completion_tokens":%s}'],
    ids=["finish_reason", "usage"],
)
def test_an_event_that_counts_beyond_its_text_makes_no_frame(rest: bytes) -> None:
    # Were the first event a frame, the third would be read as its text alone, and the
    # second's finish reason or usage (its text, escaped, makes no frame) would wrongly stand.
    def event(text: bytes, value: bytes) -> bytes:
        return b'{"choices":[{"delta":{"content":"%s"},%s}' % (text, rest % value)

    end = FINISH if b"usage" in rest else b"[DONE]"  # a finish reason, for usage alone
    datas = [event(b"a", b"3"), event(b"\\u00e9", b"4"), event(b"c", b"3"), event(b"d", b"3")]
    assert same_either_way([body(*datas, end)])[0] == "a\u00e9cd"


def test_no_frame_where_the_text_is_written_otherwise_or_is_not_plain() -> None:
    escaped = HEAD + b"\\u00e9" + TAIL  # a server that escapes non-ASCII text
    assert Frame.of(escaped, "\u00e9", "chat") is None
    assert plain_text(orjson.loads(FINISH), "chat") is None
    assert plain_text(orjson.loads(ROLE), "chat") == ""
    assert Frame.of(ROLE, "", "chat") is not None


def test_a_field_that_changes_per_event_costs_a_few_tries_then_none() -> None:
    datas = [HEAD + b"w" + TAIL.replace(b"}]}", b'}],"n":%d}' % i) for i in range(20)]
    streamed = StreamedAnswer("chat", 0.0, None)
    streamed.feed(body(*datas))
    assert streamed.frames_left == 0 and streamed.pieces == ["w"] * 20 and streamed.texts == 20
    assert same_either_way([body(*datas, FINISH)])[0] == "w" * 20


def test_a_read_of_a_few_events_makes_no_frame() -> None:
    streamed = StreamedAnswer("chat", 0.0, None)
    for word in (b"a", b"b", b"c", b"d"):
        streamed.feed(body(HEAD + word + TAIL))
    assert streamed.frame is None and streamed.frames_left == FRAME_TRIES
    streamed.feed(body(*(HEAD + word + TAIL for word in (b"e", b"f", b"g"))))
    streamed.feed(body(*(HEAD + word + TAIL for word in (b"h", b"i", b"j", b"k"))))
    assert streamed.frame is not None and "".join(streamed.pieces) == "abcdefghijk"


@pytest.mark.parametrize("per_read", [1, 3, 40])
def test_completions_texts_framed_at_any_grouping(per_read: int) -> None:
    head, tail = b'{"id":"t","choices":[{"index":0,"text":"', b'","finish_reason":null}]}'
    words = [" a", "", ' "q"', " \\ done"]
    datas = [head + orjson.dumps(word)[1:-1] + tail for word in words * 5]
    datas += [b'{"choices":[{"index":0,"text":"","finish_reason":"length"}]}', b"[DONE]"]
    reads = [body(*datas[i : i + per_read]) for i in range(0, len(datas), per_read)]
    assert same_either_way(reads, "completions")[:3] == ("".join(words) * 5, "length", 15)


def test_framed_events_skip_no_piece_and_keep_their_order() -> None:
    datas = [ROLE, *(HEAD + w + TAIL for w in (b"1", b"", b"2")), FINISH, HEAD + b"3" + TAIL]
    streamed = StreamedAnswer("chat", 0.0, None)
    streamed.feed(body(*datas))
    assert "".join(streamed.pieces) == "123" and streamed.texts == 3 and streamed.frame is not None
    assert streamed.completion().text == "123"


def test_an_event_where_the_frames_two_ends_overlap_is_a_cut_stream() -> None:
    # It starts and ends as the frame does, sharing the text's one quote: no text, not JSON.
    datas = [HEAD + b"x" + TAIL, HEAD + b"y" + TAIL, HEAD + TAIL[1:], HEAD + b"z" + TAIL, FINISH]
    outcome = same_either_way([body(*datas)])
    assert outcome[0] == "cut" and "unreadable stream chunk" in str(outcome[1])


def test_json_written_by_a_model_is_read_framed() -> None:
    # An answer that is JSON is full of quotes and commas: `",` is a common token. Its
    # escaped quote must not be taken for a text's end, or such answers lose their frames.
    words = ["{", '"', "name", '":', ' "', "a\\b", '",', ' "n', '":', " 3", "}", "\\"]
    datas = [HEAD + orjson.dumps(word)[1:-1] + TAIL for word in words]
    frame = Frame.of(datas[0], "{", "chat")
    assert frame is not None and frame.run([*datas, FINISH], 0) == (
        len(datas),
        ("".join(words), len(words)),
    )
    assert same_either_way([body(*datas, FINISH)])[0] == "".join(words)


@pytest.mark.parametrize(
    "insides",
    [[b"a", b'",["', b"", b'"],"'], [b"a", b'",{"k":"', b'"},"', b"b"]],
    ids=["array", "object"],
)
def test_brackets_opened_in_one_text_and_closed_in_another_are_a_cut_stream(
    insides: list[bytes],
) -> None:
    # Joined, they make an array of as many items as events, one of them not a string.
    datas = [HEAD + inside + TAIL for inside in insides]
    outcome = same_either_way([body(*datas, FINISH)])
    assert outcome[0] == "cut" and "unreadable stream chunk" in str(outcome[1])


@pytest.mark.parametrize(
    ("endpoint", "first", "later", "text"),
    [
        (
            "chat",
            b'{"choices":[{"delta":{"content":"\\u0001","content":"conten\\u0074"}}]}',
            b'{"choices":[{"delta":{"content":"\\u0001","%s":"conten\\u0074"}}]}',
            "content",
        ),
        (
            "completions",
            b'{"choices":[{"text":"\\u0001"}],"choices":[{"text":"choice\\u0073"}]}',
            b'{"choices":[{"text":"\\u0001"}],"%s":[{"text":"choice\\u0073"}]}',
            "choices",
        ),
    ],
)
def test_no_frame_at_a_duplicate_key_that_hides_the_marker(
    endpoint: str, first: bytes, later: bytes, text: str
) -> None:
    # The first event's text ("content", "choices") is found last as a key, which overrides an
    # earlier duplicate already holding the first marker: only a second marker shows it.
    finish = b'{"choices":[{"text":"","delta":{},"finish_reason":"stop"}]}'
    datas = [first, *(later % key for key in (b"hi", b"yo", b"zz")), finish]
    assert same_either_way([body(*datas)], endpoint)[0] == text + "\x01" * 3


def test_an_event_that_holds_both_markers_makes_no_frame() -> None:
    # A marker it holds already could be read back from there, not from the span.
    first = b'{"choices":[{"delta":{"content":"\\u0001","x":"\\u0002","content":"hi"}}]}'
    assert Frame.of(first, "hi", "chat") is None
    later = [first.replace(b"hi", word) for word in (b"yo", b"zz", b"\\u0001")]
    assert same_either_way([body(first, *later, FINISH)])[0] == "hiyozz\x01"


@pytest.mark.parametrize(
    ("odd", "text"),
    [
        (b": keep-alive\n\n", "abcdxy"),
        (b"id: 7\ndata: " + HEAD + b"e" + TAIL + b"\n\n", "abcedxy"),
        (b"event: message\ndata: " + HEAD + b"e" + TAIL + b"\n\n", "abcedxy"),
        (b"data: " + HEAD + b"e" + TAIL + b"\nretry: 5\n\n", "abcedxy"),
        (b"data: " + HEAD + b"e\ndata: f" + TAIL + b"\n\n", "cut"),  # a line break in a text
        (b"\n\n", "abcdxy"),
    ],
    ids=["comment", "id-first", "event-named", "retry-after", "two-data-lines", "blank-lines"],
)
@pytest.mark.parametrize("line_end", [b"\n", b"\r\n"], ids=["lf", "crlf"])
def test_other_sse_lines_among_framed_events_read_the_same(
    odd: bytes, text: str, line_end: bytes
) -> None:
    # A read is split where a blank line is followed by `data: `: an event that is more than
    # one data line must not be read as the frame around a text.
    words = [HEAD + word + TAIL for word in (b"a", b"b", b"c", b"d", b"x", b"y")]
    whole = body(*words[:3]) + odd + body(*words[3:], FINISH, b"[DONE]")
    assert same_either_way([whole.replace(b"\n", line_end)])[0] == text


@pytest.mark.parametrize(
    "inside",
    [b"\n", b"\r", b"\x00", b"\x1f", b"\xff", b"\xc3", b"\\x", b"\\u12", b'"', b"\\ud83d"],
    ids=[
        "lf",
        "cr",
        "nul",
        "unit-sep",
        "not-utf8",
        "cut-utf8",
        "bad-escape",
        "cut-escape",
        "bare-quote",
        "lone-surrogate",
    ],
)
def test_orjson_refuses_in_a_string_what_frames_rely_on_it_to_refuse(inside: bytes) -> None:
    # Frames are exact only while the JSON parser is strict: a line break kept out of a text
    # keeps the stream's own lines out of it, and the rest would make a text no event holds.
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(b'"a\x7f' + inside + b'\x7fb"')  # as texts_of reads it, between seams
    assert Frame(HEAD, TAIL).run([HEAD + inside + TAIL] * 4, 0)[1] is None


@pytest.mark.parametrize(
    ("before", "after"),
    [(b"a\\", b"nb"), (b"\\ud83d", b"\\ude00"), (b"\\u12", b"34"), (b"\xc3", b"\xa9")],
    ids=["cut-escape", "split-surrogate-pair", "cut-hex", "cut-character"],
)
def test_no_escape_or_character_reaches_across_a_del(before: bytes, after: bytes) -> None:
    # texts_of parses a run's insides as one string, a DEL between each two. Each pair here
    # reads as text joined directly and neither does alone: across a DEL it must not read.
    assert orjson.loads(b'"' + before + after + b'"')
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(b'"' + before + b"\x7f" + after + b'"')
    assert texts_of([before, after]) is None
    assert texts_of([b"x", before + after, b"\\\\"]) == (
        "x" + orjson.loads(b'"' + before + after + b'"') + "\\",
        3,
    )
