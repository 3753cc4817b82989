"""Reading a streamed answer in tests: the answer (or error) a run of network reads comes to,
with frames (backends/frames.py) and without, which must be the same."""

from __future__ import annotations

from batchrun.backends.answers import StreamedAnswer
from batchrun.errors import Overloaded, StreamCut


def outcome(reads: list[bytes], *, frames: bool, endpoint: str = "chat") -> tuple[object, ...]:
    """What an answer read from these reads comes to (its text, finish reason, pieces, events
    and completion tokens), or the error it raised, by kind and message."""
    streamed = StreamedAnswer(endpoint, 0.0, None)
    if not frames:
        streamed.frames_left = 0
    try:
        for data in reads:
            streamed.feed(data)
        streamed.close()
        done = streamed.completion()
    except StreamCut as exc:
        return ("cut", str(exc))
    except Overloaded as exc:
        return ("overloaded", str(exc))
    got = (done.text, done.finish_reason, len(streamed.times), streamed.events)
    return (*got, done.completion_tokens)


def same_either_way(reads: list[bytes], endpoint: str = "chat") -> tuple[object, ...]:
    framed = outcome(reads, frames=True, endpoint=endpoint)
    assert framed == outcome(reads, frames=False, endpoint=endpoint)
    return framed


def body(*datas: bytes, end: bytes = b"\n") -> bytes:
    """Events of one data line each, as servers send them."""
    return b"".join(b"data: " + data + end + end for data in datas)


def split(whole: bytes, cuts: list[int]) -> list[bytes]:
    """`whole` as network reads cut at these offsets."""
    cuts = sorted(cuts)
    return [whole[a:b] for a, b in zip([0, *cuts], [*cuts, len(whole)], strict=True)]
