"""An OpenAI-compatible test server with a chosen capacity shape, written apart from batchrun.

Why it exists: `benchmarks/concurrency_matrix.py` judges `--concurrency auto` against servers
whose shape is known. batchrun's own simulator (`batchrun sim`) comes from the same hands as
the controller, so a controller could end up fitted to its quirks; this is a second, small and
deliberately plain model of how an inference server schedules work. It imports nothing from
batchrun (only the standard library) and keeps all time on the event loop's clock.

    python benchmarks/shape_server.py --shape knee8 --port 0     # prints "serving URL ..."
    python benchmarks/shape_server.py --list-shapes

Endpoints: POST /v1/chat/completions and /v1/completions, streamed (SSE `data:` lines, a final
chunk with finish_reason, a usage chunk when `stream_options.include_usage`, `data: [DONE]`)
or not; GET /v1/models; GET /stats (what happened, by outcome, and the settings). HTTP/1.1
with keep-alive; binds 127.0.0.1 only.

The model, in the order a request meets it:

  faults -> hosted budgets -> gate -> slot queue -> prefill -> decode -> answer

- Output: n tokens (words), n drawn from --min-tokens..--max-tokens by a hash of the seed and
  the prompt, so a prompt always gets the same answer length; capped by the request's
  max_tokens (finish_reason "length" then, else "stop").
- Faults (--fault-429/500/503/reset/cut RATE): drawn per request from a hash of the seed, the
  prompt and how many times that prompt has arrived, so a run's faults do not depend on the
  order requests arrive in. 429 comes with Retry-After (--retry-after); reset closes the
  connection before any answer; cut breaks the answer off halfway. Independent of load.
- Hosted budgets (--rpm, --tpm): token buckets that refill continuously at limit/60 a second
  and hold --rate-window-s seconds of budget (60: a minute's worth; less: the limit enforced in
  smaller quanta, as OpenAI says it may). A request costs 1 request and its prompt tokens
  plus its max_tokens, charged when admitted. Every answer carries OpenAI's headers:
  x-ratelimit-limit-* (per minute), -remaining-* (what the bucket holds now), -reset-* (time
  until it is full, as "1s", "250ms", "6m0s"); a request the bucket cannot pay gets 429 with
  those headers and Retry-After (whole seconds, like Groq).
- Gate (--gate N): a request arriving while N are in flight (queued, prefilling or decoding)
  gets 429 at once with Retry-After (--retry-after).
- Slots (--slots S): at most S requests prefill or decode at once (vLLM's max_num_seqs); the
  rest wait in arrival order, so their time to first token grows with the queue.
- Prefill (--prefill-ms P, --prefill-growth g): processor sharing. With m prefills running,
  each advances at 1/(1 + g(m-1)) of its solo speed: alone it takes P ms, m together take
  P(1 + g(m-1)) ms each. g=0: prefills never slow each other. The end of the prefill gives the
  first token.
- Decode (--tpot-ms T, --knee K): continuous batching. One engine step gives every decoding
  sequence one token and takes T * max(1, n/K) ms with n sequences, so token throughput grows
  with n up to the knee K and is flat past it, each token slower in proportion. A request that
  finishes its prefill joins at the next step.
- Streaming sends the first token at once, then a chunk every --stream-interval tokens (vLLM's
  --stream-interval) and at the end; fewer chunks keep a 2-core machine from being the limit.
  The transport's write buffer is not awaited: the clients here read as fast as it writes.

The shapes the matrix judges against are the presets in SHAPES below, each with a line on
what it models; `--shape NAME` loads one (flags given after it win), `--list-shapes` prints
them all with their flags.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import math
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

HOST = "127.0.0.1"
FAULT_KINDS = ("429", "500", "503", "reset", "cut")
MAX_HEAD = 64 * 1024
MAX_BODY = 8 * 1024 * 1024
WORDS = ("the", "model", "says", "plain", "words", "so", "counts", "stay", "easy", "to", "check")


@dataclass(frozen=True)
class ShapePreset:
    """One server shape: what it models, and the flags (argparse names) that make it."""

    doc: str
    flags: dict[str, Any]


# Per-token times are chosen so that the best fixed concurrency finishes the matrix's job
# (500-600 items of ~45 tokens) in ~10 s on a 2-core machine, with the server, not the CPUs,
# as the limit: ~2,000 tokens/s in ~500 SSE chunks/s at a stream interval of 4.
SHAPES: dict[str, ShapePreset] = {
    "knee8": ShapePreset(
        "continuous batching, knee 8: throughput grows to 8 in flight and is flat past it "
        "(each token slower in proportion); past 32 requests queue for a slot",
        {"knee": 8, "slots": 32, "tpot_ms": 3.5, "prefill_ms": 20.0, "stream_interval": 4},
    ),
    "knee24": ShapePreset(
        "continuous batching, knee 24, queue past 96",
        {"knee": 24, "slots": 96, "tpot_ms": 12.0, "prefill_ms": 40.0, "stream_interval": 4},
    ),
    "knee64": ShapePreset(
        "continuous batching, knee 64, queue past 256",
        {"knee": 64, "slots": 256, "tpot_ms": 30.0, "prefill_ms": 50.0, "stream_interval": 4},
    ),
    "prefill": ShapePreset(
        "time to first token grows with concurrent prefills: 40 ms alone, +50% per other "
        "prefill running (throughput of prefills tends to 2x a lone one's); decode roomy "
        "(no knee, 20 ms/token)",
        {"prefill_ms": 40.0, "prefill_growth": 0.5, "tpot_ms": 20.0, "stream_interval": 4},
    ),
    "gate429": ShapePreset(
        "a hard gate: past 24 in flight, 429 at once with Retry-After: 1; behind it a "
        "roomy server (knee 64, 10 ms/token)",
        {"gate": 24, "knee": 64, "tpot_ms": 10.0, "prefill_ms": 30.0, "stream_interval": 4},
    ),
    "faults": ShapePreset(
        "~10% scattered faults, independent of load: 2% 429 (Retry-After: 1), 1% 500, "
        "1% 503, 3% resets before any answer, 3% streams cut halfway; knee 32, 15 ms/token",
        {
            "knee": 32,
            "slots": 128,
            "tpot_ms": 15.0,
            "prefill_ms": 30.0,
            "stream_interval": 4,
            "fault_429": 0.02,
            "fault_500": 0.01,
            "fault_503": 0.01,
            "fault_reset": 0.03,
            "fault_cut": 0.03,
        },
    ),
    "hosted": ShapePreset(
        "hosted API: 3,000 requests and 180,000 tokens a minute (the tokens bind: ~40 "
        "requests/s at ~75 tokens each) enforced over 2 s buckets, x-ratelimit-* headers, "
        "429 when spent; roomy behind (15 ms/token)",
        {
            "rpm": 3000,
            "tpm": 180000,
            "rate_window_s": 2.0,
            "tpot_ms": 15.0,
            "prefill_ms": 30.0,
            "stream_interval": 4,
        },
    ),
    "long": ShapePreset(
        "long requests: 30-50 tokens at 125 ms each (5 s end to end alone), knee 64, queue past 96",
        {"knee": 64, "slots": 96, "tpot_ms": 125.0, "prefill_ms": 100.0, "stream_interval": 1},
    ),
}


# --- requests and answers -------------------------------------------------------------------


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    @property
    def keep_alive(self) -> bool:
        return self.headers.get("connection", "").lower() != "close"


async def read_request(reader: asyncio.StreamReader) -> Request | None:
    """The next request on a connection; None when the client closed it between requests."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, target, _version = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    if length > MAX_BODY:
        raise ValueError("body too large")
    body = await reader.readexactly(length) if length else b""
    return Request(method, target.split("?", 1)[0], headers, body)


REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 429: "Too Many Requests"}
REASONS |= {500: "Internal Server Error", 503: "Service Unavailable"}


def response_head(status: int, headers: dict[str, str]) -> bytes:
    lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def json_response(status: int, payload: Any, headers: dict[str, str] | None = None) -> bytes:
    body = json.dumps(payload).encode()
    head = {"content-type": "application/json", "content-length": str(len(body))}
    return response_head(status, {**head, **(headers or {})}) + body


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> bytes:
    kind = "rate_limit_exceeded" if status == 429 else "server_error"
    return json_response(status, {"error": {"message": message, "code": kind}}, headers)


def http_chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def sse(payload: Any) -> bytes:
    return http_chunk(b"data: " + json.dumps(payload).encode() + b"\n\n")


SSE_DONE = http_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"


def prompt_text(body: dict[str, Any]) -> str:
    """What the request asks, as one string: the messages' text or the prompt."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = [m.get("content") for m in messages if isinstance(m, dict)]
        return "\n".join(p if isinstance(p, str) else json.dumps(p) for p in parts)
    prompt = body.get("prompt", "")
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def unit_hash(*parts: object) -> float:
    """A number in [0, 1) fixed by the parts: the same request draws the same fate."""
    digest = hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def reset_duration(seconds: float) -> str:
    """OpenAI's style for x-ratelimit-reset-*: "250ms", "1.5s", "6m0s"."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    if seconds < 60:
        return f"{seconds:.3g}s"
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)}m{rest:.0f}s"


