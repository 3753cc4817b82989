"""How far can reading a streamed answer go in Python? batchrun's reader against four floors.

Runs batchrun's backend (OpenAICompatBackend.complete on its own engine, as engines.py does)
against the zero-latency server (fast_server.py, another process, a whole answer in one
write), 32 in flight, and prints the client's CPU per request, not streamed and streamed, with
the streamed answer read six ways (the last four are models, not readers: each skips work an
exact reader must do, and is here only to bound what such a reader can save):

- batchrun: the answer as batchrun reads it (backends/answers.py, frames.py);
- every event parsed: each event's JSON parsed on its own (frames off);
- texts, unchecked: the read split into events, the first and last events parsed, and the
  texts of the rest decoded as one string in one call from a frame taken once for the whole
  run, with none of frames.py's checks (a frame a probe, the run put back together, a seam
  between each two texts);
- compiled run: what Python would still do if native code read a run (checked each event
  against the frame and handed over their insides, a DEL between each two) at no cost: the
  first event and the last two parsed, a frame taken, the insides decoded in one call, the
  chunks and the text added, the arrival timed: the floor of a reader that compiles the run;
- run free: the same with the run's texts given, no frame taken and nothing decoded;
- not read: the answer taken as whole at its first read, nothing decoded: what streaming
  costs the engine and the backend around the reading.

The gap between batchrun and "texts, unchecked" is what exactness costs; the gap between that
and "not read" is what any reader must spend at least (splitting, decoding, the objects made);
the gap between batchrun and "compiled run" is the most that compiling the run alone can save.

    python benchmarks/stream_floor.py [--requests 3000] [--repeat 5] [--tokens 30]
"""

from __future__ import annotations

import argparse
import gc
import statistics
from collections.abc import Callable

import orjson
from client_cost import bodies, start_server
from engines import on_backend, us_per_request
from fast_server import WORDS

from batchrun.backends.answers import StreamedAnswer
from batchrun.backends.frames import Frame, plain_text
from batchrun.backends.sse import SEPARATOR

Feed = Callable[[StreamedAnswer, bytes], None]
FRAMES: list[Frame] = []  # the one frame "texts, unchecked" takes, from the first answer
# The models that take a run whole: its texts, between the answer's first and its last (which has
# the finish reason), as text and as native code would hand them over (JSON, a DEL between each
# two, quoted). Set in main() for --tokens.
RUN_PIECES = 0
RUN_TEXT = ""
RUN_QUOTED = b""


def every_event(answer: StreamedAnswer, chunk: bytes) -> None:
    answer.frames_left = 0
    BATCHRUN(answer, chunk)


def texts_unchecked(answer: StreamedAnswer, chunk: bytes) -> None:
    datas = answer._decoder.take(chunk).split(SEPARATOR)
    datas[0] = datas[0][6:]
    first = orjson.loads(datas[0])
    answer._chunk(first)
    if not FRAMES:
        frame = Frame.of(datas[0], plain_text(first, "chat") or "", "chat")
        assert frame is not None, "the server's events make no frame"
        FRAMES.append(frame)
    end, frame = len(datas) - 3, FRAMES[0]  # the last: finish reason, usage, [DONE]
    insides = [data[len(frame.head) : -len(frame.tail)] for data in datas[1:end]]
    answer.pieces.append(orjson.loads(b'"' + b"".join(insides) + b'"'))
    answer.texts += len(insides)
    for data in datas[end:-1]:
        answer._chunk(orjson.loads(data))
    answer.events, answer.done, answer.saw_choice = len(datas), True, True
    answer._arrived(answer.texts)


