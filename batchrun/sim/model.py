"""The simulator's pure model: given a request, decide the whole reply and its timing.

No I/O, and time only through an injected clock (the capacity model's queue; tests pass a fake
one) and the `created` stamp of an answer. A Reply says what to send and how long to wait before
each part; the httpx transport and the HTTP server both play the same Reply, so unit tests and
the real server behave alike. Output text is derived from the prompt (the same prompt always
gets the same answer, and the answer names the prompt's digest) and says it is synthetic.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from batchrun.sim.batches import SimBatches
from batchrun.sim.capacity import Capacity, Refusal
from batchrun.sim.faults import BODY_FAULTS, STATUS_FAULTS, FaultPlan, body_fault, status_fault
from batchrun.sim.json_answers import (
    DEFAULT_SCHEMA,
    is_repair,
    json_text,
    pick_style,
    pieces,
)
from batchrun.sim.prefix_cache import ServedPrefixCache
from batchrun.sim.words import WORDS
from batchrun.validate import schema_of


@dataclass(frozen=True)
class SimConfig:
    """Latency and behaviour of the simulated server. Times are in milliseconds."""

    ttft_ms: float = 0.0  # time to first token of an unloaded server
    prefill_ms_per_token: float = 0.0  # extra time to first token per prompt token
    tpot_ms: float = 0.0  # time per output token after the first
    min_output_tokens: int = 8
    max_output_tokens: int = 48
    api_key: str | None = None  # when set: `Authorization: Bearer <key>` or `x-api-key: <key>`
    models: tuple[str, ...] = ("sim-1",)
    strict_models: bool = False  # when True, an unknown model gets 404 like vLLM does
    faults: dict[str, float] = field(default_factory=dict)  # kind -> probability, see faults.py
    fault_seed: int = 0
    retry_after_ms: float = 50.0  # what a simulated 429 asks the client to wait
    # Capacity (see capacity.py): batch slots, decode slow-down in a full batch (tpot_ms grows by
    # this fraction at full slots), a gate past a queue length, hosted-API limits per minute.
    slots: int | None = None
    tpot_slope: float = 0.0
    queue_limit: int | None = None
    gate_status: int = 429
    rpm: int | None = None
    tpm: int | None = None
    # JSON answers (json_answers.py): styles by rate when no schema is sent, the schema the
    # "model" was told, whether repair follow-ups fix the answer, and a server that refuses
    # response_format with a 400 (as some do).
    json_styles: dict[str, float] = field(default_factory=dict)
    json_schema: dict[str, Any] | None = None
    repair_fixes: bool = True
    refuse_response_format: bool = False
    metrics: bool = True  # serve GET /metrics (vLLM's names); off: 404, like a server without it
    # Prefix cache (prefix_cache.py) in blocks of 64 tokens (256 characters); 0 turns it off.
    # 4096 blocks, about 262k tokens, is the order of the KV cache vLLM has for an 8B model on
    # one 80 GB GPU: a few hundred 1,000-token system prompts fit; long unique prompts evict.
    prefix_cache_blocks: int = 4096
    # The Batch API (batches.py): a batch's lines answered over `batch_seconds`, its "24h"
    # window `batch_window_s` seconds long, and the most lines an input file may hold.
    batch_seconds: float = 2.0
    batch_window_s: float = 60.0
    batch_max_requests: int = 50_000


@dataclass
class Reply:
    """What to answer. Non-streamed: `body` after `delay` seconds. Streamed: each event's bytes
    after its own delay (seconds since the previous event)."""

    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    delay: float = 0.0
    events: list[tuple[float, bytes]] | None = None
    # Played by the transport/server: "reset" (drop the connection before answering), "hang"
    # (never answer), "cut" (drop it after part of the body: events or `body` are that part).
    fault: str | None = None


def _json_reply(status: int, payload: Any, delay: float = 0.0) -> Reply:
    return Reply(status, {"content-type": "application/json"}, orjson.dumps(payload), delay)


def _error(status: int, message: str, kind: str) -> Reply:
    return _json_reply(status, {"error": {"message": message, "type": kind, "code": status}})


def _refused(refusal: Refusal) -> Reply:
    headers = {
        **refusal.headers,
        "content-type": "application/json",
        "retry-after": str(max(1, math.ceil(refusal.retry_after))),
        "retry-after-ms": f"{refusal.retry_after * 1000:.0f}",
    }
    body = {"error": {"message": refusal.message, "type": "rate_limit", "code": refusal.status}}
    return Reply(refusal.status, headers, orjson.dumps(body))


def _label(value: str) -> str:
    """A Prometheus label value, escaped as the text format wants (a model name may hold `"`)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _cut(reply: Reply) -> Reply:
    """The same answer, broken off halfway: the connection drops after half of it."""
    if reply.events is not None:
        keep = max(1, len(reply.events) // 2)
        return Reply(reply.status, reply.headers, events=reply.events[:keep], fault="cut")
    return Reply(
        reply.status, reply.headers, reply.body[: len(reply.body) // 2], reply.delay, fault="cut"
    )


def prompt_text(endpoint: str, body: dict[str, Any]) -> str:
    """The text the simulated model 'reads': all string message contents, or the prompt."""
    if endpoint == "completions":
        prompt = body.get("prompt")
        return prompt if isinstance(prompt, str) else orjson.dumps(prompt).decode()
    parts = []
    for msg in body.get("messages") or []:
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, str):
            parts.append(content)
        elif content is not None:
            parts.append(orjson.dumps(content).decode())
    return "\n".join(parts)


def prompt_tag(text: str) -> str:
    """The marker every simulated answer starts with, tying it to its prompt."""
    return f"[sim:{hashlib.sha256(text.encode('utf-8', 'replace')).hexdigest()[:12]}]"


class SimModel:
    def __init__(
        self, config: SimConfig | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config or SimConfig()
        cfg = self.config
        # Always built: without slots or limits it admits everything at once, but it still
        # knows what is in flight, which GET /metrics reports.
        self.capacity = Capacity(
            slots=cfg.slots,
            tpot_slope=cfg.tpot_slope,
            queue_limit=cfg.queue_limit,
            gate_status=cfg.gate_status,
            rpm=cfg.rpm,
            tpm=cfg.tpm,
            clock=clock,
        )
        self.requests = 0  # how many completion requests were answered (tests read this)
        self.faults = FaultPlan(self.config.faults, self.config.fault_seed)
        self.answered: set[int] = set()  # prompts (by digest) that got a complete answer
        self.resent = 0  # complete answers to a prompt that already had one
        self.prefix_cache = ServedPrefixCache.of(capacity_blocks=cfg.prefix_cache_blocks)
        self.batches = SimBatches(
            self._batch_line,
            seconds=cfg.batch_seconds,
            window_s=cfg.batch_window_s,
            max_requests=cfg.batch_max_requests,
            clock=clock,
        )

    def stats(self) -> dict[str, Any]:
        """What `GET /sim/stats` reports: requests, faults injected by kind, re-sent prompts, and
        `prefix_cache` once the cache holds a block (short prompts never touch it)."""
        return {
            "requests": self.requests,
            "answered": len(self.answered),
            "resent_after_success": self.resent,
            "faults": dict(self.faults.injected),
            **self.prefix_cache.stats(),
            **({"batches_created": self.batches.created} if self.batches.created else {}),
        }

    def handle(self, method: str, path: str, headers: dict[str, str], body: bytes) -> Reply:
        """The answer to one request. One the simulator cannot read (`{"messages": 5}`, a
        schema with an empty `enum`, a query that is not a number) gets a 400 of its own: it
        never ends the server, which would refuse every request after it."""
        try:
            return self._handle(method, path, headers, body)
        except Exception as exc:
            said = f"the simulator cannot read this request: {type(exc).__name__}: {exc}"
            return _error(400, said[:300], "invalid_request_error")

    def _handle(self, method: str, path: str, headers: dict[str, str], body: bytes) -> Reply:
        target, path = path, path.split("?", 1)[0].rstrip("/")
        if self.config.api_key is not None:
            key = self.config.api_key
            bearer = headers.get("authorization", "") == f"Bearer {key}"
            if not bearer and headers.get("x-api-key", "") != key:
                return _error(401, "invalid or missing API key", "authentication_error")
        if method == "GET" and path in ("/v1/models", "/models"):
            return _json_reply(
                200,
                {
                    "object": "list",
                    "data": [
                        {"id": m, "object": "model", "owned_by": "batchrun-sim"}
                        for m in self.config.models
                    ],
                },
            )
        if method == "GET" and path in ("/health", "/v1/health"):
            return _json_reply(200, {"status": "ok"})
        if method == "GET" and path == "/sim/stats":
            return _json_reply(200, self.stats())
        if method == "GET" and path == "/metrics" and self.config.metrics:
            return self._metrics()
        if path.startswith(("/v1/files", "/v1/batches")):
            status, payload = self.batches.handle(method, target, headers, body)
            if isinstance(payload, bytes):  # a file's content
                return Reply(status, {"content-type": "application/octet-stream"}, payload)
            return _json_reply(status, payload)
        endpoints = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
        endpoint = endpoints.get(path)
        if endpoint is None or method != "POST":
            return _error(404, f"no route for {method} {path}", "not_found_error")
        try:
            request = orjson.loads(body)
        except orjson.JSONDecodeError:
            return _error(400, "request body is not valid JSON", "invalid_request_error")
        if not isinstance(request, dict):
            return _error(400, "request body must be a JSON object", "invalid_request_error")
        return self.complete(endpoint, request)

    def complete(self, endpoint: str, request: dict[str, Any]) -> Reply:
        cfg = self.config
        model = request.get("model") or cfg.models[0]
        if cfg.strict_models and model not in cfg.models:
            return _error(404, f"The model `{model}` does not exist.", "not_found_error")
        key = "messages" if endpoint == "chat" else "prompt"
        if key not in request:
            return _error(400, f"'{key}' is required", "invalid_request_error")
        self.requests += 1
        text = prompt_text(endpoint, request)
        tag = prompt_tag(text)
        fault = self.faults.pick(tag)
        if fault in STATUS_FAULTS:
            status, headers, body = status_fault(fault, cfg.retry_after_ms)
            return Reply(status, headers, body)
        if fault in BODY_FAULTS:
            headers, body = body_fault(fault, bool(request.get("stream")))
            return Reply(200, headers, body)
        if fault in ("reset", "hang"):
            return Reply(0, fault=fault)
        reply = self._answer(endpoint, request, text, tag)
        if reply.status != 200:  # refused by the capacity gate or a rate limit
            if fault is not None:
                self.faults.unpick(tag, fault)
            return reply
        if fault == "cut":
            return _cut(reply)
        answer_id = int(tag[5:-1], 16)  # 48 bits of the prompt's digest: compact for big runs
        if answer_id in self.answered:
            self.resent += 1
        self.answered.add(answer_id)
        return reply

    def _answer(self, endpoint: str, request: dict[str, Any], text: str, tag: str) -> Reply:
        cfg = self.config
        model = request.get("model") or cfg.models[0]
        rng = random.Random(tag)
        wanted = rng.randint(cfg.min_output_tokens, cfg.max_output_tokens)
        fmt = request.get("response_format")
        if fmt is not None and cfg.refuse_response_format:
            return _error(
                400,
                "response_format is not supported by this server (simulated)",
                "invalid_request_error",
            )
        tokens = self._json_tokens(request, rng)
        if tokens is None:
            tokens = [tag, *(" " + rng.choice(WORDS) for _ in range(wanted - 1))]
        limit = request.get("max_completion_tokens") or request.get("max_tokens")  # as vLLM
        n_out, finish = len(tokens), "stop"
        if isinstance(limit, int) and 0 < limit < n_out:
            n_out, finish = limit, "length"
            tokens = tokens[:limit]
        prompt_tokens = max(1, len(text.split()))
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": n_out,
            "total_tokens": prompt_tokens + n_out,
        }
        cached = self.prefix_cache.cached(text, prompt_tokens=prompt_tokens)  # no prefill for these
        ttft = (cfg.ttft_ms + cfg.prefill_ms_per_token * (prompt_tokens - cached)) / 1000
        tpot = cfg.tpot_ms / 1000
        admission = self.capacity.admit(
            prompt_tokens=prompt_tokens, n_out=n_out, ttft=ttft, tpot=tpot
        )
        if isinstance(admission, Refusal):
            return _refused(admission)
        self.prefix_cache.took(text, prompt_tokens=prompt_tokens, cached_tokens=cached)
        ttft += admission.queue_wait
        tpot *= admission.tpot_factor
        headers = admission.headers
        ident = f"{'chatcmpl' if endpoint == 'chat' else 'cmpl'}-sim-{tag[5:-1]}"
        base = {"id": ident, "created": int(time.time()), "model": model}
        if request.get("stream"):
            options = request.get("stream_options") or {}
            reply = self._stream(
                endpoint,
                base,
                tokens,
                finish,
                ttft,
                tpot,
                usage if options.get("include_usage") else None,
            )
            reply.headers.update(headers)
            return reply
        full = "".join(tokens)
        if endpoint == "chat":
            choice: dict[str, Any] = {
                "index": 0,
                "finish_reason": finish,
                "message": {"role": "assistant", "content": full},
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "finish_reason": finish, "text": full}
            obj = "text_completion"
        payload = {**base, "object": obj, "choices": [choice], "usage": usage}
        reply = _json_reply(200, payload, delay=ttft + tpot * (n_out - 1))
        reply.headers.update(headers)
        return reply

    def _batch_line(self, endpoint: str, body: dict[str, Any]) -> tuple[int, bytes]:
        """One line of a batch, answered as a request would be (0: the connection dropped)."""
        reply = self.complete(endpoint, body)
        return (500 if reply.fault else reply.status), reply.body

    def _metrics(self) -> Reply:
        """The load under vLLM's Prometheus names, so a server-aware client can be tested here."""
        running, waiting = self.capacity.load()
        gauges = {"num_requests_running": float(running), "num_requests_waiting": float(waiting)}
        if self.config.slots:
            gauges["kv_cache_usage_perc"] = running / self.config.slots
        labels = f'{{engine="0",model_name="{_label(self.config.models[0])}"}}'
        text = "".join(
            f"# TYPE vllm:{name} gauge\nvllm:{name}{labels} {value}\n"
            for name, value in gauges.items()
        ) + self.prefix_cache.metrics(labels)
        return Reply(200, {"content-type": "text/plain; version=0.0.4"}, text.encode())

    def _json_tokens(self, request: dict[str, Any], rng: random.Random) -> list[str] | None:
        """A JSON answer's tokens, when the request or the config calls for JSON."""
        cfg = self.config
        schema = schema_of(request.get("response_format"))
        if schema is None and not cfg.json_styles and cfg.json_schema is None:
            return None
        if schema is not None:  # constrained decoding: always valid for the schema sent
            style = "valid"
        elif is_repair(request):
            style = "valid" if cfg.repair_fixes else "broken"
        else:
            style = pick_style(cfg.json_styles, rng)
        return pieces(json_text(schema or cfg.json_schema or DEFAULT_SCHEMA, style, rng))

    @staticmethod
    def _stream(
        endpoint: str,
        base: dict[str, Any],
        tokens: list[str],
        finish: str,
        ttft: float,
        tpot: float,
        usage: dict[str, int] | None,
    ) -> Reply:
        chat = endpoint == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(piece: str | None, reason: str | None = None) -> bytes:
            if chat:
                delta: dict[str, Any] = {} if piece is None else {"content": piece}
                choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": piece or "", "finish_reason": reason}
            data = {**base, "object": obj, "choices": [choice]}
            return b"data: " + orjson.dumps(data) + b"\n\n"

        events: list[tuple[float, bytes]] = []
        if chat:
            role = {
                **base,
                "object": obj,
                "choices": [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "finish_reason": None,
                    }
                ],
            }
            events.append((0.0, b"data: " + orjson.dumps(role) + b"\n\n"))
        for i, token in enumerate(tokens):
            events.append((ttft if i == 0 else tpot, chunk(token)))
        events.append((0.0, chunk(None, finish)))
        if usage is not None:
            tail = {**base, "object": obj, "choices": [], "usage": usage}
            events.append((0.0, b"data: " + orjson.dumps(tail) + b"\n\n"))
        events.append((0.0, b"data: [DONE]\n\n"))
        headers = {"content-type": "text/event-stream", "cache-control": "no-cache"}
        return Reply(200, headers, events=events)
