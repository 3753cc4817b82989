"""`--mode batch`: a job's pending items through a provider's Batch API (OpenAI's `/v1/files`
and `/v1/batches`, and the servers that copy them), at its discount, safe to kill at any moment.

Ledger first. A chunk's row (state `intent`) and its items' `batched` status are written in one
transaction before anything is uploaded; the input file's id as soon as the upload returns; the
batch's id as soon as the create returns. The batch is created with metadata naming the job and
the chunk, so a run that finds a chunk without a batch id (a kill between the create and its
record) asks the provider for its batches, newest first, and adopts the one with that metadata:
no chunk is ever created twice. A kill between the upload and the create leaves at most a file
(not billed) that is uploaded again.

Chunks hold at most `--batch-max-requests` lines and `--batch-max-bytes` of JSONL (OpenAI:
50,000 and 200 MB) and one endpoint kind. Running batches are polled with backoff up to
`--poll-interval`; a finished one's output is mapped back by `custom_id` (the line), judged by
the job's output rules (schema, truncation) and recorded under the chunk's guard; what it did not
answer (failed, expired, cancelled lines, answers that need a repair) goes back to pending for
the next batch or, with `--then online`, for ordinary requests.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import anyio
import orjson

from batchrun.backends.answers import read_json
from batchrun.backends.base import Transport
from batchrun.backends.batch_api import BatchAPI
from batchrun.config import RunSpec
from batchrun.errors import RequestError
from batchrun.ledger import Chunk, ClaimedItem, ItemResult, Ledger
from batchrun.progress import JobLog
from batchrun.reuse import answer_spec
from batchrun.run_state import RunStats
from batchrun.structured import OutputRules

URLS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
FINISHED = ("completed", "expired", "cancelled", "failed")
CRASH_POINTS = ("uploaded", "created", "downloading")  # BATCHRUN_CRASH_AT, for the tests


@dataclass
class HostedStats:
    batches: int = 0  # batches created in this run
    recorded: int = 0  # results recorded from batches
    returned: int = 0  # lines that went back to pending (failed, expired, needing a repair)
    prompt_tokens: int = 0  # billed at the batch rate
    completion_tokens: int = 0


class HostedRun:
    """One run of a job's batches: reconcile, submit what is pending, poll, collect."""

    def __init__(
        self,
        ledger: Ledger,
        api: BatchAPI,
        name: str,
        spec: RunSpec,
        *,
        rules: OutputRules,
        log: JobLog,
    ) -> None:
        self.ledger, self.api, self.name, self.spec = ledger, api, name, spec
        self.rules = rules
        self.log = log
        self.store = ledger.chunks
        self.stats = HostedStats()
        self._answer_spec = answer_spec(spec)

    async def run(self) -> HostedStats:
        for chunk in self.store.listed(self.name, open_only=True):
            if chunk.batch_id is None:
                await self._submit(chunk.chunk, self.store.lines(self.name, chunk.chunk), chunk)
        while await self._next_chunk():
            pass
        await self._poll()
        return self.stats

    async def _next_chunk(self) -> bool:
        """Start, upload and create the next chunk of pending items; False when none is left."""
        pending = self.store.pending(self.name, self.spec.batch_max_requests)
        if not pending:
            return False
        picked: list[ClaimedItem] = []
        size = 0
        for item in pending:
            size += len(self._line(item))
            if item.endpoint != pending[0].endpoint or (
                picked and size > self.spec.batch_max_bytes
            ):
                break
            picked.append(item)
        number, lines = self.store.start(self.name, [item.line for item in picked])
        if lines:
            wanted = set(lines)
            await self._submit(number, [i for i in picked if i.line in wanted], None)
        return True

    async def _submit(self, number: int, items: list[ClaimedItem], known: Chunk | None) -> None:
        """Upload and create a chunk's batch, unless the provider has it already."""
        meta = {"batchrun_job": self.name, "batchrun_chunk": str(number)}
        if known is not None:  # a run before this one may have created it
            found = await self.api.find(meta)
            if found is not None:
                self.store.note(self.name, number, batch_id=found["id"], state=found["status"])
                self.log.event("batch_adopted", chunk=number, batch=found["id"])
                return
        if not items:
            self.store.close(self.name, number)
            return
        content = b"".join(self._line(item) for item in items)
        file_id = await self.api.upload(f"{self.name}-{number}.jsonl", content)
        self.store.note(self.name, number, input_file=file_id, state="uploaded")
        _crash_point("uploaded")
        batch = await self.api.create(file_id, URLS[items[0].endpoint], meta)
        _crash_point("created")
        self.store.note(self.name, number, batch_id=batch["id"], state=batch["status"])
        self.stats.batches += 1
        self.log.event("batch_created", chunk=number, batch=batch["id"], lines=len(items))

    def _line(self, item: ClaimedItem) -> bytes:
        body = self.rules.plan(item.endpoint, {**self.spec.request_defaults(), **item.body})
        request = {
            "custom_id": str(item.line),
            "method": "POST",
            "url": URLS[item.endpoint],
            "body": body.request(),
        }
        return orjson.dumps(request) + b"\n"

    async def _poll(self) -> None:
        wait = min(1.0, self.spec.poll_interval)
        while True:
            open_chunks = [c for c in self.store.listed(self.name, open_only=True) if c.batch_id]
            if not open_chunks:
                return
            for chunk in open_chunks:
                assert chunk.batch_id is not None
                batch = await self.api.get(chunk.batch_id)
                counts = batch.get("request_counts")
                if batch["status"] != chunk.state or counts != chunk.counts:
                    self.store.note(self.name, chunk.chunk, state=batch["status"], counts=counts)
                if batch["status"] in FINISHED:
                    await self._collect(chunk, batch)
            await anyio.sleep(wait)
            wait = min(self.spec.poll_interval, wait * 2)

    async def _collect(self, chunk: Chunk, batch: dict[str, Any]) -> None:
        """Record a finished batch's answers; the rest of its lines go back to pending."""
        items = {item.line: item for item in self.store.lines(self.name, chunk.chunk)}
        _crash_point("downloading")
        results: list[ItemResult] = []
        if batch.get("output_file_id"):
            for record in _records(await self.api.content(batch["output_file_id"])):
                result = self._result(items, record)
                if result is not None:
                    results.append(result)
        failures: dict[str, int] = {}  # why the provider failed lines, for the log
        if batch.get("error_file_id"):
            for record in _records(await self.api.content(batch["error_file_id"])):
                why = _failure(record)
                failures[why] = failures.get(why, 0) + 1
        recorded = self.ledger.record(
            self.name, "", results, answer_spec=self._answer_spec, chunk=chunk.chunk
        )
        back = self.store.close(self.name, chunk.chunk)
        self.stats.recorded += recorded
        self.stats.returned += back
        self.log.event(
            "batch_collected",
            chunk=chunk.chunk,
            batch=chunk.batch_id,
            status=batch["status"],
            recorded=recorded,
            back_to_pending=back,
            failures=failures,
        )

    def _result(self, items: dict[int, ClaimedItem], record: dict[str, Any]) -> ItemResult | None:
        """One output line as the item's result; None: the line goes back to pending."""
        try:
            item = items[int(record.get("custom_id", ""))]
        except (KeyError, ValueError):
            return None  # not one of this chunk's lines
        response = record.get("response") or {}
        if response.get("status_code") != 200:
            return None
        try:
            completion = read_json(
                orjson.dumps(response.get("body")), item.endpoint, time.perf_counter()
            )
        except RequestError:
            return None
        plan = self.rules.plan(item.endpoint, {**self.spec.request_defaults(), **item.body})
        outcome = plan.judge(completion)
        if outcome is None:  # a repair or a longer retry: done online or in the next batch
            return None
        self.stats.prompt_tokens += completion.prompt_tokens or 0
        self.stats.completion_tokens += completion.completion_tokens or 0
        return ItemResult(
            line=item.line,
            status=outcome.status,
            attempts=1,
            prompt_tokens=completion.prompt_tokens,
            completion_tokens=completion.completion_tokens,
            finish_reason=completion.finish_reason,
            output=completion.text,
            parsed=outcome.parsed,
            error=outcome.error,
            answered_by="batch",  # `status` counts what batches answered like an endpoint
        )


