"""Stream events that differ only in their text, read without parsing each one.

A server writes every token's event of an answer the same way: the same id, model and fields
around a different piece of text. Once one such event has been parsed, the bytes before and
after its text are the answer's frame. A run of later events that are the frame around some
text is read as those texts alone, decoded in one C call as one string (texts_of): no object
is built per token, and no Python runs per event: the run is checked in one pass.

Exact, not a guess:

- a frame is taken only from a plain event (one choice, a string text, no finish reason, usage
  or error: its text is all it adds to an answer), and only if a text that the event holds
  nowhere else, put in its text's place, is read back as the event's text. JSON can write
  that character (U+0001) only as the escape `\u0001`, so the string read is the one around
  the span, and is nothing but it: the span between head and tail is the whole inside of the
  string the text is read from, and nothing else depends on it;
- a run is decoded only if its events, put back together from the frame and their insides,
  are the same bytes, and each inside is by itself the inside of a JSON string (texts_of
  says how it knows without a parse per inside): then each event of the run parses to the
  frame's event with its own text, and the string decoded is those texts joined.

Anything else (a field that changes per event, a text the checks refuse) is parsed event by
event as before: slower, never different.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any

import orjson

from batchrun.backends.sse import SEPARATOR

# The texts of a run of events, joined, and how many of them are not empty (each is a piece of
# content that arrived: bench times them).
Texts = tuple[str, int]

# Texts put in the frame, the first that the event does not hold already (one it holds could be
# read back by chance: a duplicate key holding it).
MARKERS = ((b"\\u0001", "\x01"), (b"\\u0002", "\x02"))


class Frame:
    """The bytes around the text of one stream's plain events."""

    __slots__ = ("_inside", "head", "least", "seam", "tail")

    def __init__(self, head: bytes, tail: bytes) -> None:
        self.head = head  # up to and including the quote that opens the text
        self.tail = tail  # from the quote that closes it
        self.seam = tail + SEPARATOR + head  # between the texts of two events of the frame
        self.least = len(head) + len(tail)  # an event's length with an empty text
        # What lies between the two ends, in an event that fits: a slice taken in C.
        self._inside = itemgetter(slice(len(head), -len(tail)))

    @classmethod
    def of(cls, data: bytes, text: str, endpoint: str) -> Frame | None:
        """The frame of a plain event (`data`, whose text is `text`: plain_text), if its text
        is written in it as orjson writes it (a server that writes strings otherwise gets none)."""
        written = orjson.dumps(text)
        at = data.rfind(written)
        if at < 0:
            return None
        for marker in MARKERS:
            if marker[0] not in data:
                break
        else:
            return None  # it holds both already
        escaped, char = marker
        head, tail = data[: at + 1], data[at + len(written) - 1 :]
        try:
            probe = orjson.loads(head + escaped + tail)
        except orjson.JSONDecodeError:
            return None
        if plain_text(probe, endpoint) != char:
            return None
        # The text read follows what the span holds: the span is the whole inside of the
        # string the text is read from, and nothing else in the event changes with it.
        return cls(head, tail)

    def run(self, datas: list[bytes], start: int) -> tuple[int, Texts | None]:
        """Where the run of events that fit the frame, from `start`, ends, and their texts
        (None if the checks refuse one). `datas`: the data of a read's events, in order.

        A run usually ends a few events before the read does (a finish reason, usage,
        `[DONE]`): those are passed over from the end, and the rest checked in one pass: put
        back together from their insides and the frame, they must be the same bytes. Where an
        event between them does not fit, the run is found event by event."""
        end, tail = len(datas), self.tail
        if start == end or not self.fits(datas[start]):
            return start, ("", 0)
        while not datas[end - 1].endswith(tail):  # stops at `start` at the latest
            end -= 1
        run = datas[start:end]
        insides = list(map(self._inside, run))
        if self.head + self.seam.join(insides) + self.tail != SEPARATOR.join(run):
            end = start + 1
            while end < len(datas) and self.fits(datas[end]):
                end += 1
            insides = list(map(self._inside, datas[start:end]))
        return end, texts_of(insides)

    def fits(self, data: bytes) -> bool:
        """Whether an event starts and ends as the frame's do, with room for a text between."""
        return data.startswith(self.head) and data.endswith(self.tail) and len(data) >= self.least


def texts_of(insides: list[bytes]) -> Texts | None:
    """The texts whose JSON insides these are, joined, and how many are not empty; None unless
    each is, by itself, the inside of a JSON string. One parse, one string made.

    The insides are parsed as one string with a DEL (U+007F, a character JSON strings may hold
    as it is) between each two. No escape or character of an inside can reach across a DEL:
    a backslash before it is a bad escape, a `\\u` escape cut by it bad hex, a surrogate
    pair split by it two lone halves, a character cut by it not UTF-8. So the parse succeeds
    only if each inside, with a DEL on both sides, reads as it would alone (a bare quote, a
    control character or a bad escape fails it, as it fails that inside alone), and the
    string holds each inside's text, a DEL between each two. A text that holds a DEL itself
    (one more DEL than the seams) gets None: its read is read event by event."""
    if not insides:
        return "", 0
    try:
        joined: str = orjson.loads(b'"' + b"\x7f".join(insides) + b'"')
    except orjson.JSONDecodeError:
        return None  # a bare quote, a bad escape, a control character, not UTF-8
    if joined.count("\x7f") != len(insides) - 1:
        return None
    return joined.replace("\x7f", ""), len(insides) - insides.count(b"")


def plain_text(chunk: Any, endpoint: str) -> str | None:
    """The text of a plain event: one choice, the first answer's, a string text, and nothing
    else that counts (no finish reason, usage or error), so its only effect on an answer is
    its text."""
    if not isinstance(chunk, dict) or chunk.get("usage") or chunk.get("error"):
        return None
    choices = chunk.get("choices")
    if not isinstance(choices, list) or len(choices) != 1:
        return None
    choice = choices[0]
    if not isinstance(choice, dict) or choice.get("finish_reason"):
        return None
    if choice.get("index") not in (0, None):
        return None  # another of `n` answers (only the first is kept)
    return choice_text(choice, endpoint, streamed=True)


def thinking(choice: dict[str, Any]) -> bool:
    """A streamed chat delta of a reasoning model's thought (`reasoning_content`: vLLM's,
    SGLang's and llama-server's; `reasoning`: vLLM's newer name): tokens that count in
    `usage` and in the time to the first token, though they are not the answer."""
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        return False
    thought = delta.get("reasoning_content") or delta.get("reasoning")
    return isinstance(thought, str) and bool(thought)


def choice_text(choice: dict[str, Any], endpoint: str, *, streamed: bool) -> str | None:
    """A choice's text: `text` for completions, else its delta's (streamed) or message's
    `content`; None if it is not a string."""
    if endpoint == "completions":
        text = choice.get("text")
        return text if isinstance(text, str) else None
    part = choice.get("delta" if streamed else "message") or {}
    content = part.get("content") if isinstance(part, dict) else None
    return content if isinstance(content, str) else None