def compiled_run(answer: StreamedAnswer, chunk: bytes) -> None:
    text = answer._decoder.take(chunk)
    first = text.find(b"\n\n")
    data = text[6:first]
    parsed = orjson.loads(data)
    answer._chunk(parsed)
    frame = Frame.of(data, plain_text(parsed, "chat") or "", "chat")
    assert frame is not None, "the server's events make no frame"
    joined = orjson.loads(RUN_QUOTED)  # what native code would hand over, decoded and checked
    if joined.count("\x7f") != RUN_PIECES - 1:
        raise AssertionError("a text holds a DEL")
    answer.pieces.append(joined.replace("\x7f", ""))
    answer.texts += RUN_PIECES
    _last_two(answer, text)


def run_free(answer: StreamedAnswer, chunk: bytes) -> None:
    text = answer._decoder.take(chunk)
    first = text.find(b"\n\n")
    answer._chunk(orjson.loads(text[6:first]))
    answer.pieces.append(RUN_TEXT)
    answer.texts += RUN_PIECES
    _last_two(answer, text)


def _last_two(answer: StreamedAnswer, text: bytes) -> None:
    """The last two events parsed (the last text, with the finish reason; usage), and the
    answer ended, as the models that take a run whole do."""
    usage = text.rfind(SEPARATOR, 0, text.rfind(SEPARATOR))  # the last: usage, [DONE]
    finish = text.rfind(SEPARATOR, 0, usage)
    answer._chunk(orjson.loads(text[finish + len(SEPARATOR) : usage]))
    answer._chunk(orjson.loads(text[usage + len(SEPARATOR) : text.rfind(SEPARATOR)]))
    answer.events, answer.done, answer.saw_choice = RUN_PIECES + 4, True, True
    answer._arrived(answer.texts)


def not_read(answer: StreamedAnswer, chunk: bytes) -> None:
    answer.pieces, answer.finish, answer.saw_choice = ["x"], "stop", True
    answer.events, answer.done = 1, True


BATCHRUN = StreamedAnswer.feed
READERS: dict[str, Feed] = {
    "batchrun": BATCHRUN,
    "every event parsed": every_event,
    "texts, unchecked": texts_unchecked,
    "compiled run": compiled_run,
    "run free": run_free,
    "not read": not_read,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=30)
    args = parser.parse_args()
    gc.freeze()  # the collector as the `batchrun` command sets it (batchrun/__main__.py)
    gc.set_threshold(10_000)
    global RUN_PIECES, RUN_TEXT, RUN_QUOTED
    texts = [" " + WORDS[i % len(WORDS)] for i in range(1, args.tokens - 1)]  # as fast_server's
    RUN_PIECES, RUN_TEXT = len(texts), "".join(texts)
    RUN_QUOTED = b'"' + b"\x7f".join(orjson.dumps(text)[1:-1] for text in texts) + b'"'
    server, base = start_server(args.tokens)
    url, loop = base + "/chat/completions", on_backend(lambda _: None)
    times: dict[str, list[float]] = {}
    try:
        for _ in range(args.repeat):  # alternated, so the machine's drift falls on all
            plain = us_per_request(loop, url, bodies(args.requests, False), False)
            times.setdefault("not streamed", []).append(plain)
            for name, feed in READERS.items():
                StreamedAnswer.feed = feed  # type: ignore[method-assign]
                streamed = us_per_request(loop, url, bodies(args.requests, True), True)
                times.setdefault(name, []).append(streamed)
    finally:
        StreamedAnswer.feed = BATCHRUN  # type: ignore[method-assign]
        server.terminate()
        server.wait()
    print(
        f"{args.requests} chat requests of {args.tokens} tokens, 32 in flight, one write an"
        f" answer; client CPU us a request, median of {args.repeat}"
    )
    base_us = statistics.median(times["not streamed"])
    print(f"{'read as':20} {'us/req':>7} {'streaming adds':>15} {'not/streamed':>13}")
    for name, runs in times.items():
        us = statistics.median(runs)
        print(f"{name:20} {us:7.1f} {us - base_us:15.1f} {base_us / us:13.2f}")


if __name__ == "__main__":
    main()
