"""What the runner knows about an endpoint: one request in, one Completion out (or an error)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

Transport = httpx.AsyncBaseTransport  # what tests and --backend sim inject instead of sockets

# How a server takes its API key: a preset names one (presets.Preset.auth). A new style is one
# entry here.
AUTH_STYLES: dict[str, Callable[[str], dict[str, str]]] = {
    "bearer": lambda key: {"authorization": f"Bearer {key}"},  # OpenAI and most servers
    "x-api-key": lambda key: {"x-api-key": key},  # Anthropic-style gateways
    "none": lambda key: {},
}


def auth_headers(style: str, key: str | None) -> dict[str, str]:
    """The headers that carry `key` in `style` (none without a key)."""
    return AUTH_STYLES[style](key) if key else {}


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    endpoint: str  # "chat" or "completions"
    body: dict[str, Any]  # the request body, without the streaming fields


@dataclass(frozen=True, slots=True)
class RateInfo:
    """What a hosted API says of its limits (`x-ratelimit-*`): what is left, and when it resets."""

    remaining_requests: int | None = None
    reset_requests_s: float | None = None  # until the budget is full again (OpenAI, Groq)
    remaining_tokens: int | None = None
    reset_tokens_s: float | None = None
    limit_requests: int | None = None
    limit_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Completion:
    text: str
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    latency_s: float
    ttft_s: float | None  # time to the first token: content, or a thought (streaming only)
    rate: RateInfo | None = None  # the server's rate-limit headers, when it sends them
    # Seconds from sending to each delta with a token (content or a reasoning model's
    # thought; streaming only): inter-token latency for `batchrun bench`.
    chunk_times: tuple[float, ...] = ()
    # Timings the server reports in `usage` (Groq: queue_time, prompt_time, completion_time,
    # total_time), in seconds.
    server_timing: dict[str, float] | None = None
    http_status: int = 200  # the answer's HTTP status (any 2xx is an answer)
    # Why the attempt asked again, once per ask before the one that answered (an empty
    # stream, a refused stream_options, a closed connection): each a request of its own,
    # counted in `attempts` and logged.
    asked_again: tuple[str, ...] = ()


class Watch(Protocol):
    """What the sender hears while one request is on the wire: the concurrency controller's
    earliest evidence, long before the answer is whole."""

    def accepted(self) -> None:
        """The server answered with a success status: it took the request (a refusal, by
        contrast, comes back as an error)."""

    def first_token(self, ttft: float) -> None:
        """The first content arrived (streaming), `ttft` seconds after sending."""


class Backend(Protocol):
    # Requests sent again at once, on a new connection, because the pooled one they went out
    # on had been closed by the server before any answer came (not attempts; see the log).
    stale_resends: int
    # Whether streamed requests ask for usage (stream_options); False once a server refused it.
    stream_options: bool

    async def complete(
        self, request: CompletionRequest, *, watch: Watch | None = None
    ) -> Completion:
        """Send one request; raise a batchrun.errors.RequestError subclass on failure.

        `watch`, if given, is told once when the server accepts the request and once when the
        first content arrives."""
        ...

    async def list_models(self) -> list[str]: ...

    async def aclose(self) -> None: ...
