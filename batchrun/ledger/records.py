"""Plain records the ledger hands out and takes in, typed: callers never parse JSON columns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple


class InputItem(NamedTuple):
    """One valid input line, ready to be stored and sent (a NamedTuple: cheap to build)."""

    line: int
    item_id: str
    endpoint: str
    body: bytes  # the line's own request fields, JSON as stored; job defaults come at send time
    digest: str  # sha256 of the canonical request: job defaults + line fields, sorted keys
    meta: bytes | None  # extra top-level fields, JSON, handed back in the output
    prefix: int | None = None  # its long prompt prefix's key, when grouping (prefixes.py)


class BadLine(NamedTuple):
    line: int
    reason: str


# The adaptive limit's recent moves: (epoch seconds, limit, reason).
LimitMove = tuple[float, int, str]


@dataclass(frozen=True)
class Job:
    name: str
    input_path: str
    input_digest: str
    spec: dict[str, Any]  # the run options it last ran with (never the API key)
    total: int
    created_at: float
    updated_at: float
    finished_at: float | None
    runner_owner: str | None
    runner_pid: int | None
    runner_host: str | None
    runner_heartbeat: float | None
    limit_history: list[LimitMove] = field(default_factory=list)
    collected_at: float | None = None  # when `gc` kept only its answers for reuse

    def collected(self, kept: int) -> bool:
        """Whether `gc` collected it (`kept`: the items it holds now): marked so, or holding
        fewer items than it loaded (collected before migration 10)."""
        return self.collected_at is not None or kept < self.total


@dataclass(frozen=True, slots=True)
class ClaimedItem:
    line: int
    item_id: str
    endpoint: str
    body: dict[str, Any]  # the line's own request fields
    digest: str
    attempts: int
    group: int | None = None  # its prefix group: the group's first line (its own, alone)
    sched: int = 0  # its place in the claim order
    # A hosted batch's answer that needs a follow-up: text, finish_reason, prompt_tokens,
    # completion_tokens.
    previous: dict[str, Any] | None = None
    charged: int = 0  # attempts charged against --max-attempts in runs that ended without it


@dataclass(frozen=True, slots=True)
class Spent:
    """What a run spent on an item it ends without a result for (a stop, an abort): requests
    sent, and attempts charged against --max-attempts (outage failures are not). Stored as
    the item goes back to pending, so the next run's count goes on from there."""

    line: int
    requests: int
    charged: int


@dataclass(frozen=True, slots=True)
class ItemResult:
    """The final record of one item, as the runner hands it to the writer."""

    line: int
    status: str  # done | failed | invalid
    attempts: int  # requests sent for this item in this run
    latency_ms: float | None = None
    ttft_ms: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    output: str | None = None
    parsed: str | None = None
    error: str | None = None
    repairs: int = 0  # follow-up requests that showed an invalid answer its error
    repair_prompt_tokens: int = 0
    repair_completion_tokens: int = 0
    # Estimates a budget charged for its requests whose server reported no usage.
    extra_prompt_tokens: int = 0
    extra_completion_tokens: int = 0
    answered_by: str | None = None  # the endpoint of its last request
    answer_model: str | None = None  # the model that request asked for
    answer_spec: str | None = None  # the answer options it was made under (reuse.py)


@dataclass(frozen=True, slots=True)
class Recorded:
    """What a commit of results finished: its items by their new status, the group's own and
    the repeated lines that waited for them (a failed request fails each of its lines)."""

    by_status: dict[str, int]

    @property
    def finished(self) -> int:
        return sum(self.by_status.values())


@dataclass(frozen=True, slots=True)
class StoredItem:
    """One item as the ledger holds it, for results files and the Python API."""

    line: int
    item_id: str  # "" for a rejected line
    endpoint: str
    digest: str
    meta: Any  # the line's extra fields, or None
    status: str
    attempts: int
    latency_ms: float | None
    ttft_ms: float | None
    prompt_tokens: int | None
    completion_tokens: int | None
    finish_reason: str | None
    output: str | None
    parsed: Any  # the validated JSON output (with a schema), or None
    error: str | None
    repairs: int
    repair_prompt_tokens: int
    repair_completion_tokens: int
    updated_at: float
    reused_job: str | None = None  # the earlier job whose answer this line reused
    reused_line: int | None = None
    answered_by: str | None = None  # the endpoint that answered it
    answer_model: str | None = None  # the model its answer was asked of, where recorded
    model: str | None = None  # the line's own model, where it asked one (read when asked for)


@dataclass(frozen=True)
class IngestReport:
    accepted: int
    rejected: int
    groups: int = 0  # prompt prefixes shared by two lines or more (prefixes.py)
    grouped: int = 0  # lines in those groups
    blank_lines: list[int] = field(default_factory=list)
