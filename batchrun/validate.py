"""Checking outputs against a JSON Schema: find the JSON in the text, parse it, validate it;
and the requests that carry a schema: constrained decoding and the repair follow-up.

Models wrap JSON in prose or ```json fences; the whole text is tried first, then a fenced block,
then the first balanced object or array. A truncated answer (finish_reason "length") is never
accepted as valid, even if a prefix happens to parse.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError, ValidationError
from referencing import Registry
from referencing.exceptions import Unresolvable
from referencing.jsonschema import DRAFT202012

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
    except RecursionError:
        return "is nested too deeply to check"
    return _unresolved(schema)


def _unresolved(schema: dict[str, Any]) -> str | None:
    """A `$ref` inside the schema itself ("#/$defs/price") that points nowhere: found only at
    the first answer's validation otherwise, after the requests were paid for. A schema with
    `$id`s of its own inside, or refs to other documents, is left to validation (batchrun
    fetches no schema from elsewhere)."""
    refs: list[str] = []
    if _local_refs(schema, refs, top=True):
        return None
    # referencing: the library jsonschema resolves refs with (its dependency, not ours)
    resolver = Registry().resolver_with_root(DRAFT202012.create_resource(schema))
    for ref in refs:
        try:
            resolver.lookup(ref)
        except Unresolvable:
            return f"has a $ref that points nowhere: {ref}"
    return None


# The keywords whose values are schemas (a ref in them is resolved), by how they hold them;
# `const`, `enum`, `examples`, `default` and unknown keywords hold data, never looked into.
_ONE = (
    "not",
    "if",
    "then",
    "else",
    "items",
    "contains",
    "additionalProperties",
    "propertyNames",
    "unevaluatedItems",
    "unevaluatedProperties",
    "additionalItems",
)
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems")
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _local_refs(schema: Any, refs: list[str], *, top: bool = False) -> bool:
    """Collect the refs into this document ('#...') in `schema` and its subschemas; True if a
    nested `$id` makes them relative to another document (then none is judged here)."""
    if not isinstance(schema, dict):
        return False
    if not top and isinstance(schema.get("$id"), str):
        return True
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        refs.append(ref)
    subs = [schema.get(key) for key in _ONE]
    subs += [sub for key in _LIST if isinstance(schema.get(key), list) for sub in schema[key]]
    named = (schema.get(key) for key in _NAMED)
    subs += [sub for group in named if isinstance(group, dict) for sub in group.values()]
    return any(_local_refs(sub, refs) for sub in subs)


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
    """Return the first JSON value found in text; raise ValueError if there is none.

    Strict JSON only: `NaN` and `Infinity` are not JSON, and an integer past 64 bits, which
    would come back another number (a float), is refused rather than changed."""
    refused: list[str] = []  # values found but refused: said if nothing else is found
    stripped = text.strip()
    candidates = [stripped, *(m.group(1).strip() for m in _FENCE.finditer(text))]
    for candidate in candidates:
        if candidate:
            try:
                return _strict_loads(candidate)
            except _Refused as exc:
                refused.append(str(exc))
            except (ValueError, RecursionError):
                pass
    for start, char in enumerate(text):
        if char in "{[":
            try:
                value, _end = _DECODER.raw_decode(text, start)
            except RecursionError:
                raise ValueError("the output's JSON is nested too deeply to read") from None
            except _Refused as exc:  # not a value inside it either: it is not what it says
                raise ValueError(str(exc)) from None
            except ValueError:
                continue
            return value
    raise ValueError(refused[0] if refused else "no JSON object or array found in the output")


def _strict_loads(candidate: str) -> Any:
    if _LONG_NUMBER.search(candidate):  # orjson would make a float of a wider integer
        return _DECODER.decode(candidate)
    return orjson.loads(candidate)


class _Refused(ValueError):
    """JSON-like text that is not JSON, or that would not come back as written."""


def kept_exactly(value: int) -> bool:
    """Whether orjson reads this integer back as itself (64 bits, signed or not), not as a
    float: the one rule for answers and input lines alike."""
    return -(2**63) <= value < 2**64


def _exact_int(literal: str) -> int:
    value = int(literal)
    if not kept_exactly(value):
        raise _Refused(f"an integer too large to keep exactly: {literal[:30]}")
    return value


def _not_json(constant: str) -> Any:
    raise _Refused(f"{constant} is not JSON")


def _finite(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):  # 1e400: Infinity by another name
        raise _Refused(f"a number too large for a float: {literal[:30]}")
    return value


_LONG_NUMBER = re.compile(r"\d{19}")
_DECODER = json.JSONDecoder(parse_int=_exact_int, parse_constant=_not_json, parse_float=_finite)


class SchemaCheck:
    def __init__(self, schema: dict[str, Any]) -> None:
        self.validator = Draft202012Validator(schema)

    def check(self, text: str, finish_reason: str | None) -> Verdict:
        """The answer judged: never raises, whatever the text (a run must not stop, and an
        item must not go back to be paid for again, for one odd answer)."""
        if finish_reason == "length":
            return Verdict(False, None, "truncated: the answer hit max_tokens before it ended")
        try:
            value = extract_json(text)
            parsed = orjson.dumps(value).decode()
        except (ValueError, TypeError) as exc:  # TypeError: a lone surrogate, not UTF-8
            return Verdict(False, None, _short(str(exc)))
        try:
            error = next(iter(self.validator.iter_errors(value)), None)
        except Exception as exc:  # a $ref that resolves nowhere, a recursion too deep
            return Verdict(False, parsed, _short(f"cannot validate the answer: {exc}"))
        if error is None:
            return Verdict(True, parsed, None)
        where = "/".join(str(p) for p in error.absolute_path) or "(root)"
        return Verdict(False, parsed, _short(f"schema violation at {where}: {_rule(error)}"))


def _rule(error: ValidationError) -> str:
    """The rule an answer broke, without the value that broke it: the answer is beside it in
    the repair and in the results, and lines that break one rule share one error (`status`
    counts the commonest)."""
    found = repr(error.instance)
    message = error.message
    return f"the value{message[len(found) :]}" if message.startswith(found) else message


def _short(error: str) -> str:
    return error if len(error) <= ERROR_CHARS else error[: ERROR_CHARS - 1] + "…"


ERROR_CHARS = 300  # an error says what is wrong; the answer itself is kept beside it
