"""Answers read from an OpenAI-compatible server: one JSON body, or a stream of SSE events.

StreamedAnswer is fed the bytes of one streamed answer as they arrive, reads their events
(sse.py; frames.py reads most of a read's events in one pass) and keeps only what the answer
needs: its text pieces, the finish reason, usage, and when content arrived.
"""

from __future__ import annotations

import time
from itertools import repeat
from typing import Any

import orjson

from batchrun.backends.base import Completion, Watch
from batchrun.backends.errors_http import message_of, server_message
from batchrun.backends.frames import Frame, Texts, choice_text, plain_text, thinking
from batchrun.backends.sse import SEPARATOR, Event, SSEDecoder, events_in
from batchrun.errors import Overloaded, StreamCut

# Server-side timings some servers put in `usage` (Groq), in seconds.
SERVER_TIMING = ("queue_time", "prompt_time", "completion_time", "total_time")
# Events of an answer parsed alone in reads of many, each a chance to take a frame (_framed).
FRAME_TRIES = 2
# Events in a read from which frames are used. With a frame on every read of one event, an answer
# that came a read per event took 1.7x as long to read (stream_parse.py); a few events save less
# than a frame's checks cost.
FRAMED_READ = 4


class StreamedAnswer:
    def __init__(self, endpoint: str, started: float, watch: Watch | None) -> None:
        self.endpoint = endpoint
        self.started = started
        self.watch = watch
        self.events = 0
        self.done = False  # `data: [DONE]` came
        self.pieces: list[str] = []  # the text, in pieces (a run's texts in one: frames.py)
        self.texts = 0  # content pieces read: events with a text (bench times each)
        self.times: list[float] = []  # seconds from sending to each content piece's read
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None
        self.saw_choice = False
        self.frame: Frame | None = None  # the bytes around this answer's plain events' text
        self.frames_left = FRAME_TRIES
        self._decoder = SSEDecoder()

    def feed(self, chunk: bytes) -> None:
        """One network read of the stream."""
        if self.done:
            return  # after [DONE] nothing counts
        text = self._decoder.take(chunk)
        if not text:
            return
        texts = self.texts
        if text[:6] != b"data: ":
            self._add(events_in(text))
        elif b"\n" not in text:  # one event of one data line: a server writing token by token
            self._messages([text[6:]])
        else:
            # Split where a blank line is followed by `data: `: each part is the data of an
            # event of one line, unless it holds a line break.
            datas = text.split(SEPARATOR)
            datas[0] = datas[0][6:]
            if not self._framed(datas):  # each event parsed on its own
                if any(map(bytes.__contains__, datas, repeat(b"\n"))):
                    self._add(events_in(text))  # an event of more lines than one: in full
                else:
                    self._messages(datas)
        if self.texts > texts:  # the events of one read arrived together
            self._arrived(self.texts - texts)

    def close(self) -> None:
        """The stream ended: the event it cut short of its blank line counts, if any."""
        texts = self.texts
        self._add(self._decoder.close())
        if self.texts > texts:
            self._arrived(self.texts - texts)

    def _framed(self, datas: list[bytes]) -> bool:
        """A read of many events, each of one data line (as `feed` split it), read with frames:
        the first FRAME_TRIES events of an answer are parsed alone, each a chance to take a
        frame (a first event may differ from the rest: a role), a run of events that fit it is
        read as their texts (frames.py), and the rest are parsed in one pass. A server whose
        events differ each time (a per-event field) costs those tries an answer.

        Nothing counts until all of the read is read. Where any of it is something else (an
        event of more lines, one that is not JSON, `[DONE]` before the end, a run the checks
        refuse), it returns False with nothing taken, and the read is read event by event: the
        same answer, or the same error, as without frames."""
        if len(datas) < FRAMED_READ:
            return False
        at, parsed = 0, []
        while at < len(datas) and self.frames_left:
            data = datas[at]
            if self.frame is not None and self.frame.fits(data):
                break  # a run of the frame starts here
            if b"\n" in data:
                return False
            try:
                chunk = orjson.loads(data)
            except orjson.JSONDecodeError:
                return False
            self.frames_left -= 1
            parsed.append(chunk)
            # A frame from a text, not from a role's empty one: no later event would fit it.
            if piece := plain_text(chunk, self.endpoint):
                self.frame = Frame.of(data, piece, self.endpoint) or self.frame
            at += 1
        texts: Texts | None = ("", 0)
        start = at
        if self.frame is not None:
            at, texts = self.frame.run(datas, at)
        rest = datas[at:]
        parsed_rest = _parse_messages(rest)
        if (
            texts is None
            or parsed_rest is None
            or any(map(bytes.__contains__, rest, repeat(b"\n")))
        ):
            return False
        later, self.done = parsed_rest
        self.events += len(datas)
        for chunk in parsed:
            self._chunk(chunk)
        if at > start:  # a run of events, each with a choice
            self.saw_choice = True
            joined, count = texts
            if count:
                self.pieces.append(joined)
                self.texts += count
        for chunk in later:
            self._chunk(chunk)
        return True

    def _add(self, events: list[Event]) -> None:
        """Events of any kind, in order."""
        datas = [data for kind, data in events if kind == "message"]
        if len(datas) == len(events):
            self._messages(datas)
        elif not self.done:
            self._each(events)

    def _messages(self, datas: list[bytes]) -> None:
        """The data of message events (SSE's kind unless named), parsed in one pass unless one
        before the last is `[DONE]` or one is not JSON."""
        if self.done or not datas:
            return
        parsed = _parse_messages(datas)
        if parsed is None:
            self._each([("message", data) for data in datas])
            return
        chunks, self.done = parsed
        self.events += len(datas)
        for chunk in chunks:
            self._chunk(chunk)

    def _each(self, events: list[Event]) -> None:
        """Events read one at a time, in order, up to `[DONE]` (what follows it does not
        count): the first that goes wrong (an error event, one that is not JSON, a chunk that
        says so) ends the answer with its error, however the reads grouped them."""
        for kind, data in events:
            self.events += 1
            if data.strip() == b"[DONE]":
                self.done = True
                return
            if kind == "error":
                raise Overloaded(f"server error mid-stream: {server_message(data)[:300]}")
            self._chunk(_parse_one(data))

    def _chunk(self, chunk: Any) -> None:
        if not isinstance(chunk, dict):
            return
        if chunk.get("error"):
            raise Overloaded(
                f"server error mid-stream: {message_of(chunk, str(chunk['error']))[:300]}"
            )
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        choices = chunk.get("choices") or []
        if not isinstance(choices, list):
            raise StreamCut(f"malformed stream chunk: 'choices' is {type(choices).__name__}")
        for choice in choices:
            if not isinstance(choice, dict):
                raise StreamCut("malformed stream chunk: a choice is not an object")
            if choice.get("index") not in (0, None):
                continue  # another of `n` answers: the first is kept, as when not streamed
            self.saw_choice = True
            piece = choice_text(choice, self.endpoint, streamed=True)
            if piece:
                self.pieces.append(piece)
                self.texts += 1
            elif thinking(choice):  # a reasoning model's thought: a token, timed, not answer
                self.texts += 1
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]

    def _arrived(self, pieces: int) -> None:
        """`pieces` content pieces came now (one network read's: they share its time)."""
        at = time.perf_counter() - self.started
        first = not self.times
        self.times.extend([at] * pieces)
        if first and self.watch is not None:
            self.watch.first_token(at)

    def completion(self) -> Completion:
        """The answer once its stream has ended (raises if it is not whole)."""
        if not self.saw_choice:
            raise StreamCut("stream carried no choices")
        if self.finish is None:
            # Only a finish reason says the server meant to stop here ([DONE] alone closes
            # the stream, whole or not): retried, and said if attempts run out.
            if self.done:
                raise StreamCut("stream ended ([DONE]) without a finish_reason: answer incomplete")
            raise StreamCut("stream ended before its final chunk (no finish_reason)")
        _whole(self.finish)
        ttft = self.times[0] if self.times else None
        text = "".join(self.pieces)
        return completion(text, self.finish, self.usage, self.started, ttft, tuple(self.times))


