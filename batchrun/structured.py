"""Structured outputs for one item: which request to send next, and when its answer is final.

An item's schema is the one its input line carries (as `response_format` or the `schema`
shorthand) or else the job's `--schema`. The first request asks the server to enforce it
(`response_format`, in the preset's style) unless guidance is off or the server refused it. An
answer that does not validate gets up to `repair_attempts` follow-ups showing it its error; an
answer cut by max_tokens is retried with max_tokens doubled when `--on-truncate retry-longer`
asks for it. Pure: the runner sends the requests and feeds the answers back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from batchrun.backends.base import Completion
from batchrun.validate import SchemaCheck, repair_body, response_format, schema_of


@dataclass(frozen=True)
class Outcome:
    """An item's final verdict on the answer it ends with."""

    status: str  # done | invalid
    parsed: str | None
    error: str | None


@dataclass
class OutputRules:
    """The job's structured-output settings, shared by all its items."""

    schema: dict[str, Any] | None = None
    guided_style: str | None = "json_schema"  # None: never send response_format
    repair_attempts: int = 1
    retry_longer: bool = False
    max_tokens_cap: int = 4096
    guided_refused: str | None = None  # the server's 400 once it refused response_format
    _checks: dict[bytes, SchemaCheck] = field(default_factory=dict)

    def plan(self, endpoint: str, body: dict[str, Any]) -> AnswerPlan:
        return AnswerPlan(self, endpoint, body)

    def check_for(self, schema: dict[str, Any]) -> SchemaCheck:
        """One compiled validator per distinct schema (per-line schemas often repeat)."""
        key = orjson.dumps(schema, option=orjson.OPT_SORT_KEYS)
        check = self._checks.get(key)
        if check is None:
            check = self._checks[key] = SchemaCheck(schema)
        return check


class AnswerPlan:
    def __init__(self, rules: OutputRules, endpoint: str, body: dict[str, Any]) -> None:
        self.rules = rules
        self.endpoint = endpoint
        line_schema = schema_of(body.get("response_format"))
        self.schema = line_schema or rules.schema
        self.check = rules.check_for(self.schema) if self.schema is not None else None
        if line_schema is not None:  # re-sent in the preset's style, or not at all
            body = {k: v for k, v in body.items() if k != "response_format"}
        self._body = body
        self.unguided = False  # this item's server refused the schema: send without it
        self.repairs = 0
        self.repair_prompt_tokens = 0
        self.repair_completion_tokens = 0
        self.longer = 0  # retries with a larger max_tokens
        self.usage: tuple[int | None, int | None] = (None, None)  # (prompt, completion) tokens

    @property
    def guided(self) -> bool:
        """Whether the next request carries the schema for constrained decoding."""
        return (
            self.schema is not None
            and self.rules.guided_style is not None
            and self.rules.guided_refused is None
            and not self.unguided
        )

    def request(self) -> dict[str, Any]:
        """The body of the next request to send for this item."""
        if not self.guided:
            return self._body
        assert self.schema is not None and self.rules.guided_style is not None
        return {**self._body, "response_format": response_format(self.rules.guided_style,
                                                                 self.schema)}  # fmt: skip

    def judge(self, completion: Completion) -> Outcome | None:
        """The answer's verdict, or None when another request should be sent (see request())."""
        if self.repairs:
            self.repair_prompt_tokens += completion.prompt_tokens or 0
            self.repair_completion_tokens += completion.completion_tokens or 0
        else:  # the item's own ask (or its longer retry): its usage is the item's usage
            self.usage = (completion.prompt_tokens, completion.completion_tokens)
        if completion.finish_reason == "length" and self._grow_max_tokens(completion):
            return None
        if self.check is None:
            return Outcome("done", None, None)
        verdict = self.check.check(completion.text, completion.finish_reason)
        if verdict.ok:
            return Outcome("done", verdict.parsed, None)
        assert verdict.error is not None and self.schema is not None
        if completion.finish_reason != "length" and self.repairs < self.rules.repair_attempts:
            self.repairs += 1
            self._body = repair_body(self.endpoint, self._body, completion.text, verdict.error,
                                     self.schema)  # fmt: skip
            return None
        return Outcome("invalid", verdict.parsed, verdict.error)

    def _grow_max_tokens(self, completion: Completion) -> bool:
        if not self.rules.retry_longer:
            return False
        key = "max_completion_tokens" if "max_completion_tokens" in self._body else "max_tokens"
        current = self._body.get(key) or completion.completion_tokens
        cap = self.rules.max_tokens_cap
        if not isinstance(current, int) or current >= cap:
            return False
        self._body = {**self._body, key: min(cap, current * 2)}
        self.longer += 1
        return True
