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

MAX_LONGER = 12  # doublings: 1 token to 4096 and then some


def _add(total: int | None, more: int | None) -> int | None:
    return more if total is None else total + (more or 0)


TOOL_CALLS = ("tool_calls", "function_call")
TOOL_CALL_ERROR = "the answer is a tool call; batchrun keeps text answers, not tool calls"


@dataclass(frozen=True)
class Outcome:
    """An item's final verdict on the answer it ends with."""

    status: str  # done | invalid | failed (a tool call)
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
    # Schemas (by key) the server refused as response_format, with its 400: those go
    # unguided from then on; other schemas (another line's, the job's) stay guided.
    refused: dict[bytes, str] = field(default_factory=dict)
    _checks: dict[bytes, SchemaCheck] = field(default_factory=dict)

    def plan(self, endpoint: str, body: dict[str, Any]) -> AnswerPlan:
        return AnswerPlan(self, endpoint, body)

    def check_for(self, schema: dict[str, Any]) -> SchemaCheck:
        """One compiled validator per distinct schema (per-line schemas often repeat)."""
        key = schema_key(schema)
        check = self._checks.get(key)
        if check is None:
            check = self._checks[key] = SchemaCheck(schema)
        return check

    def refuse(self, schema: dict[str, Any], error: str) -> bool:
        """Note that the server refused this schema; True the first time (to say so once)."""
        key = schema_key(schema)
        first = key not in self.refused
        self.refused.setdefault(key, error)
        return first


def schema_key(schema: dict[str, Any]) -> bytes:
    return orjson.dumps(schema, option=orjson.OPT_SORT_KEYS)


class AnswerPlan:
    def __init__(self, rules: OutputRules, endpoint: str, body: dict[str, Any]) -> None:
        self.rules = rules
        self.endpoint = endpoint
        line_schema = schema_of(body.get("response_format"))
        self.schema = line_schema or rules.schema
        self.check = rules.check_for(self.schema) if self.schema is not None else None
        self._key = schema_key(self.schema) if self.schema is not None else b""
        if line_schema is not None:  # re-sent in the preset's style, or not at all
            body = {k: v for k, v in body.items() if k != "response_format"}
        self._body = body
        self.unguided = False  # this item's server refused the schema: send without it
        self.repairs = 0
        self.repair_prompt_tokens = 0
        self.repair_completion_tokens = 0
        self.longer = 0  # retries with a larger max_tokens
        self.usage: tuple[int | None, int | None] = (None, None)  # (prompt, completion) tokens
        # What a budget charged, as estimates, for its requests that came with no usage.
        self.estimated: tuple[int, int] = (0, 0)
        self.last: Completion | None = None  # the latest answer, kept if a follow-up fails
        self.repairing = False  # the follow-up that judge asked for is a repair

    @property
    def guided(self) -> bool:
        """Whether the next request carries the schema for constrained decoding."""
        return (
            self.schema is not None
            and self.rules.guided_style is not None
            and not self.unguided
            and self._key not in self.rules.refused
        )

    def request(self, style: str | None = None) -> dict[str, Any]:
        """The body of the next request to send for this item; a schema in `style` (the
        endpoint's, with several), else the job's."""
        if not self.guided:
            return self._body
        assert self.schema is not None and self.rules.guided_style is not None
        fmt = response_format(style or self.rules.guided_style, self.schema)
        return {**self._body, "response_format": fmt}

    def judge(self, completion: Completion) -> Outcome | None:
        """The answer's verdict, or None when another request should be sent (see request())."""
        self.last, self.repairing = completion, False
        if self.repairs:
            self.repair_prompt_tokens += completion.prompt_tokens or 0
            self.repair_completion_tokens += completion.completion_tokens or 0
        else:  # the item's own ask and its longer retries: all of it is the item's usage
            self.usage = (
                _add(self.usage[0], completion.prompt_tokens),
                _add(self.usage[1], completion.completion_tokens),
            )
        if completion.finish_reason == "length" and self._grow_max_tokens(completion):
            return None
        if completion.finish_reason in TOOL_CALLS:  # its text is empty: the call is not kept
            return Outcome("failed", None, TOOL_CALL_ERROR)
        if self.check is None:
            return Outcome("done", None, None)
        verdict = self.check.check(completion.text, completion.finish_reason)
        if verdict.ok:
            return Outcome("done", verdict.parsed, None)
        assert verdict.error is not None and self.schema is not None
        if completion.finish_reason != "length" and self.repairs < self.rules.repair_attempts:
            self.repairs, self.repairing = self.repairs + 1, True
            self._body = repair_body(
                self.endpoint, self._body, completion.text, verdict.error, self.schema
            )
            return None
        return Outcome("invalid", verdict.parsed, verdict.error)

    def give_up(self, error: str, *, sent: bool = True) -> Outcome | None:
        """A follow-up (repair, longer retry) failed: the last answer stands, judged as it is.
        None when there is no answer yet (the item's own request failed). `sent` False: the
        follow-up never went (a budget refused it), and a repair not sent is not counted."""
        if self.last is None:
            return None
        if not sent and self.repairing:
            self.repairs, self.repairing = self.repairs - 1, False
        if self.check is None:  # a longer retry that did not come: why the answer is cut
            return Outcome("done", None, error)
        verdict = self.check.check(self.last.text, self.last.finish_reason)
        if verdict.ok:
            return Outcome("done", verdict.parsed, None)
        return Outcome("invalid", verdict.parsed, f"{verdict.error} (then: {error})")

    def _grow_max_tokens(self, completion: Completion) -> bool:
        if not self.rules.retry_longer or self.longer >= MAX_LONGER:
            return False
        key = "max_completion_tokens" if "max_completion_tokens" in self._body else "max_tokens"
        current = self._body.get(key) or completion.completion_tokens
        cap = self.rules.max_tokens_cap
        if not isinstance(current, int) or current < 1 or current >= cap:
            return False
        used = completion.completion_tokens
        if used is not None and used < current:
            return False  # cut short of max_tokens: the context was full, more will not fit
        self._body = {**self._body, key: min(cap, current * 2)}
        self.longer += 1
        return True
