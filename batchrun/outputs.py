"""The results file, one line per input line in input order, written atomically.

A temp file in the same folder is written, flushed, fsynced and renamed over the target, so a
reader (or a crash) only ever sees the old complete file or the new complete file.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import orjson

from batchrun.errors import OutputError

FORMATS = ("native", "openai")


def _loads(text: str | None) -> Any:
    return orjson.loads(text) if text else None


def native_record(row: dict[str, Any]) -> dict[str, Any]:
    usage = None
    if row["prompt_tokens"] is not None or row["completion_tokens"] is not None:
        usage = {
            "prompt_tokens": row["prompt_tokens"],
            "completion_tokens": row["completion_tokens"],
        }
    return {
        "id": _item_id(row),
        "line": row["line"],
        "status": row["status"],
        "output": row["output"],
        "parsed": _loads(row["parsed"]),
        "finish_reason": row["finish_reason"],
        "usage": usage,
        "latency_ms": _round(row["latency_ms"]),
        "ttft_ms": _round(row["ttft_ms"]),
        "attempts": row["attempts"],
        "repairs": _repairs(row),
        "error": row["error"],
        "meta": _loads(row["meta"]),
    }


def _item_id(row: dict[str, Any]) -> str | None:
    """A rejected line has no id: its own was unusable or taken by an earlier line, and any id
    made up for it (its line number, say) could be a real item's. Its `line` names it."""
    return None if row["status"] == "rejected" else str(row["item_id"])


def _repairs(row: dict[str, Any]) -> dict[str, int] | None:
    """What re-asking for a valid answer cost this item (None when it never had to)."""
    if not row.get("repairs"):
        return None
    return {
        "requests": row["repairs"],
        "prompt_tokens": row["repair_prompt_tokens"],
        "completion_tokens": row["repair_completion_tokens"],
    }


def openai_record(row: dict[str, Any], model: str | None) -> dict[str, Any]:
    """The OpenAI Batch API output line: id, custom_id, response{status_code, request_id, body}."""
    # Unique per line even when two lines send the same request (same digest).
    request_id = f"req_{row['line']}_{(row['digest'] or '')[:16] or 'rejected'}"
    record: dict[str, Any] = {
        "id": f"batch_{request_id}",
        "custom_id": _item_id(row),
        "response": None,
        "error": None,
    }
    if row["status"] in ("done", "invalid"):
        chat = row["endpoint"] == "chat"
        choice: dict[str, Any] = {"index": 0, "finish_reason": row["finish_reason"]}
        if chat:
            choice["message"] = {"role": "assistant", "content": row["output"]}
        else:
            choice["text"] = row["output"]
        prompt, completion = row["prompt_tokens"] or 0, row["completion_tokens"] or 0
        record["response"] = {
            "status_code": 200,
            "request_id": request_id,
            "body": {
                "id": request_id,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(row["updated_at"]),  # when the answer was recorded
                "model": model,
                "choices": [choice],
                "usage": {
                    "prompt_tokens": prompt,
                    "completion_tokens": completion,
                    "total_tokens": prompt + completion,
                },
            },
        }
    if row["status"] != "done":
        record["error"] = {"code": row["status"], "message": row["error"] or row["status"]}
    return record


def _round(value: float | None) -> int | None:
    return None if value is None else round(value)


def write_results(
    path: Path, rows: Iterable[dict[str, Any]], *, fmt: str = "native", model: str | None = None
) -> int:
    """Write every row to `path` atomically; returns the number of lines written."""
    if fmt not in FORMATS:
        raise OutputError(f"unknown format {fmt!r}; choose native or openai")
    folder = path.parent
    tmp = folder / f".{path.name}.tmp-{os.getpid()}"
    count = 0
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tmp.open("wb") as f:
            for row in rows:
                record = native_record(row) if fmt == "native" else openai_record(row, model)
                f.write(orjson.dumps(record) + b"\n")
                count += 1
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(folder)
    except OSError as exc:
        _discard(tmp)
        raise OutputError(f"cannot write results to {path}: {exc.strerror or exc}") from None
    except BaseException:
        _discard(tmp)  # e.g. the ledger failed mid-way: never leave half a file behind
        raise
    return count


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
