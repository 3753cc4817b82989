"""`batchrun doctor`: probe an endpoint before a night's run is committed to it.

Each check sends at most one small request (max_tokens 16) and says what works: reachable, key
accepted, model listed, chat and completions answered, streaming with time to first token,
usage reported (streamed and not), whether JSON Schema constrained decoding is accepted and
enforced in the preset's style, and where `--concurrency auto` reads the server's own load.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from batchrun.backends import Backend, Completion, CompletionRequest, Transport
from batchrun.backends.build import build_backend, metrics_reader, sim_transport
from batchrun.config import RunSpec, preset_for
from batchrun.endpoints import shown_endpoint
from batchrun.errors import (
    AuthFailed,
    BadRequest,
    ConnectionFailed,
    NotFound,
    RequestError,
    UsageError,
)
from batchrun.validate import SchemaCheck, response_format

# Short by construction (a server that enforces it cannot run on past the probe's tokens, as a
# free string could with a small model): one of two words, and nothing else in the object.
PROBE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
PROBE_TOKENS = 128  # the answer is ~8 tokens; room for a server's whitespace between them
MESSAGES = [{"role": "user", "content": "Say hello in one short sentence."}]


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool | None  # None: could not be checked (an earlier check failed)
    detail: str
    essential: bool = False  # a job cannot run without it


async def diagnose(spec: RunSpec, transport: Transport | None = None) -> list[Check]:
    checks: list[Check] = []
    try:
        backend = build_backend(spec, transport)
    except UsageError as exc:
        return [Check("API key", False, str(exc), essential=True)]
    try:
        models = await _models(backend, spec, checks)
        if models is None:
            return checks
        model = spec.model or (models[0] if models else None)
        detail = model or "the server lists no models; give --model"
        if spec.model and models and spec.model not in models:
            # not listed, yet many servers answer any name (llama-server, an alias): the chat
            # probe judges; a 404 to it fails there
            listed = ", ".join(models[:10])
            detail = f"{spec.model!r} (not listed: {listed}; the chat probe decides)"
        checks.append(Check("model", model is not None, detail, essential=True))
        defaults = {"model": model, "max_tokens": 16} if model else {"max_tokens": 16}
        await _chat(backend, spec, defaults, transport, checks)
        await _completions(spec, defaults, transport, checks)
        await _guided(backend, spec, defaults, checks)
        await _server_load(spec, transport, checks)
    finally:
        await backend.aclose()
    return checks


async def _server_load(spec: RunSpec, transport: Transport | None, checks: list[Check]) -> None:
    """Whether `auto` will have the server's own counts (not needed: it reads first tokens and
    throughput without them, so a server without is not a failure)."""
    reader = metrics_reader(spec, transport or sim_transport(spec))  # as a job reads it
    if reader is None:
        return  # a fixed --concurrency, or --server-metrics off
    try:
        load = await reader.read()
    finally:
        await reader.aclose()
    if load is None:
        detail = f"none published ({reader.last_error}): auto reads first tokens and throughput"
        checks.append(Check("server load", None, detail))
    elif load.slots is not None:
        detail = f"{load.source}: {load.running:g} of {load.slots} slots busy"
        checks.append(Check("server load", True, detail))
    else:
        detail = f"{load.source}: {load.running:g} running, {load.waiting_with(0):g} waiting"
        checks.append(Check("server load", True, detail))


async def _models(backend: Backend, spec: RunSpec, checks: list[Check]) -> list[str] | None:
    try:
        models = await backend.list_models()
    except ConnectionFailed as exc:
        checks.append(Check("reachable", False, str(exc), essential=True))
        return None
    except AuthFailed as exc:
        checks.append(Check("reachable", True, shown_endpoint(spec.base_url), essential=True))
        checks.append(Check("API key", False, str(exc), essential=True))
        return None
    except NotFound:  # no model list here; chat may still work with --model
        checks.append(
            Check(
                "reachable",
                True,
                f"{shown_endpoint(spec.base_url)} (no /models: 404)",
                essential=True,
            )
        )
        return []
    except RequestError as exc:
        checks.append(Check("reachable", False, f"GET /models: {exc}", essential=True))
        return None
    checks.append(Check("reachable", True, shown_endpoint(spec.base_url), essential=True))
    key = spec.api_key_env
    if spec.api_key():
        detail = f"accepted ({key})"
    elif key:  # named, but not set here: the server answered without it
        detail = f"none sent ({key} is not set; none needed here)"
    else:
        detail = "none sent (none needed here)"
    checks.append(Check("API key", True, detail, essential=True))
    return models


async def _send(backend: Backend, endpoint: str, body: dict[str, Any]) -> Completion | str:
    try:
        return await backend.complete(CompletionRequest(endpoint, body))
    except RequestError as exc:
        return str(exc)


async def _chat(
    backend: Backend,
    spec: RunSpec,
    defaults: dict[str, Any],
    transport: Transport | None,
    checks: list[Check],
) -> None:
    plain = build_backend(replace(spec, stream=False), transport)
    try:
        answer = await _send(plain, "chat", {**defaults, "messages": MESSAGES})
    finally:
        await plain.aclose()
    if isinstance(answer, str):
        checks.append(Check("chat", False, answer, essential=True))
        return
    checks.append(
        Check(
            "chat", True, f"{answer.latency_s * 1000:.0f} ms: {answer.text[:60]!r}", essential=True
        )
    )
    checks.append(_usage_check("usage (not streamed)", answer))
    streamed = await _send(backend, "chat", {**defaults, "messages": MESSAGES})
    if isinstance(streamed, str):  # a job streams unless --no-stream: then it needs this
        checks.append(Check("streaming", False, f"{streamed} (or run --no-stream)", spec.stream))
        return
    ttft = "-" if streamed.ttft_s is None else f"{streamed.ttft_s * 1000:.0f} ms"
    note = "" if backend.stream_options else "; refuses stream_options"
    checks.append(Check("streaming", True, f"time to first token {ttft}{note}"))
    checks.append(_usage_check("usage (streamed)", streamed))


def _usage_check(name: str, c: Completion) -> Check:
    if c.completion_tokens is None:
        return Check(name, False, "not reported: token counts will be missing")
    return Check(name, True, f"{c.prompt_tokens} prompt + {c.completion_tokens} completion")


async def _completions(
    spec: RunSpec, defaults: dict[str, Any], transport: Transport | None, checks: list[Check]
) -> None:
    backend = build_backend(replace(spec, stream=False), transport)
    try:
        answer = await _send(backend, "completions", {**defaults, "prompt": "Once upon a time"})
    finally:
        await backend.aclose()
    ok = not isinstance(answer, str)
    checks.append(Check("completions", ok, "answered" if ok else str(answer)))


async def _guided(
    backend: Backend, spec: RunSpec, defaults: dict[str, Any], checks: list[Check]
) -> None:
    style = preset_for(spec).guided_style
    guided = response_format(style, PROBE_SCHEMA)
    body = {**defaults, "max_tokens": PROBE_TOKENS, "messages": MESSAGES, "response_format": guided}
    try:
        answer = await backend.complete(CompletionRequest("chat", body))
    except BadRequest as exc:
        checks.append(Check("JSON schema", False, f"refused ({style}): {exc}"))
        return
    except RequestError as exc:
        checks.append(Check("JSON schema", False, str(exc)))
        return
    verdict = SchemaCheck(PROBE_SCHEMA).check(answer.text, answer.finish_reason)
    if verdict.ok:
        checks.append(Check("JSON schema", True, f"accepted and enforced ({style})"))
    else:
        failed = f"accepted ({style}) but the answer did not validate: {verdict.error}"
        checks.append(Check("JSON schema", False, failed))


def render(checks: list[Check]) -> str:
    """One line a check: a line break in what a server said (a model's name, an error) is
    written as `\\n`, so a server cannot forge a line of its own ("ok  chat ...")."""
    marks = {True: "ok  ", False: "FAIL", None: "-   "}
    lines = (f"{marks[c.ok]}  {c.name:<22} {_one_line(c.detail)}" for c in checks)
    return "\n".join(lines)


def _one_line(text: str) -> str:
    return text.replace("\r", "\\r").replace("\n", "\\n")


def ready(checks: list[Check]) -> bool:
    """Whether a job could run: every essential check passed."""
    essential = [c for c in checks if c.essential]
    return (
        bool(essential)
        and all(c.ok for c in essential)
        and any(c.name == "chat" for c in essential)
    )