def _failure(record: dict[str, Any]) -> str:
    """An error file line's reason: its error code, or its response's HTTP status."""
    error = record.get("error")
    if isinstance(error, dict) and error.get("code"):
        return str(error["code"])
    response = record.get("response")
    status = response.get("status_code") if isinstance(response, dict) else None
    return f"HTTP {status}" if status else "unknown"


def _records(content: bytes) -> list[dict[str, Any]]:
    records = []
    for raw in content.splitlines():
        try:
            record = orjson.loads(raw)
        except orjson.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def _crash_point(name: str) -> None:
    """Test mode: `BATCHRUN_CRASH_AT=name` kills this process here, as `kill -9` would."""
    if os.environ.get("BATCHRUN_CRASH_AT") == name:
        os.kill(os.getpid(), signal.SIGKILL)


async def run_batches(
    ledger: Ledger,
    name: str,
    spec: RunSpec,
    *,
    log: JobLog,
    rules: OutputRules,
    transport: Transport | None = None,
    handle_signals: bool = True,
) -> RunStats:
    """Run the job's batches to the end (or to Ctrl-C/SIGTERM: the batches go on at the
    provider, and `resume` picks up polling)."""
    stats = RunStats()
    api = BatchAPI(spec, transport)
    run = HostedRun(ledger, api, name, spec, rules=rules, log=log)
    log.event("batch_mode_started", max_requests=spec.batch_max_requests)
    try:
        if handle_signals:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_stop_on_signals, tg.cancel_scope, stats)
                await _until_done(run, stats, log)
                tg.cancel_scope.cancel()
        else:
            await _until_done(run, stats, log)
    finally:
        with anyio.CancelScope(shield=True):
            await api.aclose()
    h = run.stats
    stats.recorded, stats.batches = h.recorded, h.batches
    stats.batch_tokens = h.prompt_tokens + h.completion_tokens
    stats.elapsed = time.monotonic() - stats.started
    return stats


async def _until_done(run: HostedRun, stats: RunStats, log: JobLog) -> None:
    """The run, its provider's refusal (a wrong key, an unknown endpoint) as the abort."""
    try:
        await run.run()
    except RequestError as exc:
        stats.aborted = str(exc)
        log.event("abort", error=str(exc), kind=type(exc).__name__)


async def _stop_on_signals(scope: anyio.CancelScope, stats: RunStats) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            stats.interrupted, stats.stopped_by = True, signum
            scope.cancel()
            return


async def cancel_batches(
    ledger: Ledger, name: str, spec: RunSpec, *, transport: Transport | None = None
) -> list[str]:
    """Ask the provider to cancel the job's running batches; their ids. What they answered
    before stopping is collected by the next run (`resume`), the rest goes back to pending."""
    api = BatchAPI(spec, transport)
    cancelled = []
    try:
        for chunk in ledger.chunks.listed(name, open_only=True):
            if chunk.batch_id is None or chunk.state in FINISHED:
                continue
            batch = await api.cancel(chunk.batch_id)
            ledger.chunks.note(name, chunk.chunk, state=batch.get("status", "cancelling"))
            cancelled.append(chunk.batch_id)
    finally:
        await api.aclose()
    return cancelled
