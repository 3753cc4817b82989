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
from batchrun.line_shape import (
    LONG_DIGITS,
    LineProblem,
    batch_shape,
    counts_checked,
    only_calls,
    plain_shape,
    refuse_wide_integers,
    type_name,
)
from batchrun.prefixes import prefix_key
from batchrun.validate import schema_of, schema_problem

BOM = b"\xef\xbb\xbf"
_READ_CHUNK = 1 << 16


@dataclass
class ReadStats:
    blank_lines: list[int] = field(default_factory=list)
    lines: int = 0
    file_digest: str = ""


def canonical_digest(body: dict[str, Any]) -> str:
    """sha256 of a line's own request fields in their canonical form (canonical_json). The
    run's defaults (--model, --temperature...) are not in it: they are in the answer's options
    (reuse.answer_spec), which is what they are when the request is sent. A digest made with
    the defaults given at submit matched an answer that a resume under other defaults made."""
    return hashlib.sha256(canonical_json(body)[0]).hexdigest()


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
        guards: InputGuards = NO_GUARDS,
        prefixes: bool = False,
    ) -> None:
        self.path = path
        self.prefixes = prefixes  # key each line's long prompt prefix (prefixes.py)
        self.endpoint = endpoint
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
            raw = f.readline(limit + 2)  # the line and its end, "\n" or "\r\n"
            if not raw:
                break
            number += 1
            digest.update(raw)
            if len(raw) > limit and len(raw.rstrip(b"\r\n")) > limit:
                if not raw.endswith(b"\n"):
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
            return BadLine(number, f"expected a JSON object, got {type_name(obj)}")
        try:
            # A NUL can only be there if the line spells one as an escape: skip the search else.
            built = self._build(number, obj, may_hold_nul=b"\\u0000" in raw)
            if LONG_DIGITS.search(raw):  # the only lines that may hold an integer over 64 bits
                refuse_wide_integers(raw)
        except LineProblem as problem:
            return BadLine(number, str(problem))
        return built

    def _build(self, number: int, obj: dict[str, Any], *, may_hold_nul: bool) -> InputItem:
        # The Batch API's shape, unless the line is a prompt (whose `body` field, an email's
        # say, is its own: kept as meta like any field that is not a request's)
        if ("custom_id" in obj or "body" in obj) and "prompt" not in obj and "messages" not in obj:
            endpoint, body, item_id, meta = batch_shape(obj)
        else:
            endpoint, body, item_id, meta = plain_shape(obj, self.endpoint)
        if item_id is None:
            item_id = str(number)
        counts_checked(body)
        if body.get("tools") and only_calls(body.get("tool_choice")):
            raise LineProblem(
                "asks for nothing but a tool call ('tool_choice'), and batchrun keeps text "
                "answers, not tool calls (for JSON answers give a 'schema')"
            )
        if "response_format" in body:
            self._check_line_schema(body["response_format"])
        if may_hold_nul or self.max_input_chars is not None or self.max_input_tokens is not None:
            self._check_size(body)
        try:
            body_json, as_sent = canonical_json(body)
            meta_json = orjson.dumps(meta) if meta else None
        except TypeError as exc:  # e.g. lone surrogates cannot be encoded back
            raise LineProblem(f"cannot be re-encoded as JSON: {exc}") from None
        digest = hashlib.sha256(body_json).hexdigest()  # canonical_digest(body), once dumped
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
        try:
            key = orjson.dumps(schema, option=orjson.OPT_SORT_KEYS)
        except TypeError as exc:  # nested past orjson's depth
            raise LineProblem(f"its schema cannot be re-encoded as JSON: {exc}") from None
        if key not in self._good_schemas:
            problem = schema_problem(schema)
            if problem is not None:
                raise LineProblem(f"its schema {problem}")
            if len(self._good_schemas) < 1000:
                self._good_schemas.add(key)

    def _check_size(self, body: dict[str, Any]) -> None:
        """Refuse prompts over the --max-input-* guards, and NUL characters, before anything is
        sent: a night's run should not find them one 400 at a time."""
        text = _prompt_texts(body)
        if any("\x00" in part for part in text):
            raise LineProblem("the prompt contains a NUL character (\\u0000)")
        if self.max_input_chars is None and self.max_input_tokens is None:
            return
        chars = sum(len(part) for part in text)
        if self.max_input_chars is not None and chars > self.max_input_chars:
            raise LineProblem(
                f"the prompt has {chars} characters, over --max-input-chars {self.max_input_chars}"
            )
        tokens = estimate_tokens(chars)
        if self.max_input_tokens is not None and tokens > self.max_input_tokens:
            raise LineProblem(
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


def _json_error_reason(raw: bytes, exc: orjson.JSONDecodeError) -> str:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as ude:
        return f"not valid UTF-8 (byte {ude.start})"
    return f"invalid JSON: {exc.msg} (column {exc.colno})"