# --- hosted budgets -------------------------------------------------------------------------


class Budget:
    """A per-minute limit as a bucket refilling at limit/60 a second, holding window_s of it."""

    def __init__(self, per_minute: float, window_s: float, now: float) -> None:
        self.per_minute = per_minute
        self.rate = per_minute / 60
        self.size = max(1.0, self.rate * window_s)
        self.level = self.size
        self.at = now

    def refill(self, now: float) -> None:
        self.level = min(self.size, self.level + (now - self.at) * self.rate)
        self.at = now

    def wait_for(self, amount: float) -> float:
        """Seconds until the bucket holds `amount` (or is full, if it never can)."""
        return max(0.0, (min(amount, self.size) - self.level) / self.rate)

    def headers(self, name: str) -> dict[str, str]:
        return {
            f"x-ratelimit-limit-{name}": str(int(self.per_minute)),
            f"x-ratelimit-remaining-{name}": str(max(0, math.floor(self.level))),
            f"x-ratelimit-reset-{name}": reset_duration((self.size - self.level) / self.rate),
        }


# --- the engine -----------------------------------------------------------------------------


@dataclass(eq=False)
class Sequence:
    """One admitted request on its way through the queue, prefill and decode."""

    writer: asyncio.StreamWriter
    chat: bool
    stream: bool
    usage_chunk: bool
    words: list[str]
    finish_reason: str
    prompt_tokens: int
    model: str
    ident: str
    cut_at: int | None  # break the answer off after this many tokens
    done: asyncio.Future[str]
    state: str = "queued"
    prefill_left_ms: float = 0.0
    tokens: int = 0
    sent: int = 0

    def chunk(self, text: str | None, finish: str | None = None) -> dict[str, Any]:
        if self.chat:
            delta = {} if text is None else {"content": text}
            if self.sent == 0 and text is not None:
                delta["role"] = "assistant"
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
            kind = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            kind = "text_completion"
        return self.envelope(kind, [choice])

    def envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.ident,
            "object": kind,
            "created": int(time.time()),
            "model": self.model,
            "choices": choices,
        }

    def usage(self) -> dict[str, int]:
        out = len(self.words)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": out,
            "total_tokens": self.prompt_tokens + out,
        }

    def answer(self) -> dict[str, Any]:
        """The whole answer, for a request that did not ask for a stream."""
        text = "".join(self.words)
        if self.chat:
            message = {"role": "assistant", "content": text}
            choice: dict[str, Any] = {"index": 0, "message": message}
        else:
            choice = {"index": 0, "text": text, "logprobs": None}
        choice["finish_reason"] = self.finish_reason
        kind = "chat.completion" if self.chat else "text_completion"
        return {**self.envelope(kind, [choice]), "usage": self.usage()}

    def write(self, data: bytes) -> bool:
        """Send bytes; False when the client has gone (a write failed or it hung up)."""
        if self.writer.transport.is_closing():
            return False
        self.writer.write(data)
        return True


