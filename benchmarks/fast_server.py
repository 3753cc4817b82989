"""A zero-latency OpenAI-compatible server that costs as little CPU as a Python server can.

For measuring clients (benchmarks/client_cost.py): every answer is made once, at start, and
written back in one go, so the server's own cost per request is a header parse and a write.
It shares nothing with batchrun (stdlib only) and speaks plain HTTP/1.1 with keep-alive:

- POST /v1/chat/completions, /v1/completions: `--tokens` words; streamed (`"stream": true`
  in the body) as one SSE event per token, a usage event (when stream_options asks) and
  `data: [DONE]`, in chunked transfer encoding, as llama-server and vLLM send them: all in
  one write, or with `--token-ms T` a write per token, T ms apart, as an engine does;
- GET /v1/models.

    python benchmarks/fast_server.py [--port 0] [--tokens 30] [--token-ms 0]

It prints `listening on http://127.0.0.1:PORT/v1` once ready and serves until killed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "again"]


def _head(status: str, content_type: str, length: int | None) -> bytes:
    size = f"content-length: {length}" if length is not None else "transfer-encoding: chunked"
    return (f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\n{size}\r\n\r\n").encode()


def _chunked(body: bytes) -> bytes:
    return f"{len(body):x}\r\n".encode() + body + b"\r\n"


class Answers:
    """Every response this server gives, prepared once."""

    def __init__(self, tokens: int) -> None:
        words = [" " + WORDS[i % len(WORDS)] for i in range(tokens)]
        usage = {"prompt_tokens": 12, "completion_tokens": tokens, "total_tokens": tokens + 12}
        base = {"id": "cmpl-fast", "created": 1700000000, "model": "fast-1"}
        chat = {
            **base,
            "object": "chat.completion",
            "usage": usage,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(words)},
                    "finish_reason": "stop",
                }
            ],
        }
        text = {
            **base,
            "object": "text_completion",
            "usage": usage,
            "choices": [{"index": 0, "text": "".join(words), "finish_reason": "stop"}],
        }
        self.plain = {True: self._json(chat), False: self._json(text)}
        self.streamed = {
            (chat_, with_usage): self._stream(base, words, usage if with_usage else None, chat_)
            for chat_ in (True, False)
            for with_usage in (True, False)
        }
        models = {"object": "list", "data": [{"id": "fast-1", "object": "model"}]}
        self.models = self._json(models)
        self.not_found = _head("404 Not Found", "application/json", 2) + b"{}"

    @staticmethod
    def _json(payload: object) -> bytes:
        body = json.dumps(payload, separators=(",", ":")).encode()
        return _head("200 OK", "application/json", len(body)) + body

    @staticmethod
    def _stream(base: dict, words: list[str], usage: dict | None, chat: bool) -> list[bytes]:
        """The answer's writes when sent token by token: the head with the first token, one
        write per later token, and the last with the usage event, [DONE] and the body's end."""
        kind = "chat.completion.chunk" if chat else "text_completion"
        events = []
        for i, word in enumerate(words):
            last = i == len(words) - 1
            piece = {"delta": {"content": word}} if chat else {"text": word}
            choice = {"index": 0, **piece, "finish_reason": "stop" if last else None}
            events.append({**base, "object": kind, "choices": [choice]})
        if usage is not None:
            events.append({**base, "object": kind, "choices": [], "usage": usage})
        parts = [
            _chunked(b"data: " + json.dumps(e, separators=(",", ":")).encode() + b"\n\n")
            for e in events
        ]
        end = _chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n"
        if usage is not None:
            end = parts.pop() + end
        parts[0] = _head("200 OK", "text/event-stream", None) + parts[0]
        parts[-1] += end
        return parts


class Connection(asyncio.Protocol):
    def __init__(self, answers: Answers, token_s: float) -> None:
        self.answers = answers
        self.token_s = token_s  # between a streamed answer's writes; 0: all in one write
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buffer[:end].decode("latin-1")
            length = 0
            for line in head.split("\r\n")[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if len(self.buffer) < end + 4 + length:
                return
            body = self.buffer[end + 4 : end + 4 + length]
            self.buffer = self.buffer[end + 4 + length :]
            writes = self.respond(head.split(" ", 2)[:2], body)
            if self.token_s and len(writes) > 1:  # a client sends again only once answered
                asyncio.get_running_loop().create_task(self.trickle(writes))
            else:
                assert self.transport is not None
                self.transport.write(b"".join(writes))

    async def trickle(self, writes: list[bytes]) -> None:
        """A streamed answer as an engine sends it: a write per token, `token_s` apart."""
        for i, part in enumerate(writes):
            if i:
                await asyncio.sleep(self.token_s)
            if self.transport is None or self.transport.is_closing():
                return
            self.transport.write(part)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    def respond(self, request_line: list[str], body: bytes) -> list[bytes]:
        method, path = request_line
        if method == "GET" and path.endswith("/models"):
            return [self.answers.models]
        chat = path.endswith("/chat/completions")
        if method != "POST" or not (chat or path.endswith("/completions")):
            return [self.answers.not_found]
        asked = json.loads(body)
        if asked.get("stream"):
            usage = bool((asked.get("stream_options") or {}).get("include_usage"))
            return self.answers.streamed[(chat, usage)]
        return [self.answers.plain[chat]]


async def serve(port: int, tokens: int, token_ms: float) -> None:
    answers = Answers(tokens)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: Connection(answers, token_ms / 1000), "127.0.0.1", port, backlog=1024
    )
    bound = server.sockets[0].getsockname()[1]
    print(f"listening on http://127.0.0.1:{bound}/v1", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--tokens", type=int, default=30, help="tokens (words) per answer")
    parser.add_argument(
        "--token-ms",
        type=float,
        default=0.0,
        help="stream token by token, this far apart (0: a whole answer in one write)",
    )
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.port, args.tokens, args.token_ms))


if __name__ == "__main__":
    main()
