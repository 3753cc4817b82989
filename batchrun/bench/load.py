"""Load generation: a closed-loop concurrency sweep (or Poisson arrivals) against one endpoint.

For each class and each concurrency level, `warmup` requests are sent and thrown away (they
open connections and fill caches), then at least `repeat` requests (and at least one per slot,
so a level of 16 really has 16 in flight) are measured. Closed loop: each of C workers sends its
next request when its last one ends. With `rate`, requests arrive at Poisson times instead, at
most C in flight (vLLM's --request-rate with --max-concurrency). Requests are not retried: a
failure is a measurement.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import anyio

from batchrun.backends import Backend, Completion, CompletionRequest
from batchrun.bench.metrics import RequestRecord
from batchrun.bench.suite import BenchClass, Suite, request_body
from batchrun.errors import RequestError
from batchrun.validate import SchemaCheck, response_format


@dataclass(frozen=True)
class LoadPlan:
    levels: tuple[int, ...] = (1, 4, 8, 16)
    repeat: int = 10
    warmup: int = 2
    rate: float | None = None  # requests per second, Poisson; None: closed loop
    seed: int = 0
    model: str | None = None
    guided_style: str | None = "json_schema"  # how the JSON class asks for its schema

    def measured(self, level: int) -> int:
        """Requests measured at `level`: at least `repeat`, one per slot, and closed-loop in
        whole rounds (a last round of fewer than `level` would leave slots idle, and the
        level's throughput low)."""
        count = max(self.repeat, level)
        return count if self.rate is not None else math.ceil(count / level) * level

    def per_class(self) -> int:
        """Requests a sweep sends of each class, warm-ups included: the prompts it needs for
        none to be sent twice."""
        return sum(self.warmup + self.measured(level) for level in self.levels)


@dataclass
class Cell:
    endpoint: str
    cls: str
    concurrency: int
    wall_s: float
    records: list[RequestRecord]
    repeated: int = 0  # measured requests whose prompt this sweep sent before (the suite ran out)


def record_of(
    endpoint: str,
    cls: BenchClass,
    level: int,
    started: float,
    result: Completion | RequestError,
    elapsed: float,
    check: SchemaCheck | None = None,
) -> RequestRecord:
    """One request's measurements from its completion (or its error)."""
    record = RequestRecord(
        endpoint, cls.name, level, ok=False, started_s=started, e2e_ms=elapsed * 1000
    )
    if isinstance(result, RequestError):
        record.error_code = str(result.status) if result.status else type(result).__name__
        record.error = str(result)[:300]
        return record
    c = result
    times = c.chunk_times
    tokens, source = c.completion_tokens, "usage"
    if tokens is None and times:
        tokens, source = len(times), "chunks"
    if not c.text and not times and not tokens:  # a 200 with nothing in it (a server shedding
        record.error_code, record.error = "empty", "an answer without a token"  # load so)
        return record
    # From sending to the last byte, whatever the client did inside (asked again without
    # streaming after an empty stream, or without stream_options after a 400): the answer's
    # own timings are from its last sending, `before` it.
    e2e, before = elapsed * 1000, max(0.0, elapsed - c.latency_s) * 1000
    ttft = before + c.ttft_s * 1000 if c.ttft_s is not None else None
    decoding = e2e - ttft if ttft is not None else None
    after = tokens - 1 if tokens else 0  # tokens in the time after the first one
    if c.text and len(times) <= len(c.text):  # every delta a piece of the answer (no thought)
        # each token that shows adds a byte at least: tokens the server decoded unseen before
        # the first piece (the whitespace a JSON grammar lets through, trimmed) are not in the
        # time after it (measured on llama-server: 24 of 32, TPOT 4x too low)
        after = min(after, len(c.text.encode()) - 1)
    tpot = decoding / after if decoding is not None and after > 0 else None
    valid = check.check(c.text, c.finish_reason).ok if check is not None else None
    return replace(
        record,
        ok=True,
        e2e_ms=e2e,
        ttft_ms=ttft,
        tpot_ms=tpot,
        itl_ms=[(b - a) * 1000 for a, b in itertools.pairwise(times)],
        output_tokens=tokens,
        prompt_tokens=c.prompt_tokens,
        tokens_from=source,
        schema_valid=valid,
        server_timing=c.server_timing,
        chunks=len(times),
    )


async def run_cell(
    backend: Backend,
    endpoint: str,
    cls: BenchClass,
    level: int,
    plan: LoadPlan,
    clock: Callable[[], float] = time.perf_counter,
    *,
    first: int = 0,
) -> Cell:
    """Warm up, then measure one class at one concurrency level, from the class's `first`
    prompt on (a sweep's levels take prompts in turn: a prompt sent again at the next level
    would be answered from the server's prompt cache, its prefill free)."""

    def body(i: int) -> dict[str, Any]:
        b = request_body(cls, i, plan.model, plan.seed)
        if cls.schema is not None and plan.guided_style is not None:
            b["response_format"] = response_format(plan.guided_style, cls.schema)
        return b

    async def send(i: int, t0: float) -> RequestRecord:
        sent = clock()
        try:
            result: Completion | RequestError = await backend.complete(
                CompletionRequest("chat", body(i))
            )
        except RequestError as exc:
            result = exc
        return record_of(endpoint, cls, level, sent - t0, result, clock() - sent, check)

    check = SchemaCheck(cls.schema) if cls.schema else None  # compiled once per cell
    measured = range(first + plan.warmup, first + plan.warmup + plan.measured(level))
    await _drive(send, range(first, measured.start), level, None, plan.seed, clock)
    started = clock()
    records = await _drive(send, measured, level, plan.rate, plan.seed, clock, t0=started)
    repeated = sum(i >= len(cls.prompts) for i in measured)
    return Cell(endpoint, cls.name, level, clock() - started, records, repeated)


async def _drive(
    send: Callable[[int, float], Any],
    indexes: range,
    level: int,
    rate: float | None,
    seed: int,
    clock: Callable[[], float],
    t0: float | None = None,
) -> list[RequestRecord]:
    records: list[RequestRecord] = []
    start = clock() if t0 is None else t0
    todo = iter(indexes)
    slots = anyio.CapacityLimiter(level)

    async def one(i: int) -> None:
        async with slots:
            records.append(await send(i, start))

    async with anyio.create_task_group() as tg:
        if rate is None:

            async def worker() -> None:
                for i in todo:
                    records.append(await send(i, start))

            for _ in range(min(level, len(indexes))):
                tg.start_soon(worker)
        else:
            arrivals = random.Random(seed)
            for n, i in enumerate(indexes):
                if n:  # the first arrives at once; each next after an exponential gap
                    await anyio.sleep(arrivals.expovariate(rate))
                tg.start_soon(one, i)
    return records


async def sweep(
    backend: Backend,
    endpoint: str,
    suite: Suite,
    plan: LoadPlan,
    on_cell: Callable[[Cell], None] | None = None,
) -> list[Cell]:
    """Every class at every level, one after another, on one endpoint."""
    cells = []
    for cls in suite.classes:
        first = 0
        for level in plan.levels:
            cell = await run_cell(backend, endpoint, cls, level, plan, first=first)
            first += plan.warmup + plan.measured(level)
            cells.append(cell)
            if on_cell is not None:
                on_cell(cell)
    return cells