class Engine:
    """Slots, processor-sharing prefill and a continuous-batching decode loop (see the top)."""

    def __init__(self, cfg: argparse.Namespace, stats: Counter[str]) -> None:
        self.cfg = cfg
        self.stats = stats
        self.queue: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []
        self.decoding: list[Sequence] = []
        self.loop = asyncio.get_running_loop()
        self._prefill_at = self.loop.time()
        self._prefill_wake = asyncio.Event()
        self._decode_wake = asyncio.Event()
        self.tasks = [
            asyncio.create_task(self._prefill_loop()),
            asyncio.create_task(self._decode_loop()),
        ]

    @property
    def in_flight(self) -> int:
        return len(self.queue) + len(self.prefilling) + len(self.decoding)

    def submit(self, seq: Sequence) -> None:
        self.queue.append(seq)
        self.stats["max_in_flight"] = max(self.stats["max_in_flight"], self.in_flight)
        self._admit()

    def _admit(self) -> None:
        """Move queued requests into free slots, where their prefill starts."""
        slots = self.cfg.slots or math.inf
        while self.queue and len(self.prefilling) + len(self.decoding) < slots:
            seq = self.queue.popleft()
            self._advance_prefill()
            seq.state = "prefill"
            seq.prefill_left_ms = self.cfg.prefill_ms
            self.prefilling.append(seq)
            self._prefill_wake.set()

    # prefill: processor sharing, event-driven

    def _prefill_speed(self) -> float:
        """Solo-prefill milliseconds each running prefill gets done per millisecond."""
        return 1.0 / (1.0 + self.cfg.prefill_growth * max(0, len(self.prefilling) - 1))

    def _advance_prefill(self) -> None:
        """Credit the running prefills with the work done since the last change."""
        now = self.loop.time()
        work = (now - self._prefill_at) * 1000 * self._prefill_speed()
        for seq in self.prefilling:
            seq.prefill_left_ms -= work
        self._prefill_at = now

    async def _prefill_loop(self) -> None:
        while True:
            self._advance_prefill()
            ready = [s for s in self.prefilling if s.prefill_left_ms <= 1e-6]
            if ready:
                self.prefilling = [s for s in self.prefilling if s.prefill_left_ms > 1e-6]
                for seq in ready:
                    self._first_token(seq)
            self._prefill_wake.clear()
            if not self.prefilling:
                await self._prefill_wake.wait()
                continue
            left = min(s.prefill_left_ms for s in self.prefilling)
            delay = left / self._prefill_speed() / 1000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._prefill_wake.wait(), delay)

    def _first_token(self, seq: Sequence) -> None:
        seq.state = "decode"
        self._token(seq)
        if seq.state == "decode":
            self.decoding.append(seq)
            self._decode_wake.set()

    # decode: one token per sequence per step

    async def _decode_loop(self) -> None:
        next_at = self.loop.time()
        while True:
            if not self.decoding:
                self._decode_wake.clear()
                await self._decode_wake.wait()
                next_at = self.loop.time()
                continue
            batch = list(self.decoding)
            step = self.cfg.tpot_ms * max(1.0, len(batch) / (self.cfg.knee or math.inf)) / 1000
            next_at += step
            now = self.loop.time()
            if next_at < now - step:  # far behind (a busy CPU): skip ahead, do not burst
                next_at = now
            await asyncio.sleep(max(0.0, next_at - now))
            for seq in batch:
                if seq.state == "decode":
                    self._token(seq)

    def _token(self, seq: Sequence) -> None:
        """One more token for `seq`: maybe a chunk, maybe the end, maybe a fault's cut."""
        seq.tokens += 1
        if seq.cut_at is not None and seq.tokens >= seq.cut_at:
            self._end(seq, "cut")
            return
        last = seq.tokens >= len(seq.words)
        interval = self.cfg.stream_interval
        if seq.stream and (last or seq.tokens == 1 or (seq.tokens - 1) % interval == 0):
            text = "".join(seq.words[seq.sent : seq.tokens])
            if not seq.write(sse(seq.chunk(text))):
                self._end(seq, "client_gone")
                return
            seq.sent = seq.tokens
        if last:
            self._end(seq, "ok")

    def _end(self, seq: Sequence, outcome: str) -> None:
        """Take `seq` out of the engine, free its slot and tell its connection how it ended."""
        if seq.state == "decode":
            self.decoding.remove(seq)
        seq.state = "done"
        self.stats[outcome] += 1
        if outcome == "ok":
            self.stats["tokens"] += len(seq.words)
            if seq.stream:
                tail = sse(seq.chunk(None, seq.finish_reason))
                if seq.usage_chunk:
                    tail += sse({**seq.envelope("chat.completion.chunk", []), "usage": seq.usage()})
                seq.write(tail + SSE_DONE)
        elif outcome == "cut" and seq.stream:
            seq.writer.close()  # what was sent gets there; the chunked body never ends
        if not seq.done.done():
            seq.done.set_result(outcome)
        self._admit()


