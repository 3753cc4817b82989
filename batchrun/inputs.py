"""Streaming JSONL reader: detects each line's shape, validates it, and builds its request.

The file is read line by line (never whole), so a million-line input costs the same memory as a
ten-line one. Every bad line is reported with its number and reason instead of being dropped;
duplicate ids are caught by the ledger's unique index, which sees the whole file without this
reader having to remember every id.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import orjson

from batchrun.config import InputGuards
from batchrun.errors import UsageError
from batchrun.ledger.records import BadLine, InputItem
from batchrun.prefixes import prefix_key
from batchrun.validate import response_format, schema_of, schema_problem

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
    }
)
_PLAIN_KEYS = frozenset({"id", "prompt", "messages"})
SCHEMA_KEY = "schema"  # a line's own JSON Schema for its answer: shorthand for response_format
BATCH_URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
BOM = b"\xef\xbb\xbf"
_READ_CHUNK = 1 << 16


@dataclass
class ReadStats:
    blank_lines: list[int] = field(default_factory=list)
    lines: int = 0
    file_digest: str = ""


def canonical_digest(defaults: dict[str, Any], body: dict[str, Any]) -> str:
    """sha256 of the request body as it is sent: defaults overridden by the line, in its
    canonical form (canonical_json)."""
    merged = {**defaults, **body} if defaults else body
    return hashlib.sha256(canonical_json(merged)[0]).hexdigest()


def canonical_json(body: dict[str, Any]) -> tuple[bytes, bool]:
    """A request as one request is written whatever the order of its keys (lines that differ
    only in it are one request: dedup, reuse), and whether that is how it must be sent.

    Keys are sorted, except those of a schema's `properties`: guided decoding (vLLM, SGLang,
    llama.cpp, OpenAI's structured outputs) writes an answer's fields in the order its schema
    lists them, so "reasoning" before "answer" is another request than the reverse. A body
    that holds no such object (the usual line: its sorted form is its only form) is dumped
    once, in C; one that does is rebuilt in Python, keeping those keys' order, and is sent
    as written (False)."""
    ordered = orjson.dumps(body, option=orjson.OPT_SORT_KEYS)
    if b'"properties"' not in ordered:
        return ordered, True
    return orjson.dumps(_sorted_but_properties(body)), False


def _sorted_but_properties(value: Any, *, keep: bool = False) -> Any:
    """`value` with every object's keys sorted, but for the objects under a `properties` key
    (`keep`), whose keys stay in the order written."""
    if isinstance(value, dict):
        keys = value if keep else sorted(value)
        return {k: _sorted_but_properties(value[k], keep=k == "properties") for k in keys}
    if isinstance(value, list):
        return [_sorted_but_properties(v) for v in value]
    return value


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


NO_GUARDS = InputGuards()  # the defaults: lines up to 1 MB, prompts of any length


class InputReader:
    """Iterates an input file as InputItem / BadLine, gathering stats as it goes."""

    def __init__(
        self,
        path: Path,
        *,
        endpoint: str = "chat",
        defaults: dict[str, Any] | None = None,
        guards: InputGuards = NO_GUARDS,
        prefixes: bool = False,
    ) -> None:
        self.path = path
        self.prefixes = prefixes  # key each line's long prompt prefix (prefixes.py)
        self.endpoint = endpoint
        self.defaults = defaults or {}
        self.max_line_bytes = guards.max_line_bytes
        self.max_input_chars = guards.max_input_chars
        self.max_input_tokens = guards.max_input_tokens
        self.stats = ReadStats()
        self._good_schemas: set[bytes] = set()

    def __iter__(self) -> Iterator[InputItem | BadLine]:
        try:
            f = self.path.open("rb")
        except FileNotFoundError:
            raise UsageError(f"input file not found: {self.path}") from None
        except IsADirectoryError:
            raise UsageError(f"input path is a directory: {self.path}") from None
        except PermissionError:
            raise UsageError(f"input file is not readable: {self.path}") from None
        with f:
            yield from self._read(f)

    def _read(self, f: IO[bytes]) -> Iterator[InputItem | BadLine]:
        digest = hashlib.sha256()
        limit = self.max_line_bytes
        number = 0
        while True:
            raw = f.readline(limit + 1)
            if not raw:
                break
            number += 1
            digest.update(raw)
            if len(raw) > limit and not raw.endswith(b"\n"):
                digest.update(self._skip_rest(f, digest))
                yield BadLine(number, f"line is longer than the limit of {limit} bytes")
                continue
            if number == 1 and raw.startswith(BOM):
                raw = raw[len(BOM) :]
            if not raw or (
                raw[0] != 0x7B and not raw.strip()
            ):  # 0x7B: "{", how nearly every line starts
                self.stats.blank_lines.append(number)
                continue
            yield self.parse_line(number, raw)
        self.stats.lines = number
        self.stats.file_digest = digest.hexdigest()

    @staticmethod
    def _skip_rest(f: IO[bytes], digest: Any) -> bytes:
        """Consume the remainder of an over-long line without holding it in memory."""
        while True:
            chunk = f.readline(_READ_CHUNK)
            if not chunk or chunk.endswith(b"\n"):
                return chunk
            digest.update(chunk)

    def parse_line(self, number: int, raw: bytes) -> InputItem | BadLine:
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            return BadLine(number, _json_error_reason(raw, exc))
        if not isinstance(obj, dict):
            return BadLine(number, f"expected a JSON object, got {_type_name(obj)}")
        try:
            # A NUL can only be there if the line spells one as an escape: skip the search else.
            return self._build(number, obj, may_hold_nul=b"\\u0000" in raw)
        except _LineProblem as problem:
            return BadLine(number, str(problem))

    def _build(self, number: int, obj: dict[str, Any], *, may_hold_nul: bool) -> InputItem:
        # The Batch API's shape, unless the line is a prompt (whose `body` field, an email's
        # say, is its own: kept as meta like any field that is not a request's)
        if ("custom_id" in obj or "body" in obj) and "prompt" not in obj and "messages" not in obj:
            endpoint, body, item_id, meta = _batch_shape(obj)
        else:
            endpoint, body, item_id, meta = _plain_shape(obj, self.endpoint)
        if item_id is None:
            item_id = str(number)
        if "response_format" in body:
            self._check_line_schema(body["response_format"])
        if may_hold_nul or self.max_input_chars is not None or self.max_input_tokens is not None:
            self._check_size(body)
        try:
            body_json, as_sent = canonical_json(body)
            meta_json = orjson.dumps(meta) if meta else None
        except TypeError as exc:  # e.g. lone surrogates cannot be encoded back
            raise _LineProblem(f"cannot be re-encoded as JSON: {exc}") from None
        if self.defaults:
            digest = canonical_digest(self.defaults, body)
        else:
            digest = hashlib.sha256(body_json).hexdigest()
        if not as_sent:  # a schema's properties: sent in the order written
            body_json = orjson.dumps(body)
        prefix = prefix_key(body) if self.prefixes else None
        return InputItem(number, item_id, endpoint, body_json, digest, meta_json, prefix)

    def _check_line_schema(self, fmt: Any) -> None:
        """A schema sent with a line must be usable, or every answer to it would be invalid.
        Checked once per distinct schema: lines of one job usually share it."""
        schema = schema_of(fmt)
        if schema is None:
            return
        key = orjson.dumps(schema, option=orjson.OPT_SORT_KEYS)
        if key not in self._good_schemas:
            problem = schema_problem(schema)
            if problem is not None:
                raise _LineProblem(f"its schema {problem}")
            if len(self._good_schemas) < 1000:
                self._good_schemas.add(key)

    def _check_size(self, body: dict[str, Any]) -> None:
        """Refuse prompts over the --max-input-* guards, and NUL characters, before anything is
        sent: a night's run should not find them one 400 at a time."""
        text = _prompt_texts(body)
        if any("\x00" in part for part in text):
            raise _LineProblem("the prompt contains a NUL character (\\u0000)")
        if self.max_input_chars is None and self.max_input_tokens is None:
            return
        chars = sum(len(part) for part in text)
        if self.max_input_chars is not None and chars > self.max_input_chars:
            raise _LineProblem(
                f"the prompt has {chars} characters, over --max-input-chars {self.max_input_chars}"
            )
        tokens = estimate_tokens(chars)
        if self.max_input_tokens is not None and tokens > self.max_input_tokens:
            raise _LineProblem(
                f"the prompt has about {tokens} tokens ({chars} characters / 4), over "
                f"--max-input-tokens {self.max_input_tokens}"
            )


