"""Checking outputs against a JSON Schema: find the JSON in the text, parse it, validate it;
and the requests that carry a schema: constrained decoding and the repair follow-up.

Models wrap JSON in prose or ```json fences; the whole text is tried first, then a fenced block,
then the first balanced object or array. A truncated answer (finish_reason "length") is never
accepted as valid, even if a prefix happens to parse.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from batchrun.errors import UsageError

_FENCE = re.compile(r"```(?:json|JSON)?\s*\n?(.*?)```", re.DOTALL)


@dataclass(frozen=True)
class Verdict:
    ok: bool
    parsed: str | None  # the extracted JSON, re-serialised
    error: str | None


REPAIR_INSTRUCTION = (
    "Your previous answer could not be used: {error}. Reply with only the corrected JSON, "
    "no other text. It must validate against this JSON Schema: {schema}"
)


def schema_problem(schema: Any) -> str | None:
    """Why `schema` is not a usable JSON Schema (draft 2020-12), or None if it is."""
    if not isinstance(schema, dict):
        return "must be a JSON object"
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        return f"is not a valid JSON Schema: {exc.message}"
    return None


def response_format(style: str, schema: dict[str, Any]) -> dict[str, Any]:
    """The request field that asks a server to constrain its output to `schema`."""
    if style == "json_object":  # llama.cpp: grammar built from the schema
        return {"type": "json_object", "schema": schema}
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}


def schema_of(fmt: Any) -> dict[str, Any] | None:
    """The schema inside a response_format of either style, if it holds one."""
    if not isinstance(fmt, dict):
        return None
    inner = fmt.get("json_schema")
    schema = inner.get("schema") if isinstance(inner, dict) else fmt.get("schema")
    return schema if isinstance(schema, dict) else None


def repair_body(
    endpoint: str, body: dict[str, Any], output: str, error: str, schema: dict[str, Any]
) -> dict[str, Any]:
    """The follow-up request: the conversation so far, the invalid answer and what is wrong."""
    note = REPAIR_INSTRUCTION.format(error=error, schema=orjson.dumps(schema).decode())
    if endpoint == "chat":
        messages = [
            *body["messages"],
            {"role": "assistant", "content": output},
            {"role": "user", "content": note},
        ]
        return {**body, "messages": messages}
    return {**body, "prompt": f"{body['prompt']}{output}\n\n{note}\n"}


def load_schema(path: str) -> dict[str, Any]:
    try:
        schema = orjson.loads(Path(path).read_bytes())
    except FileNotFoundError:
        raise UsageError(f"schema file not found: {path}") from None
    except OSError as exc:
        raise UsageError(f"cannot read schema file {path}: {exc.strerror or exc}") from None
    except orjson.JSONDecodeError as exc:
        raise UsageError(f"schema file {path} is not valid JSON: {exc}") from None
    problem = schema_problem(schema)
    if problem is not None:
        raise UsageError(f"schema file {path} {problem}")
    return schema  # type: ignore[no-any-return]


def extract_json(text: str) -> Any:
    """Return the first JSON value found in text; raise ValueError if there is none."""
    stripped = text.strip()
    candidates = [stripped, *(m.group(1).strip() for m in _FENCE.finditer(text))]
    for candidate in candidates:
        if candidate:
            try:
                return orjson.loads(candidate)
            except orjson.JSONDecodeError:
                pass
    decoder = json.JSONDecoder()
    for start, char in enumerate(text):
        if char in "{[":
            try:
                value, _end = decoder.raw_decode(text, start)
            except json.JSONDecodeError:
                continue
            return value
    raise ValueError("no JSON object or array found in the output")


class SchemaCheck:
    def __init__(self, schema: dict[str, Any]) -> None:
        self.validator = Draft202012Validator(schema)

    def check(self, text: str, finish_reason: str | None) -> Verdict:
        if finish_reason == "length":
            return Verdict(False, None, "truncated: the answer hit max_tokens before it ended")
        try:
            value = extract_json(text)
        except ValueError as exc:
            return Verdict(False, None, str(exc))
        parsed = orjson.dumps(value).decode()
        error = next(iter(self.validator.iter_errors(value)), None)
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path) or "(root)"
            return Verdict(False, parsed, f"schema violation at {where}: {error.message}")
        return Verdict(True, parsed, None)
