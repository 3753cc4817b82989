"""A hostile review of the stream reader (sse.py, answers.py, frames.py): frames on must read
any bytes, split any way, exactly as frames off; and frames off must read them as the WHATWG
event-stream standard and the answer's rules say (an independent reference model here)."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchrun.backends.frames import Frame, texts_of
from tests.streams import body, outcome, same_either_way, split

HEAD = b'{"id":"c1","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"'
TAIL = b'"},"finish_reason":null}]}'
HEAD2 = HEAD.replace(b'"c1"', b'"c2"')  # a second frame in the same answer
HEAD1 = HEAD.replace(b'"index":0', b'"index":1')  # the second of n answers
CHEAD = b'{"id":"t","choices":[{"index":0,"text":"'
CTAIL = b'","finish_reason":null}]}'
FINISH = b'{"id":"c1","choices":[{"index":0,"delta":{},"text":"","finish_reason":"stop"}]}'
USAGE = b'{"id":"c1","choices":[],"usage":{"completion_tokens":7}}'
ROLE = b'{"id":"c1","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}'
CROLE = b'{"id":"t","choices":[{"index":0,"text":""}]}'

INSIDES = [
    b"a",
    b" the",
    b"",
    b"\\n",
    b"\\u00e9",
    b"\\\\",
    b'\\"',
    "\u00e9".encode(),
    b"\\u0001",
    b"\\u0002",
    b"\\ud83d\\ude00",
    b"\\ud83d",
    b'"',
    b"\\",
    b",",
    b'","',
    b"[",
    b"]",
    b"{",
    b'",["',
    b'"],"',
    b"\x01",
    b"\\u12",
    b"\\x",
    b"\xff",
    b"\xc3",
    b'"}',
    b"\t",
    b"\x7f",
    b"\\u007f",
    b"\\uDE00",
    b"\\u",
    b"\\/",
    b"\\\\\\",
    b"\x00",
    b"\r",
    b"\n",
    b"data: ",
    b"\n\ndata: ",
    b"[DONE]",
    b":",
]
inside = st.lists(st.sampled_from(INSIDES), max_size=3).map(b"".join)


# --- an independent reference: the WHATWG parser, line by line, then the answer's rules ----


def whatwg_events(stream: bytes) -> list[tuple[str, bytes]]:
    """The standard's events, except (the decoder's documented choice) that an event the end
    cuts short of its blank line is dispatched."""
    if stream.startswith(b"\xef\xbb\xbf"):
        stream = stream[3:]
    lines: list[bytes] = []
    line, i = b"", 0
    while i < len(stream):
        c = stream[i : i + 1]
        if c in (b"\r", b"\n"):
            lines.append(line)
            line = b""
            if c == b"\r" and stream[i + 1 : i + 2] == b"\n":
                i += 1
        else:
            line += c
        i += 1
    lines += [line, b""] if line else [b""]
    events: list[tuple[str, bytes]] = []
    data: bytes | None = None
    kind = b""
    for line in lines:
        if not line:
            if data is not None:
                events.append((kind.decode("utf-8", "replace") or "message", data[:-1]))
            data, kind = None, b""
            continue
        if line.startswith(b":"):
            continue
        name, colon, value = line.partition(b":")
        if colon and value.startswith(b" "):
            value = value[1:]
        if name == b"data":
            data = (data or b"") + value + b"\n"
        elif name == b"event":
            kind = value
    return events


def reference(stream: bytes, endpoint: str = "chat") -> tuple[object, ...]:
    """The answer the events make, each parsed on its own; ("error",) for any error."""
    pieces: list[str] = []
    finish = usage = None
    saw = False
    count = 0
    for kind, data in whatwg_events(stream):
        count += 1
        if data.strip() == b"[DONE]":
            break
        if kind == "error":
            return ("error",)
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            return ("error",)
        if not isinstance(chunk, dict):
            continue
        if chunk.get("error"):
            return ("error",)
        if chunk.get("usage"):
            usage = chunk["usage"]
        choices = chunk.get("choices") or []
        if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
            return ("error",)
        for choice in choices:
            if choice.get("index") not in (0, None):
                continue
            saw = True
            if endpoint == "completions":
                text = choice.get("text")
            else:
                delta = choice.get("delta") or {}
                text = delta.get("content") if isinstance(delta, dict) else None
            if isinstance(text, str) and text:
                pieces.append(text)
            if choice.get("finish_reason"):
                finish = choice["finish_reason"]
    if not saw or finish is None:
        return ("error",)
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    tokens = tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None
    return ("".join(pieces), finish, len(pieces), count, tokens)


def as_reference(got: tuple[object, ...]) -> tuple[object, ...]:
    return ("error",) if got[0] in ("cut", "overloaded") else got


# --- streams of hostile events, odd SSE lines and line ends, split any way -----------------


@st.composite
def streams(draw: st.DrawFn, *, raising: bool = False) -> tuple[bytes, str]:
    """A stream (with LF line ends for now) and its endpoint. `raising`: also events whose
    JSON raises when read (an error object, malformed choices)."""
    endpoint = draw(st.sampled_from(["chat", "completions"]))
    head, tail, role = (CHEAD, CTAIL, CROLE) if endpoint == "completions" else (HEAD, TAIL, ROLE)
    heads = [
        head,
        head.replace(b'"c1"', b'"c2"').replace(b'"t"', b'"u"'),
        head.replace(b'"index":0', b'"index":1'),
    ]
    atoms = st.one_of(
        st.tuples(st.sampled_from(heads), inside).map(lambda h: body(h[0] + h[1] + tail)),
        st.tuples(st.sampled_from([head]), inside).map(lambda h: body(h[0] + h[1] + tail)),
        st.sampled_from(
            [
                body(role),
                body(FINISH),
                body(USAGE),
                body(b"[DONE]"),
                body(b" [DONE] "),
                b"data:  [DONE]\n\n",
                b": keep-alive\n\n",
                b"\n",
                b"\n\n",
                b"id: 5\n",
                b"retry: 10\n",
                b"event: ping\n",
                b"event: message\n",
                b"event: error\n",
                b"event:\n",
                b"data:" + head + b"nospace" + tail + b"\n\n",
                b"data\n\n",
                b"data: garbage\n\n",
                body(head + tail),
                body(head[:-1] + tail),
                body(head + b"x" + tail[:-1]),
                body(b"{}"),
                body(b"[]"),
                body(b'"x"'),
                b"data: " + head + b"p\ndata: q" + tail + b"\n\n",
                b"data: " + head + b"p\n: c\ndata: q" + tail + b"\n\n",
                b"data: " + head + b"z" + tail + b"\nid: 9\n\n",
                b"id: 9\ndata: " + head + b"z" + tail + b"\n\n",
                b'data: {"choices":\ndata: [{"index":0,"delta":{"content":"m"},"text":"m"}]}\n\n',
                body(head + b"r" + tail[:-1] + b',"choices":[]}'),
                body(head + b"s" + tail[:-1] + b',"usage":{"completion_tokens":3}}'),
            ]
        ),
    )
    if raising:
        atoms = st.one_of(
            atoms,
            st.sampled_from(
                [
                    body(b'{"error":{"message":"boom"}}'),
                    body(b'{"choices":1}'),
                    body(b'{"choices":[1]}'),
                ]
            ),
        )
    parts = draw(st.lists(atoms, max_size=14))
    tail_parts = draw(st.sampled_from([[body(FINISH), body(b"[DONE]")], [body(FINISH)], []]))
    stream = b"".join([*parts, *tail_parts])
    if draw(st.booleans()):  # a stream cut short anywhere
        stream = stream[: draw(st.integers(0, len(stream)))]
    return stream, endpoint


def line_ends(stream: bytes, end: bytes) -> bytes:
    return stream.replace(b"\n", end) if end != b"\n" else stream


def any_reads(data: st.DataObject, stream: bytes) -> list[bytes]:
    how = data.draw(st.sampled_from(["one", "cuts", "bytes", "events"]))
    if how == "one":
        return [stream]
    if how == "bytes":
        size = data.draw(st.integers(1, 7))
        return [stream[i : i + size] for i in range(0, len(stream), size)]
    if how == "events":  # groups of whole events: reads of 1-3 and of 4 or more
        per = data.draw(st.integers(1, 6))
        events = [e + b"\n\n" for e in stream.split(b"\n\n")]
        return [b"".join(events[i : i + per]) for i in range(0, len(events), per)]
    return split(stream, data.draw(st.lists(st.integers(0, len(stream)), max_size=6)))


SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))


@SETTINGS
@given(streams(), st.sampled_from([b"\n", b"\r\n", b"\r"]), st.booleans(), st.data())
def test_frames_on_and_off_agree_and_match_the_standard(
    sent: tuple[bytes, str], end: bytes, bom: bool, data: st.DataObject
) -> None:
    stream, endpoint = sent
    stream = (b"\xef\xbb\xbf" if bom else b"") + line_ends(stream, end)
    reads = any_reads(data, stream)
    got = same_either_way(reads, endpoint)
    assert as_reference(got) == reference(stream, endpoint)


@SETTINGS
@given(streams(), st.data())
def test_mixed_line_ends_any_split(sent: tuple[bytes, str], data: st.DataObject) -> None:
    stream, endpoint = sent
    ends = data.draw(st.lists(st.sampled_from([b"\n", b"\r\n", b"\r"]), min_size=1, max_size=8))
    pieces = stream.split(b"\n")
    mixed = pieces[0] + b"".join(ends[i % len(ends)] + p for i, p in enumerate(pieces[1:]))
    # "\r" then "\n" from two line ends would be one CRLF: the reference sees the same bytes.
    reads = any_reads(data, mixed)
    got = same_either_way(reads, endpoint)
    assert as_reference(got) == reference(mixed, endpoint)


@SETTINGS
@given(st.lists(inside, min_size=1, max_size=12), st.lists(st.integers(0, 3), max_size=4))
def test_runs_of_hostile_insides_across_reads(insides: list[bytes], cuts: list[int]) -> None:
    # Many events per read (the framed path), a frame taken in one read and used in later ones.
    datas = [HEAD + b"w" + TAIL, HEAD + b"v" + TAIL, *(HEAD + i + TAIL for i in insides)]
    datas += [FINISH, b"[DONE]"]
    groups = sorted({min(c * 4, len(datas)) for c in cuts})
    reads = [body(*datas[a:b]) for a, b in zip([0, *groups], [*groups, len(datas)], strict=True)]
    got = same_either_way(reads)
    assert as_reference(got) == reference(b"".join(reads))


@settings(max_examples=3000, deadline=None)
@given(st.lists(inside, max_size=6))
def test_texts_of_is_exact_for_any_insides(insides: list[bytes]) -> None:
    # texts_of: the texts joined, and how many are not empty, iff every inside is by itself
    # the inside of a JSON string (and none holds a DEL, its seam: those are refused too).
    each: list[str] | None = []
    for one in insides:
        try:
            each.append(orjson.loads(b'"' + one + b'"'))
        except orjson.JSONDecodeError:
            each = None
            break
    if each is None or any("\x7f" in text for text in each):
        assert texts_of(insides) is None
    else:
        assert texts_of(insides) == ("".join(each), sum(1 for text in each if text))


# --- errors: frames on must raise what frames off raises --------------------------------


@pytest.mark.parametrize(
    "first",
    [b'{"error":{"message":"boom"}}', b'{"choices":1}'],
    ids=["error-object", "malformed-choices"],
)
def test_an_early_raising_event_and_a_later_unreadable_one_raise_the_same(first: bytes) -> None:
    # Before: frames off parsed the whole read before reading any event (the unreadable one
    # raised); frames on read the first FRAME_TRIES events alone, first (theirs raised). Now
    # the first event that goes wrong, in the stream's order, raises either way.
    got = same_either_way([body(first, HEAD + b"a" + TAIL, HEAD + b"b" + TAIL, b"garbage")])
    assert got[0] == ("overloaded" if b"error" in first else "cut")
    assert "garbage" not in str(got[1])


def test_an_early_malformed_event_and_a_later_error_event_raise_the_same() -> None:
    error = b'event: error\ndata: {"error":"x"}\n\n'
    got = same_either_way(
        [body(b'{"choices":1}', HEAD + b"a" + TAIL, HEAD + b"b" + TAIL) + error + body(FINISH)]
    )
    assert got[0] == "cut" and "'choices' is int" in str(got[1])


@SETTINGS
@given(streams(raising=True), st.data())
def test_raising_events_raise_some_error_either_way(
    sent: tuple[bytes, str], data: st.DataObject
) -> None:
    # The same error either way, and the same however the reads group the events.
    stream, endpoint = sent
    got = same_either_way(any_reads(data, stream), endpoint)
    assert as_reference(got) == reference(stream, endpoint)
    assert got == outcome([stream], frames=False, endpoint=endpoint)


# --- named cases -------------------------------------------------------------------------


@pytest.mark.parametrize("end", [b"\n", b"\r\n", b"\r"])
@pytest.mark.parametrize("per_read", [1, 2, 3, 4, 5, 100])
def test_two_frames_in_one_answer(end: bytes, per_read: int) -> None:
    datas = [ROLE, *(HEAD + b"%d" % i + TAIL for i in range(6))]
    datas += [*(HEAD2 + b"<%d>" % i + TAIL for i in range(6)), FINISH, b"[DONE]"]
    reads = [body(*datas[i : i + per_read], end=end) for i in range(0, len(datas), per_read)]
    assert same_either_way(reads)[0] == "012345" + "".join(f"<{i}>" for i in range(6))


@pytest.mark.parametrize("odd", [b"[DONE]", b" [DONE] ", b"[DONE] "])
def test_done_in_the_middle_of_a_run_ends_the_answer(odd: bytes) -> None:
    datas = [HEAD + b"a" + TAIL, HEAD + b"b" + TAIL, HEAD + b"c" + TAIL, odd]
    datas += [HEAD + b"d" + TAIL, FINISH]
    assert same_either_way([body(*datas)])[0] == "cut"
    assert same_either_way([body(*datas[:3], FINISH, *datas[3:])])[:2] == ("abc", "stop")


def test_an_event_shorter_than_the_frame_in_a_run() -> None:
    datas = [HEAD + b"a" + TAIL, HEAD + b"b" + TAIL, HEAD + b"c" + TAIL, HEAD[:-1] + TAIL]
    assert same_either_way([body(*datas, HEAD + b"d" + TAIL, FINISH)])[0] == "cut"


def test_events_that_fit_the_head_or_the_tail_only() -> None:
    other = b'{"id":"x","choices":[{"index":0,"delta":{"content":"'
    datas = [HEAD + b"a" + TAIL, HEAD + b"b" + TAIL, other + b"c" + TAIL, HEAD + b"d" + TAIL]
    datas += [HEAD + b"e" + TAIL[:-1] + b',"x":1}', HEAD + b"f" + TAIL, FINISH]
    assert same_either_way([body(*datas)])[:2] == ("abcdef", "stop")


@pytest.mark.parametrize("cut", range(1, 12))
def test_a_framed_read_cut_anywhere_by_crlf(cut: int) -> None:
    datas = [HEAD + w + TAIL for w in (b"a", b"b", b"c", b"d", b"e")] + [FINISH, b"[DONE]"]
    whole = body(*datas, end=b"\r\n")
    at = len(body(*datas[:4], end=b"\r\n")) - 2 + cut % 4  # around a blank line
    same_either_way([whole[:at], whole[at:]])
    same_either_way([whole[: at - cut], whole[at - cut : at], whole[at:]])


def test_frame_probe_is_not_fooled_by_a_text_also_in_a_key() -> None:
    # The text is written last as a key, not where it is read.
    first = b'{"choices":[{"index":0,"delta":{"content":"k","k":1}}]}'
    later = [first.replace(b'"k",', b'"%s",' % w) for w in (b"x", b"y", b"z")]
    assert same_either_way([body(first, *later, FINISH)])[0] == "kxyz"
    assert Frame.of(first, "k", "chat") is None  # found last as the key: the probe refuses it


def test_frames_off_raise_the_same_error_however_the_reads_group_the_events() -> None:
    # Not frames on against off: the reference itself. An error object then an unreadable
    # event: one read said "cut" (all parsed first), two reads "overloaded". Now the first
    # that goes wrong, in the stream's order, wins.
    datas = [b'{"error":{"message":"boom"}}', b"garbage"]
    one = outcome([body(*datas)], frames=False)
    two = outcome([body(datas[0]), body(datas[1])], frames=False)
    assert one == two


# --- random damage to a framed stream -----------------------------------------------------

DAMAGE = [
    b'"',
    b"\\",
    b",",
    b"\n",
    b"\r",
    b"\n\n",
    b"data: ",
    b":",
    b"}",
    b"]",
    b"{",
    b"[",
    b"\x01",
    b"\xff",
    b"u",
    b"0",
    b" ",
    b"\\u0001",
    b"\\u0002",
    b"null",
    b"1",
]


@SETTINGS
@given(
    st.sampled_from(["chat", "completions"]),
    st.lists(
        st.tuples(st.integers(0, 10_000), st.integers(0, 3), st.sampled_from(DAMAGE)), max_size=4
    ),
    st.data(),
)
def test_a_damaged_framed_stream_reads_the_same_either_way(
    endpoint: str, damage: list[tuple[int, int, bytes]], data: st.DataObject
) -> None:
    head, tail, role = (CHEAD, CTAIL, CROLE) if endpoint == "completions" else (HEAD, TAIL, ROLE)
    words = [b"a", b" b", b"\\n", b"\\\\", b'\\"', b"\\u00e9", b"", b"c", b"d", b"e"]
    stream = body(role, *(head + w + tail for w in words), FINISH, USAGE, b"[DONE]")
    for at, drop, put in damage:
        at %= len(stream)
        stream = stream[:at] + put + stream[at + drop :]
    reads = any_reads(data, stream)
    got = same_either_way(reads, endpoint)
    assert as_reference(got) == reference(stream, endpoint)
