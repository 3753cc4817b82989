"""Stream events that differ only in their text, read without parsing each one.

A server writes every token's event of an answer the same way: the same id, model and fields
around a different piece of text. Once one such event has been parsed, the bytes before and
after its text are the answer's frame. A run of later events that are the frame around some
text is read as those texts alone, decoded in one C call as a JSON array of strings: no
object is built per token, and no Python runs per event beyond a prefix and suffix check and
a slice.

Exact, not a guess:

- a frame is taken only from a plain event (one choice, a string text, no finish reason, usage
  or error: its text is all it adds to an answer), and only if two different texts put in its
  text's place are each read back as the event's text: the span between head and tail is then
  the whole inside of the string the text is read from, and nothing else depends on it;
- a run is decoded only if its insides, joined, parse as an array of as many strings (strings
  alone) and none ends in a lone backslash: then each is by itself the inside of a JSON
  string, each event of the run parses to the frame's event with its own text, and the
  array's strings are those texts.

Anything else (a field that changes per event, a text the checks refuse) is parsed event by
event as before: slower, never different.
"""

from __future__ import annotations

from typing import Any

import orjson

# Two texts put in the frame in turn: read back from it both times, the frame's span is what
# the text is read from (one could be read back by chance: a duplicate key already holding it).
MARKERS = ((b"\\u0001", "\x01"), (b"\\u0002", "\x02"))


class Frame:
    """The bytes around the text of one stream's plain events."""

    __slots__ = ("head", "tail")

    def __init__(self, head: bytes, tail: bytes) -> None:
        self.head = head  # up to and including the quote that opens the text
        self.tail = tail  # from the quote that closes it

    @classmethod
    def of(cls, data: bytes, text: str, endpoint: str) -> Frame | None:
        """The frame of a plain event (`data`, whose text is `text`: plain_text), if its text
        is written in it as orjson writes it (a server that writes strings otherwise gets none)."""
        written = orjson.dumps(text)
        at = data.rfind(written)
        if at < 0:
            return None
        head, tail = data[: at + 1], data[at + len(written) - 1 :]
        for marker, marked in MARKERS:
            try:
                probe = orjson.loads(head + marker + tail)
            except orjson.JSONDecodeError:
                return None
            if plain_text(probe, endpoint) != marked:
                return None
        # The text read follows what the span holds: the span is the whole inside of the
        # string the text is read from, and nothing else in the event changes with it.
        return cls(head, tail)

    def end(self, datas: list[bytes], start: int) -> int:
        """Where the run of events that start and end as the frame does, from `start`, ends."""
        head, tail = self.head, self.tail
        end, count = start, len(datas)
        while end < count and datas[end].startswith(head) and datas[end].endswith(tail):
            end += 1
        return end

    def texts(self, run: list[bytes]) -> list[str] | None:
        """The texts of events that fit the frame; None if the checks refuse one."""
        head, cut = len(self.head), -len(self.tail)
        if min(map(len, run)) < head - cut:
            return None  # the frame's two ends overlap in one: not a text between them
        return _strings([data[head:cut] for data in run])


def _strings(insides: list[bytes]) -> list[str] | None:
    """The strings whose JSON insides these are, in one parse; None unless each is, by itself,
    the inside of a JSON string. An array of as many strings, and strings alone, means no
    inside holds a bare quote (it would add a string, or open a bracket that a later one
    closes), once none ends in a lone backslash (it would escape the quote that closes it,
    and a bare quote in the next could then pair with it)."""
    array = b'["' + b'","'.join(insides) + b'"]'
    if b"\\" in array:
        # Escaped backslashes out, a backslash left escapes what follows it: none may escape
        # the end of an inside (a NUL between insides here: valid insides hold none).
        ends = (b"\0".join(insides) + b"\0").replace(b"\\\\", b"")
        if b"\\\0" in ends:
            return None
    try:
        strings: list[str] = orjson.loads(array)
    except orjson.JSONDecodeError:
        return None  # a bad escape, a control character, not UTF-8
    if len(strings) != len(insides) or set(map(type, strings)) - {str}:
        return None
    return strings


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


def choice_text(choice: dict[str, Any], endpoint: str, *, streamed: bool) -> str | None:
    """A choice's text: `text` for completions, else its delta's (streamed) or message's
    `content`; None if it is not a string."""
    if endpoint == "completions":
        text = choice.get("text")
        return text if isinstance(text, str) else None
    part = choice.get("delta" if streamed else "message") or {}
    content = part.get("content") if isinstance(part, dict) else None
    return content if isinstance(content, str) else None
