"""The simulator's Files and Batches endpoints: OpenAI's Batch API, on a time scale.

Files: `POST /v1/files` (multipart: `purpose`, `file`), `GET /v1/files/{id}` and
`GET /v1/files/{id}/content`. Batches: `POST /v1/batches` (`input_file_id`, `endpoint`,
`completion_window`, `metadata`), `GET /v1/batches/{id}`, `GET /v1/batches?limit=&after=`
(newest first) and `POST /v1/batches/{id}/cancel`.

Time: a batch's lines are answered evenly over `batch_seconds` of the simulator's clock, by the
simulator's own completion model (so its faults and JSON styles apply: a line the model answers
with an error status goes to the error file). When every line is answered the batch is
`completed`, with an output file and an error file. A batch still running when its window
(`batch_window_s`, the "24h" on a time scale) ends is `expired`: the lines answered so far are in
its output file and the rest in its error file as `batch_expired`; a cancelled one likewise ends
`cancelled`. An input file over `batch_max_requests` lines, or with a bad line, fails the batch
at validation, as OpenAI's does.

Pure, apart from the clock it is given; the model wraps its answers into Replies.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit

import orjson

# (status, JSON payload or raw bytes) for the model to send
Answer = tuple[int, Any]
# what answers one request line: (endpoint kind, body) -> (status, body bytes)
Complete = Callable[[str, dict[str, Any]], tuple[int, bytes]]

URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
FINAL = ("completed", "expired", "cancelled", "failed")


@dataclass
class _Batch:
    id: str
    input_file_id: str
    endpoint: str
    metadata: dict[str, Any]
    lines: list[dict[str, Any]]
    started: float  # the simulator's clock
    created_at: int  # epoch seconds
    status: str = "in_progress"
    answered: list[tuple[dict[str, Any], int, bytes]] = field(default_factory=list)
    output_file_id: str | None = None
    error_file_id: str | None = None
    ended_at: int | None = None
    errors: list[dict[str, Any]] | None = None


class SimBatches:
    def __init__(
        self,
        complete: Complete,
        *,
        seconds: float,
        window_s: float,
        max_requests: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.complete = complete
        self.seconds = seconds
        self.window_s = window_s
        self.max_requests = max_requests
        self.clock = clock
        self.files: dict[str, tuple[str, str, bytes]] = {}  # id -> (purpose, filename, bytes)
        self.batches: dict[str, _Batch] = {}
        self._ids = itertools.count(1)
        self.created = 0  # batches created (tests read this: never two for the same items)

    def handle(self, method: str, target: str, headers: dict[str, str], body: bytes) -> Answer:
        url = urlsplit(target)
        parts = url.path.rstrip("/").split("/")[2:]  # after /v1
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        if parts[:1] == ["files"]:
            return self._files(method, parts[1:], headers, body)
        if method == "POST" and parts == ["batches"]:
            return self._create(body)
        if method == "GET" and parts == ["batches"]:
            return self._list(query)
        if len(parts) >= 2 and parts[0] == "batches" and parts[1] in self.batches:
            batch = self.batches[parts[1]]
            if method == "GET" and len(parts) == 2:
                return 200, self._view(batch)
            if method == "POST" and parts[2:] == ["cancel"]:
                return self._cancel(batch)
        return _error(404, f"no route for {method} {url.path}")

    # --- files -----------------------------------------------------------------------------

    def _files(self, method: str, parts: list[str], headers: dict[str, str], body: bytes) -> Answer:
        if method == "POST" and not parts:
            form = _multipart(headers.get("content-type", ""), body)
            if form is None or "file" not in form or "purpose" not in form:
                return _error(400, "expected multipart form data with 'purpose' and 'file'")
            purpose, (filename, content) = form["purpose"][1].decode(), form["file"]
            return 200, self._file_object(self._store(purpose, filename or "input.jsonl", content))
        if not parts or parts[0] not in self.files:
            return _error(404, "no such file")
        if method == "GET" and len(parts) == 1:
            return 200, self._file_object(parts[0])
        if method == "GET" and parts[1:] == ["content"]:
            return 200, self.files[parts[0]][2]
        return _error(404, "no such route")

    def _store(self, purpose: str, filename: str, content: bytes) -> str:
        file_id = f"file-sim{next(self._ids)}"
        self.files[file_id] = (purpose, filename, content)
        return file_id

    def _file_object(self, file_id: str) -> dict[str, Any]:
        purpose, filename, content = self.files[file_id]
        return {
            "id": file_id,
            "object": "file",
            "bytes": len(content),
            "created_at": int(time.time()),
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
        }

    # --- batches ---------------------------------------------------------------------------

    def _create(self, body: bytes) -> Answer:
        try:
            request = orjson.loads(body)
        except orjson.JSONDecodeError:
            return _error(400, "request body is not valid JSON")
        file_id = request.get("input_file_id")
        if request.get("endpoint") not in URLS or file_id not in self.files:
            return _error(400, "input_file_id must name an uploaded file; endpoint a known one")
        if request.get("completion_window") != "24h":
            return _error(400, "completion_window must be 24h")
        self.created += 1
        batch = _Batch(
            id=f"batch_sim{next(self._ids)}",
            input_file_id=file_id,
            endpoint=request["endpoint"],
            metadata=request.get("metadata") or {},
            lines=[],
            started=self.clock(),
            created_at=int(time.time()),
        )
        self.batches[batch.id] = batch
        lines, problem = self._lines(self.files[file_id][2], request["endpoint"])
        if problem is not None:
            batch.status, batch.ended_at = "failed", int(time.time())
            batch.errors = [problem]
        batch.lines = lines
        return 200, self._view(batch)

    def _lines(self, content: bytes, endpoint: str) -> tuple[list[dict[str, Any]], Any]:
        lines: list[dict[str, Any]] = []
        for number, raw in enumerate(content.splitlines(), start=1):
            if not raw.strip():
                continue
            try:
                line = orjson.loads(raw)
            except orjson.JSONDecodeError:
                return [], {"code": "invalid_json_line", "message": "not JSON", "line": number}
            ok = isinstance(line, dict) and line.get("url") == endpoint and "custom_id" in line
            if not ok or not isinstance(line.get("body"), dict):
                message = f"needs custom_id, url {endpoint} and a body"
                return [], {"code": "invalid_request", "message": message, "line": number}
            lines.append(line)
        if len(lines) > self.max_requests:
            message = f"{len(lines)} requests, over the limit of {self.max_requests}"
            return [], {"code": "too_many_requests", "message": message, "line": None}
        return lines, None

    def _list(self, query: dict[str, str]) -> Answer:
        for batch in self.batches.values():
            self._advance(batch)
        newest = sorted(self.batches.values(), key=lambda b: int(b.id[9:]), reverse=True)
        after = query.get("after")
        if after in self.batches:
            newest = newest[[b.id for b in newest].index(after) + 1 :]
        limit = max(1, min(100, int(query.get("limit", "20"))))
        page = newest[:limit]
        data = [self._view(b) for b in page]
        return 200, {
            "object": "list",
            "data": data,
            "first_id": page[0].id if page else None,
            "last_id": page[-1].id if page else None,
            "has_more": len(newest) > limit,
        }

    def _cancel(self, batch: _Batch) -> Answer:
        self._advance(batch)
        if batch.status not in FINAL:
            self._finish(batch, "cancelled")
        return 200, self._view(batch)

    def _advance(self, batch: _Batch) -> None:
        """Answer the lines due by now; end the batch when all are answered or its window ends."""
        if batch.status in FINAL:
            return
        elapsed = self.clock() - batch.started
        due = (
            len(batch.lines)
            if self.seconds <= 0
            else int(len(batch.lines) * elapsed / self.seconds)
        )
        for line in batch.lines[len(batch.answered) : min(due, len(batch.lines))]:
            status, body = self.complete(URLS[batch.endpoint], {**line["body"], "stream": False})
            batch.answered.append((line, status, body))
        if len(batch.answered) == len(batch.lines):
            self._finish(batch, "completed")
        elif elapsed >= self.window_s:
            self._finish(batch, "expired")

    def _finish(self, batch: _Batch, status: str) -> None:
        out: list[dict[str, Any]] = []
        errors: list[dict[str, Any]] = []
        for n, (line, status_code, body) in enumerate(batch.answered):
            record = _result(batch, n, line["custom_id"], status_code, body)
            (out if status_code == 200 else errors).append(record)
        why = "batch_expired" if status == "expired" else "batch_cancelled"
        for n, line in enumerate(batch.lines[len(batch.answered) :], start=len(batch.answered)):
            error = {"code": why, "message": f"this request was not run: the batch {status}"}
            ident = f"{batch.id}_req_{n}"
            errors.append(
                {"id": ident, "custom_id": line["custom_id"], "response": None, "error": error}
            )
        batch.status, batch.ended_at = status, int(time.time())
        if out:
            batch.output_file_id = self._store("batch_output", "output.jsonl", _jsonl(out))
        if errors:
            batch.error_file_id = self._store("batch_output", "errors.jsonl", _jsonl(errors))

    def _view(self, batch: _Batch) -> dict[str, Any]:
        self._advance(batch)
        failed = sum(1 for _line, code, _body in batch.answered if code != 200)
        ended = {f"{batch.status}_at": batch.ended_at} if batch.status in FINAL else {}
        return {
            "id": batch.id,
            "object": "batch",
            "endpoint": batch.endpoint,
            "errors": {"object": "list", "data": batch.errors} if batch.errors else None,
            "input_file_id": batch.input_file_id,
            "completion_window": "24h",
            "status": batch.status,
            "output_file_id": batch.output_file_id,
            "error_file_id": batch.error_file_id,
            "created_at": batch.created_at,
            "in_progress_at": batch.created_at,
            "expires_at": batch.created_at + int(self.window_s),
            **ended,
            "request_counts": {
                "total": len(batch.lines),
                "completed": len(batch.answered) - failed,
                "failed": failed,
            },
            "metadata": batch.metadata,
        }


def _result(batch: _Batch, n: int, custom_id: str, code: int, body: bytes) -> dict[str, Any]:
    try:
        parsed = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        parsed, code = {"error": {"message": "the server's answer was not JSON"}}, 500
    response = {"status_code": code or 500, "request_id": f"req_sim_{batch.id}_{n}", "body": parsed}
    return {
        "id": f"{batch.id}_req_{n}",
        "custom_id": custom_id,
        "response": response,
        "error": None,
    }


def _jsonl(records: list[dict[str, Any]]) -> bytes:
    return b"".join(orjson.dumps(r) + b"\n" for r in records)


def _error(status: int, message: str) -> Answer:
    return status, {"error": {"message": message, "type": "invalid_request_error", "code": status}}


def _multipart(content_type: str, body: bytes) -> dict[str, tuple[str, bytes]] | None:
    """A multipart/form-data body's fields: name -> (filename, content); "" for a plain field."""
    kind, _, params = content_type.partition(";")
    boundary = params.strip().removeprefix("boundary=").strip('"')
    if kind.strip() != "multipart/form-data" or not boundary:
        return None
    fields: dict[str, tuple[str, bytes]] = {}
    for part in body.split(b"--" + boundary.encode())[1:]:
        if part.startswith(b"--"):
            break
        head, _, content = part.lstrip(b"\r\n").partition(b"\r\n\r\n")
        content = content.removesuffix(b"\r\n")
        lines = head.decode("latin-1").split("\r\n")
        disposition = next((h for h in lines if h.lower().startswith("content-disposition")), "")
        pairs = (a.partition("=") for a in disposition.split(";")[1:])
        attrs = {k.strip(): v.strip().strip('"') for k, _, v in pairs}
        if "name" in attrs:
            fields[attrs["name"]] = (attrs.get("filename", ""), content)
    return fields
