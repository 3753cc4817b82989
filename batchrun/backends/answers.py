"""Answers read from an OpenAI-compatible server: one JSON body, or a stream of SSE events.

StreamedAnswer is fed the events of one streamed answer as they arrive (sse.py) and keeps only
what the answer needs: its text pieces, the finish reason, usage, and when content arrived.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from batchrun.backends.base import Completion, Watch
from batchrun.backends.errors_http import message_of, server_message
from batchrun.backends.frames import Frame, choice_text, plain_text
from batchrun.backends.sse import Event
from batchrun.errors import Overloaded, StreamCut

# Server-side timings some servers put in `usage` (Groq), in seconds.
SERVER_TIMING = ("queue_time", "prompt_time", "completion_time", "total_time")
# Events of an answer parsed one by one in reads of many, each a chance to take a frame: the
# first may differ from the rest (a role); after that the rest of a read goes in one pass, so a
# server whose events differ each time (a per-event field) costs two tries an answer.
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
        self.pieces: list[str] = []
        self.times: list[float] = []  # seconds from sending to each content piece's read
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None
        self.saw_choice = False
        self.frame: Frame | None = None  # the bytes around this answer's plain events' text
        self.frames_left = FRAME_TRIES

    def add(self, events: list[Event]) -> None:
        """The events one network read completed (they arrived together)."""
        if self.done or not events:
            return  # after [DONE] nothing counts
        pieces = len(self.pieces)
        datas = [data for kind, data in events if kind == "message"]
        done = len(datas) == len(events) and datas[-1] == b"[DONE]"
        if done:
            datas.pop()
        chunks = self._read(datas) if len(datas) + done == len(events) else None
        if chunks is None:  # not chunks alone, perhaps ended by [DONE]: event by event
            chunks = [_parse_one(data) for data in self._until_done(events)]
        else:
            self.events += len(events)
            self.done = done
        for chunk in chunks:
            if type(chunk) is tuple:  # the texts of framed events (JSON never parses to one)
                self.saw_choice = True
                self.pieces.extend(filter(None, chunk))
            else:
                self._chunk(chunk)
        if len(self.pieces) > pieces:
            self._arrived(time.perf_counter() - self.started, len(self.pieces) - pieces)

    def _read(self, datas: list[bytes]) -> list[Any] | None:
        """The events' JSON, each parsed on its own (never joined: payloads that are not JSON
        alone can join into an array of one object each, `{..},{"a":"` and `"}`), and in a read
        of many, each run of framed events as a tuple of its texts; None if one does not parse.
        A read of a few (a server writing token by token, the client keeping up) is parsed in
        one pass: a frame costs more than it saves there."""
        if len(datas) < FRAMED_READ:
            return _parse_all(datas)
        chunks: list[Any] = []
        at, count = 0, len(datas)
        while at < count:
            if self.frame is not None and (end := self.frame.end(datas, at)) > at:
                texts = self.frame.texts(datas[at:end])
                if texts is None:
                    return None  # one of them is not the frame around a text: event by event
                chunks.append(tuple(texts))
                at = end
                continue
            if not self.frames_left:  # no frame here, and no more tried: the rest in one pass
                rest = _parse_all(datas[at:])
                return None if rest is None else chunks + rest
            try:
                chunk = orjson.loads(datas[at])
            except orjson.JSONDecodeError:
                return None
            chunks.append(chunk)
            at += 1
            self.frames_left -= 1  # a first event may differ from the rest (a role)
            if (text := plain_text(chunk, self.endpoint)) is not None:
                self.frame = Frame.of(datas[at - 1], text, self.endpoint) or self.frame
        return chunks

    def _until_done(self, events: list[Event]) -> list[bytes]:
        """The events' data up to `[DONE]` (what follows it does not count)."""
        datas: list[bytes] = []
        for kind, data in events:
            self.events += 1
            if data.strip() == b"[DONE]":
                self.done = True
                break
            if kind == "error":
                raise Overloaded(f"server error mid-stream: {server_message(data)[:300]}")
            datas.append(data)
        return datas

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
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]

    def _arrived(self, at: float, pieces: int) -> None:
        """`pieces` content pieces came at `at` (one network read: they share its time)."""
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
        ttft = self.times[0] if self.times else None
        text = "".join(self.pieces)
        return completion(text, self.finish, self.usage, self.started, ttft, tuple(self.times))


def _parse_all(datas: list[bytes]) -> list[Any] | None:
    """The events' JSON, each parsed on its own with no Python loop; None if one does not parse."""
    try:
        return list(map(orjson.loads, datas))
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
        raise StreamCut("response has no usable choices")
    text = choice_text(choices[0], endpoint, streamed=False) or ""
    return completion(text, choices[0].get("finish_reason"), data.get("usage"), started, None)


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