def estimate_tokens(chars: int) -> int:
    """A tokenizer-free estimate: about 4 characters per token for English text."""
    return -(-chars // 4)


def prompt_chars(body: dict[str, Any]) -> int:
    """Characters of prompt text in a request body."""
    return sum(len(part) for part in _prompt_texts(body))


def _prompt_texts(body: dict[str, Any]) -> list[str]:
    """Every piece of prompt text in a request: the prompt and all message contents."""
    parts: list[str] = []
    if isinstance(body.get("prompt"), str):
        parts.append(body["prompt"])
    messages = body.get("messages")
    for msg in messages if isinstance(messages, list) else []:
        if not isinstance(msg, dict):
            continue
        content = msg.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(
                p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
            )
    return parts


class _LineProblem(Exception):
    """Internal: the reason one line is bad."""


def _type_name(value: Any) -> str:
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


def _json_error_reason(raw: bytes, exc: orjson.JSONDecodeError) -> str:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as ude:
        return f"not valid UTF-8 (byte {ude.start})"
    return f"invalid JSON: {exc.msg} (column {exc.colno})"


def _item_id(obj: dict[str, Any], key: str) -> str | None:
    if key not in obj:
        return None
    value = obj[key]
    if isinstance(value, float) and value.is_integer() and abs(value) >= 2**63:
        raise _LineProblem(
            f"{key!r} is an integer too large to keep exactly (over 64 bits); write it as a string"
        )
    if isinstance(value, float):
        if not value.is_integer():
            raise _LineProblem(f"{key!r} is a non-integer number ({value!r}); write it as a string")
        raise _LineProblem(f"{key!r} is a decimal ({value!r}); write it as an integer or a string")
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise _LineProblem(f"{key!r} must be a string or an integer, got {_type_name(value)}")
    text = str(value)
    if not text.strip():
        raise _LineProblem(f"{key!r} is empty")
    return text


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise _LineProblem("'messages' must be a non-empty array")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise _LineProblem(f"messages[{i}] must be an object, got {_type_name(msg)}")
        if not isinstance(msg.get("role"), str):
            raise _LineProblem(f"messages[{i}] needs a string 'role'")
        content = msg.get("content")
        if not isinstance(content, (str, list)) and not (content is None and "tool_calls" in msg):
            raise _LineProblem(f"messages[{i}] needs 'content' as a string or an array")


def _check_prompt(prompt: Any) -> None:
    if not isinstance(prompt, str):
        raise _LineProblem(f"'prompt' must be a string, got {_type_name(prompt)}")
    if not prompt.strip():
        raise _LineProblem("'prompt' is empty")


def _plain_shape(
    obj: dict[str, Any], endpoint: str
) -> tuple[str, dict[str, Any], str | None, dict[str, Any]]:
    item_id = _item_id(obj, "id")
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
            raise _LineProblem("has both 'schema' and 'response_format'; give one")
        body["response_format"] = response_format("json_schema", meta.pop(SCHEMA_KEY))
    if "messages" in obj:
        if "prompt" in obj:
            raise _LineProblem("has both 'prompt' and 'messages'; give one")
        _check_messages(obj["messages"])
        if endpoint != "chat":
            raise _LineProblem("'messages' needs the chat endpoint (job uses completions)")
        body["messages"] = obj["messages"]
    elif "prompt" in obj:
        _check_prompt(obj["prompt"])
        if endpoint == "chat":
            body["messages"] = [{"role": "user", "content": obj["prompt"]}]
        else:
            body["prompt"] = obj["prompt"]
    else:
        raise _LineProblem("no 'prompt', 'messages' or batch 'body' field")
    return endpoint, body, item_id, meta


def _batch_shape(obj: dict[str, Any]) -> tuple[str, dict[str, Any], str | None, dict[str, Any]]:
    item_id = _item_id(obj, "custom_id")
    method = obj.get("method", "POST")
    if method != "POST":
        raise _LineProblem(f"batch 'method' must be POST, got {method!r}")
    url = obj.get("url")
    endpoint = BATCH_URLS.get(url) if isinstance(url, str) else None
    if endpoint is None:
        raise _LineProblem(f"batch 'url' must be one of {', '.join(BATCH_URLS)}, got {url!r}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise _LineProblem(f"batch 'body' must be an object, got {_type_name(body)}")
    if endpoint == "chat":
        _check_messages(body.get("messages"))
    else:
        _check_prompt(body.get("prompt"))
    body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    meta = {k: v for k, v in obj.items() if k not in ("custom_id", "method", "url", "body")}
    return endpoint, body, item_id, meta
