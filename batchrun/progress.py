"""Progress updates for a caller (the CLI draws its bar from them) and the job log (JSON lines,
one per attempt/event).

The log answers "what happened to line 48,213 last night" without opening the ledger. Attempt
lines are buffered and flushed with each group commit; job events are flushed at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

import orjson

from batchrun.errors import OutputError

SUMMARY_CHARS = 80


_second: tuple[int, str] = (-1, "")  # the last second formatted, and how


def _now_iso() -> str:
    """The time, to the millisecond, in UTC; the date and time formatted once a second (a
    log line per request would otherwise format the same second again and again)."""
    global _second
    ms = time.time_ns() // 1_000_000
    second, part = divmod(ms, 1000)
    if second != _second[0]:
        _second = (second, datetime.fromtimestamp(second, UTC).strftime("%Y-%m-%dT%H:%M:%S"))
    return f"{_second[1]}.{part:03d}+00:00"


def input_summary(body: dict[str, Any]) -> str:
    """A short view of what was asked: the last message's text, or the prompt."""
    value: Any = body.get("prompt")
    messages = body.get("messages")
    if value is None and isinstance(messages, list) and messages:
        last = messages[-1]
        value = last.get("content") if isinstance(last, dict) else None
    if value is None:
        value = ""
    raw = value if isinstance(value, str) else orjson.dumps(value).decode()
    text = " ".join(raw.split())
    return text if len(text) <= SUMMARY_CHARS else text[: SUMMARY_CHARS - 1] + "…"


class JobLog:
    def __init__(self, path: Path, job: str, *, redact: bool = False) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file: IO[bytes] = path.open("ab")
        except OSError as exc:
            raise OutputError(f"cannot open the job log {path}: {exc.strerror or exc}") from None
        self.path = path
        self.job = job
        self.redact = redact
        self._pending: list[bytes] = []

    def _line(self, record: dict[str, Any]) -> bytes:
        return orjson.dumps({"time": _now_iso(), "job": self.job, **record}) + b"\n"

    def event(self, event: str, **fields: Any) -> None:
        self._pending.append(self._line({"event": event, **fields}))
        self.flush()

    def attempt(
        self,
        *,
        item_id: str,
        line: int,
        digest: str,
        summary: str | None,
        attempt: int,
        **fields: Any,
    ) -> None:
        record: dict[str, Any] = {
            "event": "attempt",
            "id": item_id,
            "line": line,
            "digest": digest,
            "attempt": attempt,
        }
        if not self.redact and summary is not None:
            record["input"] = summary
        record.update(fields)
        self._pending.append(self._line(record))

    def flush(self) -> None:
        if self._pending:
            try:
                self._file.write(b"".join(self._pending))
                self._file.flush()
            except OSError as exc:
                raise OutputError(f"cannot write the job log {self.path}: {exc.strerror}") from None
            finally:
                self._pending.clear()

    def close(self) -> None:
        try:
            self.flush()
        finally:
            try:
                self._file.close()  # may flush buffered bytes once more: same disk, same error
            except OSError as exc:
                raise OutputError(f"cannot write the job log {self.path}: {exc.strerror}") from None


@dataclass(frozen=True)
class ProgressUpdate:
    """Where a run stands, handed to `on_progress` after each group commit."""

    done: int  # items with a final record, this run's and earlier runs' together
    total: int
    output_tokens: int  # this run's
    retries: int  # this run's
    failed: int  # failed or invalid, this run's
    concurrency: int  # requests allowed in flight now
    elapsed: float  # seconds since this run started


class Progress:
    """What a run reports as it goes, handed to callbacks: the library draws nothing (the CLI
    makes a progress bar of the updates and prints the messages)."""

    def __init__(
        self,
        *,
        total: int,
        initial: int,
        concurrency: int,
        on_progress: Callable[[ProgressUpdate], None] | None = None,
        on_message: Callable[[str], None] | None = None,
    ) -> None:
        self.total = total
        self.done = initial
        self.concurrency = concurrency
        self._started = time.monotonic()
        self._on_progress = on_progress
        self._on_message = on_message
        # What a callback raised: not raised where it was called (a group commit, answers
        # received after it would be dropped) but kept, the run stopped (`on_raised`), and
        # raised once the run has ended. The callbacks are not called again after it.
        self.raised: BaseException | None = None
        self.on_raised: Callable[[], None] = lambda: None

    def say(self, message: str) -> None:
        """A line for the user (the first Ctrl-C's, say)."""
        if self._on_message is not None:
            self._hand(self._on_message, message)

    def _hand(self, callback: Callable[[Any], None], value: Any) -> None:
        if self.raised is not None:
            return
        try:
            callback(value)
        except (Exception, KeyboardInterrupt, SystemExit) as exc:
            self.raised = exc
            self.on_raised()

    def raise_what_a_callback_raised(self) -> None:
        if self.raised is not None:
            raise self.raised

    def update(self, *, newly_done: int, tokens: int, retries: int, failed: int) -> None:
        self.done += newly_done
        if self._on_progress is not None:
            elapsed = time.monotonic() - self._started
            update = ProgressUpdate(
                self.done, self.total, tokens, retries, failed, self.concurrency, elapsed
            )
            self._hand(self._on_progress, update)
