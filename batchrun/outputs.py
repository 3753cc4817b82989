"""The results file, one line per input line in input order, written atomically.

A temp file in the same folder is written, flushed, fsynced and renamed over the target, so a
reader (or a crash) only ever sees the old complete file or the new complete file.
"""

from __future__ import annotations

import contextlib
import glob
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from batchrun.errors import OutputError
from batchrun.ledger.records import StoredItem
from batchrun.ledger.workers import pid_alive, this_machine


@dataclass(frozen=True, slots=True)
class Result:
    """One input line's outcome, as the results file's native line says it."""

    id: str | None  # None for a rejected line: its `line` names it
    line: int
    status: str  # done | failed | invalid | rejected (or pending/running, mid-job)
    output: str | None
    parsed: Any  # the validated JSON output (with a schema)
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    latency_ms: int | None
    ttft_ms: int | None
    attempts: int
    error: str | None
    meta: Any  # the line's extra fields, handed back as given
    repairs: int = 0  # follow-up requests that showed an invalid answer its error
    repair_prompt_tokens: int = 0
    repair_completion_tokens: int = 0
    reused_from: dict[str, Any] | None = None  # {"job", "line"} of the answer it reused
    answered_by: str | None = None  # the endpoint that answered, in a job with several
    model: str | None = None  # the model that answered, where it is not the job's

    def to_json(self) -> dict[str, Any]:
        """The results file's native line."""
        usage = None
        if self.prompt_tokens is not None or self.completion_tokens is not None:
            usage = {
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
            }
        repairs = None
        if self.repairs:  # what re-asking for a valid answer cost, when it had to
            repairs = {
                "requests": self.repairs,
                "prompt_tokens": self.repair_prompt_tokens,
                "completion_tokens": self.repair_completion_tokens,
            }
        record = {
            "id": self.id,
            "line": self.line,
            "status": self.status,
            "output": self.output,
            "parsed": self.parsed,
            "finish_reason": self.finish_reason,
            "usage": usage,
            "latency_ms": self.latency_ms,
            "ttft_ms": self.ttft_ms,
            "attempts": self.attempts,
            "repairs": repairs,
            "error": self.error,
            "meta": self.meta,
        }
        if self.reused_from:  # copied from an earlier job: its usage was paid then
            record["reused_from"] = self.reused_from
        if self.answered_by:
            record["answered_by"] = self.answered_by
        if self.model:
            record["model"] = self.model
        return record


def result_of(item: StoredItem, job_model: str | None = None) -> Result:
    """`item` as a result line; `model` named where another than the job's (`job_model`)
    answered it: a resume under another --model, a line that asked its own; and every line
    of a job of no one model (several endpoints, each serving its own)."""
    answered = item.answer_model
    return Result(
        id=_item_id(item),
        line=item.line,
        status=item.status,
        output=item.output,
        parsed=item.parsed,
        finish_reason=item.finish_reason,
        prompt_tokens=item.prompt_tokens,
        completion_tokens=item.completion_tokens,
        latency_ms=_round(item.latency_ms),
        ttft_ms=_round(item.ttft_ms),
        attempts=item.attempts,
        error=item.error,
        meta=item.meta,
        repairs=item.repairs,
        repair_prompt_tokens=item.repair_prompt_tokens,
        repair_completion_tokens=item.repair_completion_tokens,
        reused_from=(
            {"job": item.reused_job, "line": item.reused_line} if item.reused_job else None
        ),
        answered_by=item.answered_by,
        model=answered if answered and answered != job_model else None,
    )


def native_record(item: StoredItem, model: str | None = None) -> dict[str, Any]:
    return result_of(item, model).to_json()


def _item_id(item: StoredItem) -> str | None:
    """A rejected line has no id: its own was unusable or taken by an earlier line, and any id
    made up for it (its line number, say) could be a real item's. Its `line` names it."""
    return None if item.status == "rejected" else item.item_id


def openai_record(item: StoredItem, model: str | None) -> dict[str, Any]:
    """The OpenAI Batch API output line: id, custom_id, response{status_code, request_id, body}."""
    # Unique per line even when two lines send the same request (same digest).
    request_id = f"req_{item.line}_{(item.digest or '')[:16] or 'rejected'}"
    record: dict[str, Any] = {
        "id": f"batch_{request_id}",
        "custom_id": _item_id(item),
        "response": None,
        "error": None,
    }
    if item.status in ("done", "invalid"):
        chat = item.endpoint == "chat"
        choice: dict[str, Any] = {"index": 0, "finish_reason": item.finish_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": item.output}
        else:
            choice["text"] = item.output
        prompt, completion = item.prompt_tokens or 0, item.completion_tokens or 0
        record["response"] = {
            "status_code": 200,
            "request_id": request_id,
            "body": {
                "id": request_id,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(item.updated_at),  # when the answer was recorded
                # the model it was asked of; for answers recorded before that was kept, the
                # line's own, else the job's
                "model": item.answer_model or item.model or model,
                "choices": [choice],
                "usage": {
                    "prompt_tokens": prompt,
                    "completion_tokens": completion,
                    "total_tokens": prompt + completion,
                },
            },
        }
    if item.status != "done":
        record["error"] = {"code": item.status, "message": item.error or item.status}
    return record


@dataclass(frozen=True)
class OutputFormat:
    """A results file format: its file's place under outputs/ and how one item becomes one
    line."""

    place: str  # under outputs/, `{job}` standing for the job's name
    record: Callable[[StoredItem, str | None], dict[str, Any]]  # (item, model) -> a JSON line


# A new format is one entry here (and its record function above).
FORMATS: dict[str, OutputFormat] = {
    "native": OutputFormat("{job}.jsonl", native_record),
    # the OpenAI Batch API's output file: in a folder of its own, so no job's results file is
    # ever its place (a job may be named `x.openai`)
    "openai": OutputFormat("openai/{job}.jsonl", openai_record),
}


def _round(value: float | None) -> int | None:
    return None if value is None else round(value)


def write_results(
    path: Path, items: Iterable[StoredItem], *, fmt: str = "native", model: str | None = None
) -> int:
    """Write every item to `path` atomically; returns the number of lines written."""
    if fmt not in FORMATS:
        raise OutputError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    record = FORMATS[fmt].record
    folder = path.parent
    # one temp file per writer: two threads of one process may write one job's file at once;
    # named by its machine and process, so a writer killed mid-way can be told dead (_stale)
    tmp = folder / f".{path.name}.tmp-{this_machine()[:12]}-{os.getpid()}-{threading.get_ident()}"
    count = 0
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tmp.open("wb") as f:
            for item in items:
                f.write(orjson.dumps(record(item, model)) + b"\n")
                count += 1
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(folder)
        for stale in _stale(path):  # a writer killed mid-way (kill -9) left its part behind
            _discard(stale)
    except OSError as exc:
        _discard(tmp)
        raise OutputError(f"cannot write results to {path}: {exc.strerror or exc}") from None
    except BaseException:
        _discard(tmp)  # e.g. the ledger failed mid-way: never leave half a file behind
        raise
    return count


def _stale(path: Path) -> list[Path]:
    """Temp files of `path` from writers of this machine whose process is gone."""
    prefix = f".{path.name}.tmp-{this_machine()[:12]}-"
    found = []
    for tmp in path.parent.glob(f"{glob.escape(prefix)}*"):
        pid = tmp.name[len(prefix) :].partition("-")[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            found.append(tmp)
    return found


def _discard(tmp: Path) -> None:
    with contextlib.suppress(OSError):
        tmp.unlink()


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
