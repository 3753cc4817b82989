"""What a provider's batch says back: its output and error files, line by line, and why it or
its lines failed. Pure: bytes and dicts in, never a request."""

from __future__ import annotations

from typing import Any

import orjson

from batchrun.backends.batch_api import Unreadable


def records(content: bytes, kind: str) -> list[dict[str, Any]]:
    """A batch's `kind` ("output", "error") file: a JSON object a line, blank lines passed
    over. A line that is anything else (an HTML page, a JSON array, a line cut short) raises
    Unreadable: the answers in the file, paid for, are not known, so its lines stay batched
    for a resume to look again, rather than be sent again as if never answered."""
    found = []
    for number, raw in enumerate(content.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            record = orjson.loads(raw)
        except orjson.JSONDecodeError:
            record = None
        if not isinstance(record, dict):
            raise Unreadable(
                f"line {number} of the batch's {kind} file is not a JSON object, as OpenAI's "
                "Batch API writes; its lines stay batched: `resume` looks again (`batchrun "
                "cancel JOB --forget` gives them up)"
            )
        found.append(record)
    return found


def answered(batch: dict[str, Any]) -> int:
    """How many lines a batch says it answered (`request_counts.completed`; 0 if unsaid)."""
    counts = batch.get("request_counts")
    done = counts.get("completed") if isinstance(counts, dict) else None
    return done if isinstance(done, int) and not isinstance(done, bool) and done > 0 else 0


def reasons(batch: dict[str, Any]) -> str:
    """Why the provider failed a batch: its `errors` (OpenAI's `{"data": [...]}`, or a list)."""
    errors = batch.get("errors")
    if isinstance(errors, dict):
        errors = errors.get("data")
    if not isinstance(errors, list):
        errors = [errors] if errors else []
    said = [str(e.get("message", e)) if isinstance(e, dict) else str(e) for e in errors]
    return "; ".join(said)[:1000] or "no reason given"


def failure(record: dict[str, Any]) -> str:
    """An error file line's reason: its error code, or its response's HTTP status."""
    error = record.get("error")
    if isinstance(error, dict) and error.get("code"):
        return str(error["code"])
    response = record.get("response")
    status = response.get("status_code") if isinstance(response, dict) else None
    return f"HTTP {status}" if status else "unknown"
