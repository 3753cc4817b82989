"""What `batchrun bench` sends: four built-in prompt classes, or a user's suite file.

Each class has its own max_tokens (short answers and JSON extraction 128, long-document
summaries and code 1024) so one class's long answers do not hide another's latency. Prompts are
generated from a fixed seed: two runs, on two endpoints, send exactly the same requests.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from batchrun.errors import UsageError
from batchrun.validate import schema_problem

SEED = 20261130
SAMPLING = {"temperature": 0.2, "top_p": 0.9}

EXTRACTION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "product": {"type": "string"},
        "price": {"type": "number"},
        "in_stock": {"type": "boolean"},
    },
    "required": ["product", "price", "in_stock"],
}

_TOPICS = [
    "a steel water bottle",
    "a wool blanket",
    "a cast-iron pan",
    "a desk lamp",
    "a pair of running shoes",
    "a bamboo cutting board",
    "a travel backpack",
    "a ceramic teapot",
    "a wireless keyboard",
    "a garden hose",
]
_FACTS = [
    "It ships in two days.",
    "The warehouse in Lyon restocked it last week.",
    "Customers praise its weight.",
    "Returns rose after the spring launch.",
    "The supplier changed the packaging in March.",
    "It is the top seller in Norway.",
    "Reviews mention the colour fading.",
    "The price dropped by ten percent.",
]


@dataclass(frozen=True)
class BenchClass:
    name: str
    max_tokens: int
    prompts: tuple[str, ...]
    schema: dict[str, Any] | None = None  # answers are checked against it (JSON class)


@dataclass
class Suite:
    classes: list[BenchClass] = field(default_factory=list)

    def names(self) -> list[str]:
        return [c.name for c in self.classes]


def builtin_suite(count: int = 16, seed: int = SEED) -> Suite:
    rng = random.Random(seed)

    def doc(sentences: int) -> str:
        return " ".join(rng.choice(_FACTS) for _ in range(sentences))

    # Each prompt its own from its first words: one sent twice, or sharing a long start with
    # another, would be prefilled from the server's prompt cache (its TTFT free of prefill).
    short = tuple(
        f"Question {i + 1}: in one sentence, what is {rng.choice(_TOPICS)} used for?"
        for i in range(count)
    )
    summary = tuple(
        f"Summarise this report in five bullet points.\n\n{doc(120)}" for _ in range(count)
    )
    code = tuple(
        f"Task {i + 1}: write a Python function that parses a CSV of {rng.choice(_TOPICS)} "
        f"orders and returns the total per day, with tests."
        for i in range(count)
    )
    extraction = tuple(
        f"Extract product, price and in_stock as JSON from: 'Offer: {rng.choice(_TOPICS)} for "
        f"{rng.randint(5, 300)}.{rng.randint(0, 99):02d} EUR, {rng.choice(['in', 'out of'])} "
        f"stock. {doc(2)}'"
        for _ in range(count)
    )
    return Suite(
        [
            BenchClass("short", 128, short),
            BenchClass("summary", 1024, summary),
            BenchClass("code", 1024, code),
            BenchClass("json", 128, extraction, EXTRACTION_SCHEMA),
        ]
    )


def load_suite(path: Path) -> Suite:
    """A user suite: JSONL lines with `class` and `prompt`, optional `max_tokens` (default 128)
    and `schema`; the first line of a class sets its max_tokens and schema."""
    classes: dict[str, dict[str, Any]] = {}
    try:
        lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise UsageError(f"cannot read suite {path}: {exc.strerror or exc}") from None
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise UsageError(f"{path}: line {number}: invalid JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise UsageError(f"{path}: line {number}: expected a JSON object")
        name, prompt = obj.get("class"), obj.get("prompt")
        if not isinstance(name, str) or not name:
            raise UsageError(f"{path}: line {number}: needs a 'class' string")
        if not isinstance(prompt, str) or not prompt.strip():
            raise UsageError(f"{path}: line {number}: needs a non-empty 'prompt' string")
        entry = classes.setdefault(
            name,
            {"max_tokens": obj.get("max_tokens", 128), "schema": obj.get("schema"), "prompts": []},
        )
        if not isinstance(entry["max_tokens"], int) or entry["max_tokens"] < 1:
            raise UsageError(f"{path}: line {number}: 'max_tokens' must be a positive integer")
        if entry["schema"] is not None and (problem := schema_problem(entry["schema"])):
            raise UsageError(f"{path}: line {number}: 'schema' {problem}")
        entry["prompts"].append(prompt)
    if not classes:
        raise UsageError(f"suite {path} has no prompts")
    return Suite(
        [
            BenchClass(n, e["max_tokens"], tuple(e["prompts"]), e["schema"])
            for n, e in classes.items()
        ]
    )


def select(suite: Suite, names: list[str] | None, max_tokens: int | None) -> Suite:
    """Only the named classes; --max-tokens overrides every class's own."""
    chosen = suite.classes
    if names:
        unknown = sorted(set(names) - set(suite.names()))
        if unknown:
            raise UsageError(f"unknown class(es) {unknown}; the suite has {suite.names()}")
        chosen = [c for c in chosen if c.name in names]
    if max_tokens is not None:
        chosen = [BenchClass(c.name, max_tokens, c.prompts, c.schema) for c in chosen]
    return Suite(chosen)


def request_body(cls: BenchClass, index: int, model: str | None, seed: int) -> dict[str, Any]:
    """The index-th request of a class (prompts are used in turn)."""
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": cls.prompts[index % len(cls.prompts)]}],
        "max_tokens": cls.max_tokens,
        "seed": seed,
        **SAMPLING,
    }
    if model:
        body["model"] = model
    return body
