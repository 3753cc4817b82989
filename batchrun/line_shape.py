"""What one input line says: its shape (a prompt, messages, or the OpenAI Batch format), its
id, the request it asks for and its meta; and the rules a line must keep to be sent as written.
"""

from __future__ import annotations

import json
import re
from typing import Any

from batchrun.validate import kept_exactly, response_format

# Top-level fields of a prompt/messages line that are request parameters rather than meta.
REQUEST_FIELDS = frozenset(
    {
        "model",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "stop",
        "seed",
        "n",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
        "logprobs",
        "top_logprobs",
        "response_format",
        "tools",
        "tool_choice",
        "user",
        "min_tokens",
        "suffix",
        "echo",
        # newer OpenAI fields, and the engines' own (vLLM, SGLang, llama.cpp)
        "reasoning_effort",
        "verbosity",
        "parallel_tool_calls",
        "chat_template_kwargs",
        "ignore_eos",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "structured_outputs",
        "grammar",
        "json_schema",
        "cache_prompt",
        "typical_p",
        "min_keep",
        "n_probs",
    }
)
_PLAIN_KEYS = frozenset({"id", "prompt", "messages"})
SCHEMA_KEY = "schema"  # a line's own JSON Schema for its answer: shorthand for response_format
BATCH_URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
LONG_DIGITS = re.compile(rb"\d{19}")  # only a line with such a run may hold a wide integer


class LineProblem(Exception):
    """Internal: the reason one line is bad."""


def type_name(value: Any) -> str:
    names = {
        dict: "an object",
        list: "an array",
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
        type(None): "null",
    }
    return names.get(type(value), type(value).__name__)


def item_id_of(obj: dict[str, Any], key: str) -> str | None:
    if key not in obj:
        return None
    value = obj[key]
    if isinstance(value, float) and value.is_integer() and abs(value) >= 2**63:
        raise LineProblem(
            f"{key!r} is an integer too large to keep exactly (over 64 bits); write it as a string"
        )
    if isinstance(value, float):
        if not value.is_integer():
            raise LineProblem(f"{key!r} is a non-integer number ({value!r}); write it as a string")
        raise LineProblem(f"{key!r} is a decimal ({value!r}); write it as an integer or a string")
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise LineProblem(f"{key!r} must be a string or an integer, got {type_name(value)}")
    text = str(value)
    if not text.strip():
        raise LineProblem(f"{key!r} is empty")
    if "\x00" in text:  # PostgreSQL's text holds none; the same rule on every ledger
        raise LineProblem(f"{key!r} holds a NUL character (\\u0000)")
    return text


COUNTS = ("max_tokens", "max_completion_tokens", "n")  # what a budget's estimate reads


def counts_checked(body: dict[str, Any]) -> None:
    """A line's token limits and `n` are what a budget holds back for its answer, so they are
    whole numbers above 0: a whole float (a pandas export's `50.0`) is taken as the integer,
    and `null` (a pandas export's missing value) as not given (the job's default applies);
    anything else is a bad line, rather than a request the budget cannot bound."""
    for key in COUNTS:
        if key not in body:
            continue
        value = body[key]
        if value is None:
            del body[key]
        elif isinstance(value, float) and value.is_integer() and 0 < value < 2**31:
            body[key] = int(value)
        elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LineProblem(f"{key!r} must be a whole number above 0, got {value!r}"[:200])


def only_calls(choice: Any) -> bool:
    """A tool_choice that allows no text answer: "required", or a function named."""
    return choice == "required" or isinstance(choice, dict)


def refuse_wide_integers(raw: bytes) -> None:
    """orjson reads an integer past 64 bits as a float: a 30-digit order number in meta would
    come back as another number. Such a line is refused, as such an id is."""
    try:
        json.loads(raw, parse_int=_fits)
    except RecursionError:
        raise LineProblem("is nested too deeply to read its numbers exactly") from None


def _fits(literal: str) -> int:
    value = int(literal)
    if not kept_exactly(value):  # the value is not said: it may be a card's number
        raise LineProblem(
            "holds an integer too large to keep exactly (over 64 bits); write it as a string"
        )
    return value


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise LineProblem("'messages' must be a non-empty array")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise LineProblem(f"messages[{i}] must be an object, got {type_name(msg)}")
        if not isinstance(msg.get("role"), str):
            raise LineProblem(f"messages[{i}] needs a string 'role'")
        content = msg.get("content")
        if not isinstance(content, (str, list)) and not (content is None and "tool_calls" in msg):
            raise LineProblem(f"messages[{i}] needs 'content' as a string or an array")


def _check_prompt(prompt: Any) -> None:
    if not isinstance(prompt, str):
        raise LineProblem(f"'prompt' must be a string, got {type_name(prompt)}")
    if not prompt.strip():
        raise LineProblem("'prompt' is empty")


def plain_shape(
    obj: dict[str, Any], endpoint: str
) -> tuple[str, dict[str, Any], str | None, dict[str, Any]]:
    item_id = item_id_of(obj, "id")
    body: dict[str, Any] = {}
    meta: dict[str, Any] = {}
    if not obj.keys() <= _PLAIN_KEYS:  # the common line has nothing but id and prompt/messages
        for key, value in obj.items():
            if key in REQUEST_FIELDS:
                body[key] = value
            elif key not in _PLAIN_KEYS:
                meta[key] = value
    if isinstance(meta.get(SCHEMA_KEY), dict):  # anything else under that name stays meta
        if "response_format" in body:
            raise LineProblem("has both 'schema' and 'response_format'; give one")
        body["response_format"] = response_format("json_schema", meta.pop(SCHEMA_KEY))
    if "messages" in obj:
        if "prompt" in obj:
            raise LineProblem("has both 'prompt' and 'messages'; give one")
        _check_messages(obj["messages"])
        if endpoint != "chat":
            raise LineProblem("'messages' needs the chat endpoint (job uses completions)")
        body["messages"] = obj["messages"]
    elif "prompt" in obj:
        _check_prompt(obj["prompt"])
        if endpoint == "chat":
            body["messages"] = [{"role": "user", "content": obj["prompt"]}]
        else:
            body["prompt"] = obj["prompt"]
    else:
        raise LineProblem("no 'prompt', 'messages' or batch 'body' field")
    return endpoint, body, item_id, meta


def batch_shape(obj: dict[str, Any]) -> tuple[str, dict[str, Any], str | None, dict[str, Any]]:
    item_id = item_id_of(obj, "custom_id")
    method = obj.get("method", "POST")
    if method != "POST":
        raise LineProblem(f"batch 'method' must be POST, got {method!r}")
    url = obj.get("url")
    endpoint = BATCH_URLS.get(url) if isinstance(url, str) else None
    if endpoint is None:
        raise LineProblem(f"batch 'url' must be one of {', '.join(BATCH_URLS)}, got {url!r}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise LineProblem(f"batch 'body' must be an object, got {type_name(body)}")
    if endpoint == "chat":
        _check_messages(body.get("messages"))
    else:
        _check_prompt(body.get("prompt"))
    body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    meta = {k: v for k, v in obj.items() if k not in ("custom_id", "method", "url", "body")}
    return endpoint, body, item_id, meta