def _parse_messages(datas: list[bytes]) -> tuple[list[Any], bool] | None:
    """The chunks that message events' data parse to, each on its own with no Python loop, and
    whether the last is `[DONE]` (not a chunk); None if any other is not JSON."""
    done = bool(datas) and datas[-1] == b"[DONE]"
    try:
        return list(map(orjson.loads, datas[:-1] if done else datas)), done
    except orjson.JSONDecodeError:
        return None


def _parse_one(data: bytes) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        raise StreamCut(
            _not_text(data, "of a stream event") or f"unreadable stream chunk: {data[:100]!r}"
        ) from None


def _not_text(data: bytes, where: str) -> str | None:
    """Where bytes that should be JSON text are not UTF-8: the same failed attempt, streamed or
    not (never U+FFFD in an answer: a replaced character is a changed answer)."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"invalid UTF-8 at byte {exc.start} {where}"
    return None


def read_json(content: bytes, endpoint: str, started: float) -> Completion:
    try:
        data = orjson.loads(content)
    except orjson.JSONDecodeError:
        problem = (
            _not_text(content, "of the response") or f"response is not JSON: {content[:100]!r}"
        )
        raise StreamCut(problem) from None
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        if isinstance(data, dict) and data.get("error"):  # a proxy's error, sent with a 200
            raise Overloaded(f"server error: {message_of(data, str(data['error']))[:300]}")
        raise StreamCut("response has no usable choices")
    text = choice_text(choices[0], endpoint, streamed=False) or ""
    finish = choices[0].get("finish_reason")
    _whole(finish)
    return completion(text, finish, data.get("usage"), started, None)


# Finish reasons that say the engine gave up on the answer (vLLM: an internal error, or the
# request aborted): its text is a part, never a `done` answer. Retried, as a cut stream is.
GAVE_UP = ("error", "abort")


def _whole(finish: Any) -> None:
    if finish in GAVE_UP:
        raise StreamCut(f"the server ended the answer with finish_reason {finish!r}: incomplete")


def completion(
    text: str,
    finish: str | None,
    usage: Any,
    started: float,
    ttft: float | None,
    chunk_times: tuple[float, ...] = (),
) -> Completion:
    usage = usage if isinstance(usage, dict) else {}
    timing = {k: float(usage[k]) for k in SERVER_TIMING if _is_number(usage.get(k))}
    return Completion(
        text=text,
        finish_reason=finish,
        prompt_tokens=_int_or_none(usage.get("prompt_tokens")),
        completion_tokens=_int_or_none(usage.get("completion_tokens")),
        latency_s=time.perf_counter() - started,
        ttft_s=ttft,
        chunk_times=chunk_times,
        server_timing=timing or None,
    )


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
