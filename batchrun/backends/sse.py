"""Server-sent events, parsed in bulk from the bytes as they arrive.

A streamed answer is one event per token, so the parser runs per token: it works on whole
network reads, splits them on blank lines (the end of an event), and takes the common event,
one `data:` line, without looking at it line by line. Everything else is parsed as the
WHATWG HTML standard says: lines end in CRLF, LF or CR; a line starting with `:` is a comment;
`data:` lines of one event are joined with LF; one space after the colon is dropped; `event:`
names the event; `id:` and `retry:` are read and ignored (nothing here reconnects); a leading
byte-order mark is dropped.

One choice of ours: an event that the stream's end cuts short of its blank line is still
delivered by close() (the standard drops it). Servers that end with `data: [DONE]` and a single
newline exist; whether an answer is whole is decided by its content (a finish reason), and a
JSON event cut in half does not parse.
"""

from __future__ import annotations

# One event: its `event:` field ("message" when it has none) and its data. A plain tuple: the
# parser makes one per streamed token.
Event = tuple[str, bytes]

BOM = b"\xef\xbb\xbf"
SEPARATOR = b"\n\ndata: "  # the end of an event and the start of the next one's data line


class SSEDecoder:
    """Feed bytes as they come; get back the events they completed."""

    def __init__(self) -> None:
        # What came after the last blank line, line ends normalised, a read at a time: joined
        # only once a blank line completes an event (one event sent in many reads costs a pass
        # over its bytes, not one per read).
        self._parts: list[bytes] = []
        self._cr = b""  # a CR that ended a read: its LF may come in the next one
        self._crlf = False  # a CR has been seen: line ends need normalising
        self._head = b""  # the start of the stream, while it may yet be a byte-order mark
        self._started = False

    def feed(self, chunk: bytes) -> list[Event]:
        """The events this read completed."""
        return events_in(self.take(chunk))

    def take(self, chunk: bytes) -> bytes:
        """The text of the events this read completed, b"" if none: line ends as LF, without
        the blank line that ends the last one (what follows it is held for the next read).
        One slice of the bytes read, so a caller may read many events in one pass (frames.py)."""
        if not self._started:
            chunk, self._head = self._head + chunk, b""
            if BOM.startswith(chunk):  # all of it may yet be a byte-order mark
                self._head = chunk
                return b""
            self._started = True
            chunk = chunk.removeprefix(BOM)
        if self._crlf or b"\r" in chunk:
            self._crlf = True
            chunk = self._cr + chunk
            self._cr = b"\r" if chunk.endswith(b"\r") else b""
            chunk = _lf(chunk[:-1] if self._cr else chunk)
        parts = self._parts
        if parts:  # an event begun in an earlier read
            # The held reads are non-empty and hold no blank line, joined or apart: a blank
            # line now is in this read, or begins at the end of the last one.
            ends = b"\n\n" in chunk or (chunk[:1] == b"\n" and parts[-1][-1:] == b"\n")
            if not ends:
                if chunk:
                    parts.append(chunk)
                return b""  # still no end to it
            chunk = b"".join([*parts, chunk])
            parts.clear()
        whole, end, rest = chunk.rpartition(b"\n\n")
        if rest:
            parts.append(rest)
        return whole if end else b""

    def close(self) -> list[Event]:
        """The stream ended: the event it cut short of its blank line, if any."""
        rest = b"".join(self._parts) + (b"\n" if self._cr else b"")  # held: already LF
        self._parts, self._cr, self._head = [], b"", b""  # a part of a byte-order mark: nothing
        blocks = rest.split(b"\n\n")
        return [event for block in blocks if (event := _event(block.strip(b"\n"))) is not None]


def events_in(text: bytes) -> list[Event]:
    """The events in `text` (what SSEDecoder.take returned)."""
    if text[:6] == b"data: ":
        if b"\n" not in text:  # one event of one data line: a server sending by token
            return [("message", text[6:])]
        datas = text[6:].split(SEPARATOR)
        if text.count(b"\n") == 2 * (len(datas) - 1):
            # Every line break is in a blank line followed by `data: `: every event is one
            # data line, split in one call.
            return [("message", data) for data in datas]
    found: list[Event] = []
    for block in text.split(b"\n\n"):
        if block[:6] == b"data: " and b"\n" not in block:
            found.append(("message", block[6:]))  # the common case: one data line
        elif (event := _event(block)) is not None:
            found.append(event)
    return found


def _lf(data: bytes) -> bytes:
    """CRLF and CR line ends as LF."""
    return data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")


def _event(block: bytes) -> Event | None:
    data: list[bytes] = []
    kind = "message"
    for line in block.split(b"\n"):
        if not line or line.startswith(b":"):
            continue
        name, colon, value = line.partition(b":")
        if colon and value.startswith(b" "):
            value = value[1:]
        if name == b"data":
            data.append(value)
        elif name == b"event":
            kind = value.decode("utf-8", "replace") or "message"
    if not data:
        return None  # comments, ids, an event with no data: nothing is dispatched
    return (kind, b"\n".join(data))
