"""Plain records the ledger hands out and takes in."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Job:
    name: str
    input_path: str
    input_digest: str
    spec: str
    total: int
    created_at: float
    updated_at: float
    finished_at: float | None
    runner_owner: str | None
    runner_pid: int | None
    runner_host: str | None
    runner_heartbeat: float | None
    limit_history: str | None = None


@dataclass(frozen=True, slots=True)
class ClaimedItem:
    line: int
    item_id: str
    endpoint: str
    body: str
    digest: str
    attempts: int


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


@dataclass(frozen=True)
class IngestReport:
    accepted: int
    rejected: int
    blank_lines: list[int] = field(default_factory=list)
