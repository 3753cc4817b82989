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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import orjson

from batchrun.backends.answers import read_json
from batchrun.backends.batch_api import BatchAPI, Unreadable
from batchrun.batch_files import answered, failure, reasons, records
from batchrun.config import RunSpec
from batchrun.errors import (
    FatalError,
    NotFound,
    PermanentError,
    RequestError,
    TransientError,
)
from batchrun.ledger import Chunk, ClaimedItem, ItemResult, Ledger, run_owner
from batchrun.progress import JobLog
from batchrun.reuse import answer_spec
from batchrun.structured import OutputRules

URLS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
FINISHED = ("completed", "expired", "cancelled", "failed")
RUNNING = ("validating", "in_progress", "finalizing", "cancelling")
UNREADABLE = "unreadable"  # a chunk whose create's answer could not be read
CRASH_POINTS = ("uploaded", "created", "downloading")  # BATCHRUN_CRASH_AT, for the tests
LEASE_S = 900.0  # how long a run may take to upload and create a chunk's batch before another does
T = TypeVar("T")


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
        self.rules, self.log = rules, log
        self.store = ledger.chunks
        self.stats = HostedStats()
        self._answer_spec = answer_spec(spec)
        self._defaults = spec.request_defaults()
        self.owner = run_owner()  # this run, as the chunks it submits know it
        self.sent: set[int] = set()  # chunks whose create may have reached the provider

    async def run(self, *, send: bool) -> HostedStats:
        """Reconcile and submit open chunks; with `send`, make batches of what is pending
        and wait for them all; without (a `--mode online` run), collect what has finished,
        and give back to pending the lines of a chunk that has no batch (killed before its
        create): an online run makes none."""
        for chunk in self.store.listed(self.name, open_only=True):
            if chunk.batch_id is not None:
                continue
            if self.store.take(self.name, chunk.chunk, owner=self.owner, lease=LEASE_S):
                items = self.store.lines(self.name, chunk.chunk) if send else []
                await self._submit(chunk, items, [self._line(item) for item in items])
            # else another live run is submitting it now
        while send and await self._next_chunk():
            pass
        await self._poll(wait=send)
        return self.stats

    async def _next_chunk(self) -> bool:
        """Start, upload and create the next chunk of pending items; False when none is left."""
        pending = self.store.pending(self.name, self.spec.batch_max_requests)
        if not pending:
            return False
        picked: dict[int, tuple[ClaimedItem, bytes]] = {}  # line -> the item, its JSONL line
        size = 0
        for item in pending:
            if item.endpoint != pending[0].endpoint:
                continue  # in a chunk of its own kind, next
            encoded = self._line(item)
            size += len(encoded)
            if picked and size > self.spec.batch_max_bytes:
                break
            picked[item.line] = (item, encoded)
        number, lines = self.store.start(self.name, list(picked), owner=self.owner, lease=LEASE_S)
        if lines:  # those still pending when it started (another run may have taken some)
            chunk = next(c for c in self.store.listed(self.name) if c.chunk == number)
            items = [picked[line][0] for line in lines]
            await self._submit(chunk, items, [picked[line][1] for line in lines], fresh=True)
        return True

    async def _submit(
        self, chunk: Chunk, items: list[ClaimedItem], encoded: list[bytes], *, fresh: bool = False
    ) -> None:
        """Upload and create a chunk's batch, unless the provider has it already (a run
        before this one, killed after the create). A refusal (4xx) puts its lines back."""
        number = chunk.chunk
        meta = {"batchrun_job": self.name, "batchrun_chunk": str(number), "batchrun_key": chunk.key}
        found = (
            None if fresh else await self._patiently(lambda: self.api.find(meta, chunk.created_at))
        )
        if found is not None:
            if self.store.created(self.name, number, found["id"], found.get("status")):
                self.log.event("batch_adopted", chunk=number, batch=found["id"])
            return
        if not items:
            self.store.close(self.name, number)
            return
        if chunk.state == UNREADABLE:  # its create may have made a batch that was not found
            raise FatalError(
                f"chunk {number}'s create may have made a batch (its answer, or the look for it, "
                "failed) and none with its metadata is listed: look at the provider before "
                "paying again; `resume "
                f"{self.name} --mode online` sends its lines as ordinary requests"
            )
        content, uploaded = b"".join(encoded), False
        try:
            file_id = await self._patiently(
                lambda: self.api.upload(f"{self.name}-{number}.jsonl", content)
            )
            self.store.note(self.name, number, input_file=file_id, state="uploaded")
            uploaded = True
            _crash_point("uploaded")
            batch = await self._create(file_id, URLS[items[0].endpoint], meta, chunk)
        except Unreadable as exc:
            if not uploaded:
                raise self._refused(number, exc) from None
            # The create's answer: a batch may exist, paid for. The lines stay in the chunk, and
            # no run creates it again unless the provider lists a batch that names it.
            self.store.note(self.name, number, state=UNREADABLE)
            self.log.event("batch_unreadable", chunk=number, error=str(exc))
            raise
        except (PermanentError, FatalError) as exc:
            raise self._refused(number, exc) from None
        if batch is None:  # another run took the chunk over meanwhile (this one's lease ran out)
            self.log.event("batch_left", chunk=number, reason="another run holds it")
            return
        _crash_point("created")
        if not self.store.created(self.name, number, batch["id"], batch.get("status")):
            # Another run recorded a batch for the chunk first: this one is a second, cancelled.
            await self._patiently(lambda: self.api.cancel(batch["id"]))
            self.log.event("batch_cancelled", chunk=number, batch=batch["id"], reason="second")
            return
        self.stats.batches += 1
        self.log.event("batch_created", chunk=number, batch=batch["id"], lines=len(items))

    def _refused(self, number: int, exc: RequestError) -> RequestError:
        """The provider refused a chunk before it made a batch: its lines go back."""
        back = self.store.close(self.name, number)
        self.log.event("batch_refused", chunk=number, error=str(exc), back_to_pending=back)
        return exc

    async def _create(
        self, file_id: str, endpoint: str, meta: dict[str, str], chunk: Chunk
    ) -> Any | None:
        """Create the batch; after a transient error the create may have reached the
        provider, so it is looked for before it is tried again. None when the chunk's lease
        ran out meanwhile and another run holds it (an upload or an outage that took longer
        than the lease): that run creates it. Each create renews the lease."""
        started, wait, uncertain = time.monotonic(), 1.0, False
        while True:
            if not self.store.take(self.name, chunk.chunk, owner=self.owner, lease=LEASE_S):
                return None
            self.sent.add(chunk.chunk)  # its lease stands when this run ends (let_go)
            try:
                return await self.api.create(file_id, endpoint, meta)
            except TransientError as exc:
                if time.monotonic() - started > self.spec.outage_timeout:
                    if uncertain:  # an earlier create may have made it: never given back
                        raise Unreadable(f"after a create that may have made it: {exc}") from None
                    raise
                pause = min(300.0, exc.retry_after or wait)
            except (PermanentError, FatalError) as exc:
                if not uncertain:
                    raise  # refused: no batch was made (its chunk is closed, never taken again)
                raise Unreadable(f"after a create that may have made the batch: {exc}") from None
            # The create may have reached the provider: from here no error gives lines back.
            uncertain = True
            await anyio.sleep(pause)
            wait = min(30.0, wait * 2)
            try:
                found = await self._patiently(lambda: self.api.find(meta, chunk.created_at))
            except RequestError as exc:  # refused, unreadable, or down past --outage-timeout
                raise Unreadable(f"after a create that may have made the batch: {exc}") from None
            if found is not None:
                return found

    async def _patiently(self, call: Callable[[], Awaitable[T]]) -> T:
        return await patiently(call, within=self.spec.outage_timeout)

    def _line(self, item: ClaimedItem) -> bytes:
        body = self.rules.plan(item.endpoint, {**self._defaults, **item.body})
        request = {
            "custom_id": str(item.line),
            "method": "POST",
            "url": URLS[item.endpoint],
            "body": body.request(),
        }
        return orjson.dumps(request) + b"\n"

    async def _poll(self, *, wait: bool) -> None:
        """Look at the open batches, collecting the finished ones, until none is open (or,
        without `wait`, once)."""
        pause = min(1.0, self.spec.poll_interval)
        while True:
            open_chunks = [c for c in self.store.listed(self.name, open_only=True) if c.batch_id]
            for chunk in open_chunks:
                await self._look(chunk)
            if not wait or not open_chunks:
                return
            await anyio.sleep(pause)
            pause = min(self.spec.poll_interval, pause * 2)

    async def _look(self, chunk: Chunk) -> None:
        batch_id = chunk.batch_id
        assert batch_id is not None
        try:
            batch = await self._patiently(lambda: self.api.get(batch_id))
        except NotFound as exc:
            # Not "gone": OpenAI's batches cannot be deleted, so a 404 is far likelier a key of
            # another project or a wrong URL, and the batch still being paid for. Its lines stay
            # batched; `batchrun cancel` gives them back if the user knows it is gone.
            raise FatalError(
                f"batch {batch_id} (chunk {chunk.chunk}) is not found with this key at this "
                f"URL ({exc}); its lines stay batched: if it is gone for good, `batchrun "
                f"cancel {self.name} --forget` puts them back to pending"
            ) from None
        status = batch.get("status")
        if status not in FINISHED + RUNNING:
            raise FatalError(
                f"batch {batch_id} (chunk {chunk.chunk}) has a status batchrun does not know: "
                f"{str(status)[:100]!r}; its lines stay batched, and `resume` looks again"
            )
        counts = batch.get("request_counts")
        if status != chunk.state or counts != chunk.counts:
            self.store.note(self.name, chunk.chunk, state=status, counts=counts)
        if status in FINISHED:
            await self._collect(chunk, batch)
        if status == "failed":  # refused at validation: said, not sent again blindly
            raise FatalError(f"the provider failed batch {batch_id}: {reasons(batch)}")

    async def _collect(self, chunk: Chunk, batch: dict[str, Any]) -> None:
        """Record a finished batch's answers; the rest of its lines go back to pending."""
        items = {item.line: item for item in self.store.lines(self.name, chunk.chunk)}
        results: list[ItemResult] = []
        followups: dict[int, dict[str, Any]] = {}  # answers a repair or longer retry follows
        output = await self._file(batch.get("output_file_id"), "output")
        _crash_point("downloading")  # downloaded, nothing recorded yet
        if not output and answered(batch):  # paid for: not sent again as if never answered
            raise FatalError(
                f"batch {chunk.batch_id} (chunk {chunk.chunk}) says {answered(batch)} lines "
                "were answered, and no output file with them was had; its lines stay batched: "
                "`resume` looks again (`batchrun cancel JOB --forget` gives them up)"
            )
        seen: set[Any] = set()
        for record in output:
            key = record.get("custom_id")
            if not isinstance(key, (str, int)) or str(key) in seen:
                continue  # not a line's id; a line answered twice: the first answer counts
            seen.add(str(key))
            result = self._result(items, record, followups)
            if result is not None:
                results.append(result)
        failures: dict[str, int] = {}  # why the provider failed lines, for the log
        for record in await self._file(batch.get("error_file_id"), "error"):
            why = failure(record)
            failures[why] = failures.get(why, 0) + 1
        recorded = self.ledger.record(
            self.name, "", results, answer_spec=self._answer_spec, chunk=chunk.chunk
        ).finished
        back = self.store.close(self.name, chunk.chunk, followups)
        self.stats.recorded += recorded
        self.stats.returned += back
        self.log.event(
            "batch_collected",
            chunk=chunk.chunk,
            batch=chunk.batch_id,
            status=batch.get("status"),
            recorded=recorded,
            back_to_pending=back,
            failures=failures,
        )

    async def _file(self, file_id: Any, kind: str) -> list[dict[str, Any]]:
        """A batch's output or error file, its lines parsed; none when it has none (or the
        provider no longer keeps it)."""
        if not isinstance(file_id, str) or not file_id:
            return []
        try:
            return records(await self._patiently(lambda: self.api.content(file_id)), kind)
        except NotFound:
            return []

    def _result(
        self,
        items: dict[int, ClaimedItem],
        record: dict[str, Any],
        followups: dict[int, dict[str, Any]],
    ) -> ItemResult | None:
        """One output line as the item's result; None: the line goes back to pending (with
        its answer in `followups` when a repair or a longer retry should follow it)."""
        try:
            item = items[int(str(record.get("custom_id")))]
        except (KeyError, ValueError):
            return None  # not one of this chunk's lines
        response = record.get("response")
        if not isinstance(response, dict) or response.get("status_code") != 200:
            return None
        try:
            completion = read_json(
                orjson.dumps(response.get("body")), item.endpoint, time.perf_counter()
            )
        except RequestError:
            return None
        plan = self.rules.plan(item.endpoint, {**self._defaults, **item.body})
        outcome = plan.judge(completion)
        self.stats.prompt_tokens += completion.prompt_tokens or 0
        self.stats.completion_tokens += completion.completion_tokens or 0
        if outcome is None:  # a repair or a longer retry follows it, online or in a batch
            followups[item.line] = {
                "text": completion.text,
                "finish_reason": completion.finish_reason,
                "prompt_tokens": completion.prompt_tokens,
                "completion_tokens": completion.completion_tokens,
            }
            return None
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
            answer_model=item.body.get("model") or self._defaults.get("model"),
        )


async def patiently(call: Callable[[], Awaitable[T]], *, within: float) -> T:
    """`call`, tried again after transient errors (429, 5xx, a lost connection) for up
    to `within` seconds (--outage-timeout), waiting 1 s and then twice as long (or as
    Retry-After says)."""
    started, wait = time.monotonic(), 1.0
    while True:
        try:
            return await call()
        except TransientError as exc:
            if time.monotonic() - started > within:
                raise
            await anyio.sleep(min(300.0, exc.retry_after or wait))
            wait = min(30.0, wait * 2)


def _crash_point(name: str) -> None:
    """Test mode: `BATCHRUN_CRASH_AT=name` kills this process here, as `kill -9` would."""
    if os.environ.get("BATCHRUN_CRASH_AT") == name:
        os.kill(os.getpid(), signal.SIGKILL)
