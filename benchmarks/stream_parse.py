"""What reading a streamed answer's events costs, in process: framed against event by event.

Feeds the same streamed answer (SSE bytes as servers write them) through batchrun's decoder and
answer (backends/sse.py, answers.py) in two ways: with frames, as batchrun reads (events that
differ only in their text read as their texts alone, backends/frames.py), and event by event
(every event parsed to an object, as before frames). Each as the whole answer in one network
read (a client behind its server) and as a read per event (a server writing token by token,
the client keeping up). Four server shapes:

- openai: OpenAI's field order, one id and time for the whole answer (vLLM, SGLang, fast_server);
- llama-server: llama.cpp's order (choices first, then time, id, model, fingerprint);
- role-first: a first event with the role and empty text, a last with the finish reason;
- per-event field: a field that changes every event (OpenAI's `obfuscation`): no frame fits,
  so this is what trying costs.

It also feeds one event of `--big-mb` megabytes in 4 KiB reads, against the same bytes in one
read: the decoder holds an unfinished event's reads in a list and joins them once, so the two
stay close at any size (joining on every read made this quadratic: 24 s for 16 MB).

    python benchmarks/stream_parse.py [--tokens 30] [--answers 3000] [--repeat 5] [--big-mb 16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import orjson

from batchrun.backends.answers import StreamedAnswer
from batchrun.backends.sse import SSEDecoder

WORDS = [" the", " quick", " brown", " fox", "\n", ' "said"', " caf\u00e9", " over"]


def chunk(shape: str, n: int, text: str | None, finish: str | None) -> dict[str, object]:
    delta: dict[str, object] = {} if text is None else {"content": text}
    if shape == "role-first" and n == 0:
        delta = {"role": "assistant", "content": ""}
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    if shape == "llama-server":
        head = {"choices": [choice], "created": 1733000000, "id": "chatcmpl-ab12"}
        return {**head, "model": "m", "system_fingerprint": "b4000", "object": "chunk"}
    event = {"id": "chatcmpl-ab12", "object": "chat.completion.chunk", "created": 1733000000}
    event |= {"model": "m", "choices": [choice]}
    if shape == "per-event field":
        event["obfuscation"] = f"x{n:04d}"
    return event


def answer_events(shape: str, tokens: int) -> list[bytes]:
    events = [chunk(shape, 0, None, None)] if shape == "role-first" else []
    events += [chunk(shape, i + 1, WORDS[i % len(WORDS)], None) for i in range(tokens)]
    events.append(chunk(shape, tokens + 1, None, "stop"))
    datas = [orjson.dumps(event) for event in events] + [b"[DONE]"]
    return [b"data: " + data + b"\n\n" for data in datas]


def read(reads: list[bytes], frames: bool) -> str:
    answer = StreamedAnswer("chat", 0.0, None)
    if not frames:
        answer.frames_left = 0
    for data in reads:
        answer.feed(data)
    return answer.completion().text


def per_answer_us(reads: list[bytes], frames: bool, answers: int) -> float:
    started = time.perf_counter()
    for _ in range(answers):
        read(reads, frames)
    return (time.perf_counter() - started) / answers * 1e6


def big_event_s(size: int, read: int) -> float:
    body = b"data: " + b"x" * size + b"\n\n"
    started, decoder = time.perf_counter(), SSEDecoder()
    for at in range(0, len(body), read):
        decoder.feed(body[at : at + read])
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=30)
    parser.add_argument("--answers", type=int, default=3000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--big-mb", type=int, default=16)
    args = parser.parse_args()
    print(f"an answer of {args.tokens} tokens; us an answer, median of {args.repeat}")
    print(f"{'server shape':16} {'reads':9} {'by event':>9} {'framed':>8} {'framed/by event':>16}")
    for shape in ("openai", "llama-server", "role-first", "per-event field"):
        events = answer_events(shape, args.tokens)
        for reads_name, reads in (("one", [b"".join(events)]), ("per event", events)):
            assert read(reads, True) == read(reads, False)
            times: dict[bool, list[float]] = {True: [], False: []}
            for i in range(args.repeat):  # alternated, so drift falls on both
                for frames in (i % 2 == 0, i % 2 == 1):
                    times[frames].append(per_answer_us(reads, frames, args.answers))
            old, new = statistics.median(times[False]), statistics.median(times[True])
            print(f"{shape:16} {reads_name:9} {old:9.1f} {new:8.1f} {new / old:16.2f}")
    size = args.big_mb << 20
    whole, reads = big_event_s(size, size + 8), big_event_s(size, 4096)
    print(f"one event of {args.big_mb} MB: in one read {whole:.3f}s, in 4 KiB reads {reads:.3f}s")


if __name__ == "__main__":
    main()
