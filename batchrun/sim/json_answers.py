"""JSON answers from the simulated model: valid ones built from a schema, and the ways real
models get JSON wrong (fences, prose around it, broken syntax, schema violations).

A request with a schema in `response_format` gets what constrained decoding gives: JSON valid
for that schema. Without one, the simulator answers in the styles its config asks for, against
the schema it was told (`json_schema`), so tests can produce every case on purpose. A repair
follow-up (the conversation holds the model's earlier answer) gets valid JSON unless
`repair_fixes` is off. Seeded by the prompt, so the same prompt always gets the same answer.
"""

from __future__ import annotations

import random
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


def instance(schema: dict[str, Any], rng: random.Random) -> Any:
    """A value valid for the common JSON Schema keywords (what extraction schemas use)."""
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return rng.choice(schema["enum"])
    for key in ("anyOf", "oneOf", "allOf"):
        if schema.get(key):
            return instance(schema[key][0], rng)
    kind = schema.get("type", "object")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object":
        props = schema.get("properties") or {}
        return {name: instance(sub, rng) for name, sub in props.items()}
    if kind == "array":
        count = max(int(schema.get("minItems", 1)), 1)
        return [instance(schema.get("items") or {"type": "string"}, rng) for _ in range(count)]
    if kind == "integer":
        low, high = int(schema.get("minimum", 0)), int(schema.get("maximum", 100))
        return rng.randint(low, max(low, high))
    if kind == "number":
        lo, hi = float(schema.get("minimum", 0)), float(schema.get("maximum", 100))
        return round(rng.uniform(lo, max(lo, hi)), 2)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    length = max(int(schema.get("minLength", 1)), 5)
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(length))


def _violate(value: Any) -> Any:
    """The same answer with one field of the wrong type (or the wrong type altogether)."""
    if isinstance(value, dict) and value:
        first = next(iter(value))
        return {**value, first: [] if not isinstance(value[first], list) else "oops"}
    return {"unexpected": value}


def pieces(text: str, size: int = 4) -> list[str]:
    """The answer as the tokens it is streamed in (about 4 characters each)."""
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]