# --- the server -----------------------------------------------------------------------------


class ShapeServer:
    def __init__(self, cfg: argparse.Namespace) -> None:
        self.cfg = cfg
        self.stats: Counter[str] = Counter()
        self.arrivals: Counter[str] = Counter()  # per prompt, for the fault draw
        self.engine: Engine | None = None
        self.budgets: dict[str, Budget] = {}
        self.started = time.time()

    async def serve(self) -> None:
        self.engine = Engine(self.cfg, self.stats)
        now = asyncio.get_running_loop().time()
        if self.cfg.rpm:
            self.budgets["requests"] = Budget(self.cfg.rpm, self.cfg.rate_window_s, now)
        if self.cfg.tpm:
            self.budgets["tokens"] = Budget(self.cfg.tpm, self.cfg.rate_window_s, now)
        server = await asyncio.start_server(
            # a deep backlog: 256 clients connecting at once must not wait out SYN retries
            self.connection,
            HOST,
            self.cfg.port,
            limit=MAX_HEAD,
            backlog=1024,
        )
        port = server.sockets[0].getsockname()[1]
        print(f"serving http://{HOST}:{port}/v1 shape={self.cfg.shape or 'custom'}", flush=True)
        async with server:
            await server.serve_forever()

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                request = await read_request(reader)
                if request is None or not await self.dispatch(request, writer):
                    break
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        except ValueError:
            with contextlib.suppress(ConnectionError):
                writer.write(error_response(400, "malformed request"))
        finally:
            writer.close()

    async def dispatch(self, request: Request, writer: asyncio.StreamWriter) -> bool:
        """Answer one request; False when the connection should close afterwards."""
        if request.method == "GET" and request.path in ("/v1/models", "/models"):
            writer.write(json_response(200, self.models()))
        elif request.method == "GET" and request.path in ("/stats", "/health"):
            writer.write(json_response(200, self.report()))
        elif request.method == "POST" and request.path.endswith("/chat/completions"):
            return await self.complete(request, writer, chat=True)
        elif request.method == "POST" and request.path.endswith("/completions"):
            return await self.complete(request, writer, chat=False)
        else:
            writer.write(error_response(404, f"no route {request.method} {request.path}"))
        return request.keep_alive

    def models(self) -> dict[str, Any]:
        model = {"id": self.cfg.model, "object": "model", "owned_by": "shape-server"}
        return {"object": "list", "data": [model]}

    def report(self) -> dict[str, Any]:
        in_flight = self.engine.in_flight if self.engine else 0
        return {
            "uptime_s": round(time.time() - self.started, 3),
            "in_flight": in_flight,
            "stats": dict(self.stats),
            "settings": vars(self.cfg),
        }

    async def complete(self, request: Request, writer: asyncio.StreamWriter, *, chat: bool) -> bool:
        try:
            body = json.loads(request.body)
            if not isinstance(body, dict):
                raise ValueError
        except ValueError:
            writer.write(error_response(400, "the body is not a JSON object"))
            return request.keep_alive
        self.stats["requests"] += 1
        text = prompt_text(body)
        fault = self.fault(text)
        if fault == "reset":
            writer.transport.abort()
            return False
        refusal = self.fault_response(fault) or self.spend(text, body) or self.gate()
        if refusal is not None:
            writer.write(refusal)
            return request.keep_alive
        seq = self.sequence(text, body, writer, chat=chat, cut=fault == "cut")
        if seq.stream:
            head = {"content-type": "text/event-stream", "cache-control": "no-cache"}
            head |= {"transfer-encoding": "chunked", **self.rate_headers()}
            writer.write(response_head(200, head))
        assert self.engine is not None
        self.engine.submit(seq)
        outcome = await seq.done
        if outcome == "ok" and not seq.stream:
            writer.write(json_response(200, seq.answer(), self.rate_headers()))
        elif outcome == "cut" and not seq.stream:
            whole = json_response(200, seq.answer())
            writer.write(whole[: len(whole) // 2])
            writer.close()
        return outcome == "ok" and request.keep_alive

    def sequence(
        self,
        text: str,
        body: dict[str, Any],
        writer: asyncio.StreamWriter,
        *,
        chat: bool,
        cut: bool,
    ) -> Sequence:
        """The admitted request: its answer's words, fixed by the seed and the prompt."""
        cfg = self.cfg
        span = cfg.max_tokens - cfg.min_tokens + 1
        n = cfg.min_tokens + int(unit_hash(cfg.seed, "length", text) * span)
        asked = body.get("max_tokens") or body.get("max_completion_tokens")
        capped = isinstance(asked, int) and 0 < asked < n
        n = asked if capped else n
        words = [" " + WORDS[int(unit_hash(cfg.seed, text, i) * len(WORDS))] for i in range(n)]
        options = body.get("stream_options")
        self.stats["admitted"] += 1
        return Sequence(
            writer=writer,
            chat=chat,
            stream=bool(body.get("stream")),
            usage_chunk=isinstance(options, dict) and bool(options.get("include_usage")),
            words=words,
            finish_reason="length" if capped else "stop",
            prompt_tokens=prompt_tokens(text),
            model=str(body.get("model") or cfg.model),
            ident=f"{'chatcmpl' if chat else 'cmpl'}-{self.stats['admitted']}",
            cut_at=max(2, n // 2) if cut else None,
            done=asyncio.get_running_loop().create_future(),
        )

    def fault(self, text: str) -> str | None:
        """This arrival's injected fault (429, 500, 503, reset, cut), if it draws one."""
        cfg = self.cfg
        self.arrivals[text] += 1
        draw = unit_hash(cfg.seed, "fault", text, self.arrivals[text])
        for kind in FAULT_KINDS:
            rate = getattr(cfg, f"fault_{kind}")
            if draw < rate:
                self.stats[f"fault_{kind}"] += 1
                return kind
            draw -= rate
        return None

    def fault_response(self, fault: str | None) -> bytes | None:
        """The answer an HTTP-status fault gives at once (the others need the connection)."""
        if fault not in ("429", "500", "503"):
            return None
        wait = {"retry-after": f"{self.cfg.retry_after:g}"} if fault == "429" else {}
        return error_response(int(fault), f"injected fault {fault}", wait)

    def spend(self, text: str, body: dict[str, Any]) -> bytes | None:
        """Charge the hosted budgets; a 429 with the budget's headers if one cannot pay."""
        if not self.budgets:
            return None
        now = asyncio.get_running_loop().time()
        asked = body.get("max_tokens") or body.get("max_completion_tokens")
        out = asked if isinstance(asked, int) and asked > 0 else self.cfg.max_tokens
        costs = {"requests": 1.0, "tokens": float(prompt_tokens(text) + out)}
        for budget in self.budgets.values():
            budget.refill(now)
        short = {k: b.wait_for(costs[k]) for k, b in self.budgets.items() if b.level < costs[k]}
        if short:
            self.stats["budget_429"] += 1
            name, wait = max(short.items(), key=lambda kv: kv[1])
            headers = {**self.rate_headers(), "retry-after": str(max(1, math.ceil(wait)))}
            return error_response(429, f"Rate limit reached for {name} per minute", headers)
        for name, budget in self.budgets.items():
            budget.level -= costs[name]
        return None

    def rate_headers(self) -> dict[str, str]:
        headers: dict[str, str] = {}
        for name, budget in self.budgets.items():
            headers |= budget.headers(name)
        return headers

    def gate(self) -> bytes | None:
        assert self.engine is not None
        if self.cfg.gate is None or self.engine.in_flight < self.cfg.gate:
            return None
        self.stats["gate_429"] += 1
        wait = {"retry-after": f"{self.cfg.retry_after:g}"}
        return error_response(429, f"server busy: {self.cfg.gate} requests in flight", wait)


def prompt_tokens(text: str) -> int:
    """A tokenizer-free count: about four characters a token."""
    return max(1, round(len(text) / 4))


# --- command line ---------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), help="load a shape's settings first")
    p.add_argument("--list-shapes", action="store_true", help="print the shapes and exit")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (printed)")
    p.add_argument("--model", default="shape-1")
    p.add_argument("--seed", type=int, default=0, help="answer lengths, words and faults")
    p.add_argument("--min-tokens", type=int, default=30, help="shortest answer")
    p.add_argument("--max-tokens", type=int, default=60, help="longest answer")
    p.add_argument("--stream-interval", type=int, default=1, help="tokens per streamed chunk")
    p.add_argument("--slots", type=int, help="most requests prefilling or decoding at once")
    p.add_argument("--knee", type=int, help="batch size past which decode steps slow down")
    p.add_argument("--tpot-ms", type=float, default=20.0, help="decode step at or below knee")
    p.add_argument("--prefill-ms", type=float, default=50.0, help="a prefill running alone")
    p.add_argument("--prefill-growth", type=float, default=0.0, help="per other prefill")
    p.add_argument("--gate", type=int, help="429 at once with this many in flight")
    p.add_argument("--retry-after", type=float, default=1.0, help="seconds, on 429s")
    p.add_argument("--rpm", type=float, help="hosted budget: requests a minute")
    p.add_argument("--tpm", type=float, help="hosted budget: tokens a minute")
    p.add_argument("--rate-window-s", type=float, default=60.0, help="budget held, seconds")
    for kind in FAULT_KINDS:
        p.add_argument(f"--fault-{kind}", type=float, default=0.0, metavar="RATE")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Flags over the chosen shape's settings over the defaults."""
    p = parser()
    first, _ = p.parse_known_args(argv)
    if first.shape:
        p.set_defaults(**SHAPES[first.shape].flags)
    args = p.parse_args(argv)
    if args.min_tokens < 1 or args.max_tokens < args.min_tokens or args.stream_interval < 1:
        p.error("need 1 <= --min-tokens <= --max-tokens and --stream-interval >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.list_shapes:
        for name, shape in SHAPES.items():
            flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in shape.flags.items())
            print(f"{name}: {shape.doc}\n    {flags}")
        return
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(ShapeServer(args).serve())


if __name__ == "__main__":
    main()
