"""JSON answers from the simulated model: valid ones built from a schema, and the ways real
models get JSON wrong (fences, prose around it, broken syntax, schema violations).

A request with a schema in `response_format` gets what constrained decoding gives: JSON valid
for that schema. Without one, the simulator answers in the styles its config asks for, against
the schema it was told (`json_schema`), so tests can produce every case on purpose. A repair
follow-up (the conversation holds the model's earlier answer) gets valid JSON unless
`repair_fixes` is off. Seeded by the prompt, so the same prompt always gets the same answer.
"""

from __future__ import annotations

import contextlib
import math
import random
import re
from typing import Any

import orjson

JSON_STYLES = ("valid", "fenced", "prose", "broken", "violating")

DEFAULT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "score": {"type": "integer", "minimum": 0, "maximum": 10},
    },
    "required": ["name", "score"],
}


def is_repair(request: dict[str, Any]) -> bool:
    """A follow-up that shows the model its own earlier answer."""
    messages = request.get("messages")
    if isinstance(messages, list):
        return any(isinstance(m, dict) and m.get("role") == "assistant" for m in messages)
    prompt = request.get("prompt")
    return isinstance(prompt, str) and "corrected JSON" in prompt


def pick_style(styles: dict[str, float], rng: random.Random) -> str:
    """One style by its rate; what the rates leave over is valid JSON."""
    roll = rng.random()
    for style in JSON_STYLES:
        roll -= styles.get(style, 0.0)
        if roll < 0:
            return style
    return "valid"


def json_text(schema: dict[str, Any], style: str, rng: random.Random) -> str:
    value = instance(schema, rng)
    text = orjson.dumps(value).decode()
    if style == "fenced":
        return f"Here is the JSON you asked for:\n```json\n{text}\n```"
    if style == "prose":
        return f"Sure! The answer is {text} and I hope that helps."
    if style == "broken":
        return text[:-1] + ","  # the closing bracket lost, a trailing comma instead
    if style == "violating":
        return orjson.dumps(_violate(value)).decode()
    return text


def instance(schema: dict[str, Any], rng: random.Random, root: Any = None) -> Any:
    """A value valid for the common JSON Schema keywords (what extraction schemas use, and
    what pydantic writes: `$defs` and `$ref`s into them)."""
    root = schema if root is None else root
    if isinstance(schema.get("$ref"), str):
        return instance(_pointed(root, schema["$ref"]), rng, root)
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return rng.choice(schema["enum"])
    for key in ("anyOf", "oneOf", "allOf"):
        if schema.get(key):
            return instance(schema[key][0], rng, root)
    kind = schema.get("type", "object")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object":
        props = schema.get("properties") or {}
        return {name: instance(sub, rng, root) for name, sub in props.items()}
    if kind == "array":
        count = max(int(schema.get("minItems", 1)), 1)
        count = min(count, int(schema.get("maxItems", count)))
        items = schema.get("items") or {"type": "string"}
        return [instance(items, rng, root) for _ in range(count)]
    if kind in ("integer", "number"):
        return _number(schema, rng, kind == "integer")
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    return _string(schema, rng)


def _pointed(root: Any, ref: str) -> dict[str, Any]:
    """The subschema a local `$ref` ("#/$defs/Money") points to; {} (anything) otherwise."""
    node = root
    for part in ref.removeprefix("#").strip("/").split("/") if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        node = node.get(part) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else {}


def _number(schema: dict[str, Any], rng: random.Random, integer: bool) -> float | int:
    """Within the bounds: a whole number for `integer` (exclusive bounds one in), else one
    near the middle, strictly inside. 0-100 where no bound is given."""
    low, low_open = _edge(schema, "minimum", "exclusiveMinimum")
    high, high_open = _edge(schema, "maximum", "exclusiveMaximum")
    if low is None:
        low = high - 100 if high is not None else 0
    if high is None:
        high = low + 100
    if not integer:
        return round(float(low + (high - low) * (0.4 + 0.2 * rng.random())), 6)
    lo = math.floor(low) + 1 if low_open else math.ceil(low)
    hi = math.ceil(high) - 1 if high_open else math.floor(high)
    return rng.randint(lo, max(lo, hi))


def _edge(schema: dict[str, Any], inclusive: str, exclusive: str) -> tuple[Any, bool]:
    if inclusive in schema:
        return schema[inclusive], False
    return schema.get(exclusive), exclusive in schema


_ALPHABETS = ("abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZ", "0123456789")


def _string(schema: dict[str, Any], rng: random.Random) -> str:
    """Letters, as many as the length bounds allow (5 if free); with a `pattern`, the first of
    a few simple strings it matches (digits or capitals of some length), else letters."""
    low = int(schema.get("minLength", 1))
    high = max(low, int(schema.get("maxLength", max(low, 5))))
    length = min(max(low, 5), high)
    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        for size in range(max(low, 1), min(high, 12) + 1):
            for letters in _ALPHABETS:
                text = "".join(rng.choice(letters) for _ in range(size))
                with contextlib.suppress(re.error):  # not Python's regex: letters, then
                    if re.search(pattern, text):
                        return text
    return "".join(rng.choice(_ALPHABETS[0]) for _ in range(length))


def _violate(value: Any) -> Any:
    """The same answer with one field of the wrong type (or the wrong type altogether)."""
    if isinstance(value, dict) and value:
        first = next(iter(value))
        return {**value, first: [] if not isinstance(value[first], list) else "oops"}
    return {"unexpected": value}


def pieces(text: str, size: int = 4) -> list[str]:
    """The answer as the tokens it is streamed in (about 4 characters each)."""
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]
