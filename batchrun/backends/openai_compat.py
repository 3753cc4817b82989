"""The OpenAI-compatible client: chat and completions, streamed (default) or not.

Streaming gives time to first token and catches a stream cut short; `stream_options.include_usage`
asks for token counts at the end, and is dropped for the rest of the run if a server refuses it.
Every HTTP or transport failure leaves this module as a batchrun error type.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import anyio
import httpx
import orjson

from batchrun import __version__
from batchrun.backends.base import Completion, CompletionRequest
from batchrun.backends.errors_http import error_for_status, rate_info
from batchrun.backends.pool import ShardedTransport
from batchrun.errors import (
    BadRequest,
    ConnectionFailed,
    EmptyStream,
    Overloaded,
    RequestError,
    RequestTimeout,
    StreamCut,
)

# Server-side timings some servers put in `usage` (Groq), in seconds.
SERVER_TIMING = ("queue_time", "prompt_time", "completion_time", "total_time")
ENDPOINT_PATHS = {"chat": "/chat/completions", "completions": "/completions"}


class OpenAICompatBackend:
    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout: float = 120.0,
        stream: bool = True,
        stream_options: bool = True,
        max_connections: int = 64,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.stream = stream
        self.stream_options = stream_options
        self._api_key = api_key
        headers = {"content-type": "application/json", "user-agent": f"batchrun/{__version__}"}
        if api_key:
            headers["authorization"] = f"Bearer {api_key}"
        self._client = httpx.AsyncClient(
            # One httpx pool costs O(connections) per request: shard it (see pool.py).
            transport=transport or ShardedTransport(max_connections),
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def list_models(self) -> list[str]:
        try:
            return await self._list_models()
        except RequestError as exc:
            raise self._scrub(exc) from None

    async def _list_models(self) -> list[str]:
        url = f"{self.base_url}/models"
        try:
            with anyio.fail_after(self.timeout):
                response = await self._client.get(url)
        except (TimeoutError, httpx.TimeoutException):
            raise RequestTimeout(f"no answer from {url} within {self.timeout:g}s") from None
        except httpx.TransportError as exc:
            raise ConnectionFailed(self._describe(exc, url)) from None
        if response.status_code >= 400:
            raise error_for_status(response.status_code, response.headers, response.content, url)
        try:
            data = orjson.loads(response.content)
            return [str(m["id"]) for m in data.get("data", [])]
        except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError):
            raise StreamCut(f"{url} did not return a model list") from None

    async def complete(self, request: CompletionRequest) -> Completion:
        try:
            try:
                return await self._complete_once(request)
            except BadRequest as exc:
                if self.stream and self.stream_options and "stream_options" in str(exc):
                    self.stream_options = False  # this server refuses it; ask without it
                    return await self._complete_once(request)
                raise
            except EmptyStream:
                # Ask once more without streaming: a server that says nothing in a stream
                # says why in a plain answer (a 400 naming the context limit, say).
                try:
                    return await self._complete_once(request, stream=False)
                except ConnectionFailed:  # it closed the connection the stream came on
                    return await self._complete_once(request, stream=False)
        except RequestError as exc:
            raise self._scrub(exc) from None

    async def _complete_once(
        self, request: CompletionRequest, *, stream: bool | None = None
    ) -> Completion:
        url = self.base_url + ENDPOINT_PATHS[request.endpoint]
        body = dict(request.body)
        if self.stream if stream is None else stream:
            body["stream"] = True
            if self.stream_options:
                body["stream_options"] = {"include_usage": True}
        started = time.perf_counter()
        receiving = False
        try:
            with anyio.fail_after(self.timeout):
                async with self._client.stream("POST", url, content=orjson.dumps(body)) as resp:
                    if resp.status_code >= 400:
                        content = await resp.aread()
                        raise error_for_status(resp.status_code, resp.headers, content, url)
                    receiving = True
                    if "text/event-stream" in resp.headers.get("content-type", ""):
                        completion = await self._read_stream(resp, request.endpoint, started)
                    else:
                        content = await resp.aread()
                        completion = self._read_json(content, request.endpoint, started)
                    rate = rate_info(resp.headers)
                    return replace(completion, rate=rate) if rate else completion
        except (TimeoutError, httpx.TimeoutException):
            raise RequestTimeout(f"no complete answer within {self.timeout:g}s") from None
        except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
            if receiving:
                raise StreamCut(f"connection dropped mid-answer: {self._describe(exc)}") from None
            raise ConnectionFailed(self._describe(exc, url)) from None
        except httpx.TransportError as exc:
            raise ConnectionFailed(self._describe(exc, url)) from None

    async def _read_stream(self, resp: httpx.Response, endpoint: str, started: float) -> Completion:
        pieces: list[str] = []
        times: list[float] = []  # of each non-empty content delta; the first is the TTFT
        finish: str | None = None
        usage: dict[str, Any] | None = None
        done = False
        saw_choice = False
        # Read to the end rather than break at [DONE]: servers close the body right after it,
        # and a generator left half-read costs a finaliser task per layer of httpx's stream.
        events = 0
        async for line in resp.aiter_lines():
            if done or not line.startswith("data:"):
                continue
            events += 1
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                continue
            try:
                chunk = orjson.loads(data)
            except orjson.JSONDecodeError:
                raise StreamCut(f"unreadable stream chunk: {data[:100]!r}") from None
            if not isinstance(chunk, dict):
                continue
            if chunk.get("error"):
                raise Overloaded(f"server error mid-stream: {str(chunk['error'])[:300]}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            choices = chunk.get("choices") or []
            if not isinstance(choices, list):
                raise StreamCut(f"malformed stream chunk: 'choices' is {type(choices).__name__}")
            for choice in choices:
                if not isinstance(choice, dict):
                    raise StreamCut("malformed stream chunk: a choice is not an object")
                saw_choice = True
                piece = _choice_text(choice, endpoint, streamed=True)
                if piece:
                    times.append(time.perf_counter() - started)
                    pieces.append(piece)
                if choice.get("finish_reason"):
                    finish = choice["finish_reason"]
        if not events:
            raise EmptyStream("the event stream closed without a single event")
        if not saw_choice:
            raise StreamCut("stream carried no choices")
        if not done and finish is None:
            raise StreamCut("stream ended before its final chunk")
        completion = _completion(
            "".join(pieces), finish, usage, started, times[0] if times else None
        )
        return replace(completion, chunk_times=tuple(times))

    @staticmethod
    def _read_json(content: bytes, endpoint: str, started: float) -> Completion:
        try:
            data = orjson.loads(content)
        except orjson.JSONDecodeError:
            raise StreamCut(f"response is not JSON: {content[:100]!r}") from None
        choices = data.get("choices") if isinstance(data, dict) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise StreamCut("response has no usable choices")
        text = _choice_text(choices[0], endpoint, streamed=False) or ""
        return _completion(text, choices[0].get("finish_reason"), data.get("usage"), started, None)

    @staticmethod
    def _describe(exc: Exception, url: str | None = None) -> str:
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return f"{text} ({url})" if url else text

    def _scrub(self, error: RequestError) -> RequestError:
        """Make sure a server that echoes the key back cannot leak it through our messages.

        Applied once, where errors leave this class, so no message built inside can escape it.
        """
        key = self._api_key
        if not key:
            return error
        text = str(error)
        for form in (key, repr(key)[1:-1]):
            text = text.replace(form, "***")
        # A server message cut at its length limit may end in the first part of the key.
        for n in range(len(key) - 1, 7, -1):
            if text.endswith(key[:n]):
                text = text[:-n] + "***"
                break
        error.args = (text,)
        return error


def _choice_text(choice: dict[str, Any], endpoint: str, *, streamed: bool) -> str | None:
    if endpoint == "completions":
        text = choice.get("text")
        return text if isinstance(text, str) else None
    part = choice.get("delta" if streamed else "message") or {}
    content = part.get("content") if isinstance(part, dict) else None
    return content if isinstance(content, str) else None


def _completion(
    text: str, finish: str | None, usage: Any, started: float, ttft: float | None
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
        server_timing=timing or None,
    )


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
