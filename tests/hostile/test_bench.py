"""A hostile review of `batchrun bench`: scripted servers whose timings and token counts are known
exactly, so the true figures are known, and where bench reports something else.

Time is virtual: the event loop below jumps to its next timer whenever nothing is ready, and
time.perf_counter (what the client stamps TTFT, chunk times and E2E with) reads that loop's
clock, so a server that "takes 200 ms" takes exactly 200 ms of the loop's time and no test
depends on the machine's speed or waits for real.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import orjson
import pytest

from batchrun.backends import OpenAICompatBackend
from batchrun.bench import compare, load, report
from batchrun.bench.load import LoadPlan, run_cell
from batchrun.bench.metrics import RequestRecord, summarize
from batchrun.bench.run import Endpoint, run_bench
from batchrun.bench.suite import BenchClass, Suite
from batchrun.config import resolve

# --- virtual time -------------------------------------------------------------------------


class VirtualLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock jumps to the next timer when nothing is ready to run."""

    def __init__(self) -> None:
        super().__init__()
        self._now = 0.0

    def time(self) -> float:
        return self._now

    def _run_once(self) -> None:
        scheduled = self._scheduled  # type: ignore[attr-defined]
        while scheduled and scheduled[0]._cancelled:
            handle = heapq.heappop(scheduled)
            handle._scheduled = False
            self._timer_cancelled_count -= 1  # type: ignore[attr-defined]
        if not self._ready and scheduled:  # type: ignore[attr-defined]
            self._now = max(self._now, scheduled[0]._when)
        super()._run_once()  # type: ignore[misc]


_REAL_PERF_COUNTER = time.perf_counter


def vclock() -> float:
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return _REAL_PERF_COUNTER()


@pytest.fixture
def virtual(monkeypatch: pytest.MonkeyPatch) -> Callable[..., Any]:
    """Run an async function under virtual time; bench's own cell clock reads it too."""
    monkeypatch.setattr(time, "perf_counter", vclock)
    monkeypatch.setattr(load.run_cell, "__defaults__", (vclock,))

    def run(fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        return anyio.run(
            fn, *args, backend="asyncio", backend_options={"loop_factory": VirtualLoop}
        )

    return run


# --- scripted servers ---------------------------------------------------------------------

Events = list[tuple[float, bytes]]  # (seconds to wait first, bytes to send)
Script = Callable[[dict[str, Any], str], tuple[int, dict[str, str], Events]]
SSE = {"content-type": "text/event-stream"}


def sse(*chunks: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks)


def streamed(
    ttft: float, tpot: float, tokens: int, *, reasoning: int = 0, usage: bool = True
) -> tuple[int, dict[str, str], Events]:
    """One token per delta: the first after `ttft`, each next `tpot` later; the first
    `reasoning` of them as `reasoning_content` (vLLM's and llama-server's reasoning parsers)."""
    events: Events = [(0.0, sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}))]
    for i in range(tokens):
        delta = {"reasoning_content": f"r{i} "} if i < reasoning else {"content": f"t{i} "}
        events.append((ttft if i == 0 else tpot, sse({"choices": [{"index": 0, "delta": delta}]})))
    tail = [{"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
    if usage:
        tail.append({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": tokens}})
    events.append((0.0, sse(*tail) + b"data: [DONE]\n\n"))
    return 200, SSE, events


class Played(httpx.AsyncByteStream):
    """A response body played from `events` (a delay, then bytes): with `slots`, only while it
    holds one of them; `after` is called when it ends."""

    def __init__(
        self,
        events: Events,
        *,
        slots: anyio.Semaphore | None = None,
        after: Callable[[], None] | None = None,
    ) -> None:
        self.events, self.slots, self.after = events, slots, after

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self.slots is not None:
            await self.slots.acquire()
        try:
            for delay, data in self.events:
                if delay:
                    await anyio.sleep(delay)
                yield data
        finally:
            if self.slots is not None:
                self.slots.release()
            if self.after is not None:
                self.after()


class Scripted(httpx.AsyncBaseTransport):
    """An OpenAI-compatible server played from a script, in process. With `slots`, at most that
    many answers are produced at once and the rest wait (a server with that many batch slots).
    Hosts in `down` refuse connections."""

    def __init__(self, script: Script, slots: int | None = None, down: tuple[str, ...] = ()):
        self.script = script
        self.slots = anyio.Semaphore(slots) if slots else None
        self.down = down

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.host in self.down:
            raise httpx.ConnectError("connection refused")
        if request.method == "GET":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "m"}]})
        body = orjson.loads(await request.aread())
        status, headers, events = self.script(body, request.url.host)
        return httpx.Response(status, headers=headers, stream=Played(events, slots=self.slots))


SHORT = BenchClass("short", 64, ("In one sentence: what is a kettle for?",))


async def _cell(script: Script, level: int = 1, repeat: int = 4, slots: int | None = None) -> Any:
    backend = OpenAICompatBackend("http://gpu.test/v1", transport=Scripted(script, slots))
    try:
        plan = LoadPlan(levels=(level,), repeat=repeat, warmup=0, model="m")
        cell = await run_cell(backend, "gpu", SHORT, level, plan)
    finally:
        await backend.aclose()
    return summarize(cell.records, cell.wall_s)


# --- the defects --------------------------------------------------------------------------


def test_the_default_sweep_measures_a_levels_throughput_with_all_its_slots_busy(
    virtual: Callable[..., Any], tmp_path: Path
) -> None:
    """A server with 8 batch slots, every answer 11 tokens in exactly 200 ms however many run
    at once (up to 8): it serves 5 requests/s at concurrency 1, 20 at 4, 40 at 8 and still 40 at
    16, where the extra 8 only queue and P95 latency doubles. The right recommendation is 8.

    With the defaults (--concurrency 1,4,8,16 --repeat 10), a level of 8 measures 10 requests:
    one full round of 8, then a second round of only 2, so the cell's wall time is 400 ms for 10
    answers: 25 req/s, not 40. Level 4 likewise (3 rounds for 10: 16.7, not 20). Level 16 (16
    requests, two full rounds) shows 40, so "throughput +60%" from 8 to 16 and bench
    recommends 16, the level where the server only queues."""

    async def main() -> dict[str, Any]:
        spec = resolve({"base_url": "http://gpu.test/v1", "model": "m"})
        transport = Scripted(lambda body, host: streamed(0.1, 0.01, 11), slots=8)
        return await run_bench(
            [Endpoint("gpu", spec)],
            Suite([SHORT]),
            LoadPlan(),  # the defaults: levels 1,4,8,16, repeat 10, warmup 2
            tmp_path,
            label="slots8",
            selftest=False,
            transport=transport,
            say=lambda _: None,
            show=lambda _: None,
        )

    results = virtual(main)
    rps = {c["concurrency"]: c["request_throughput"] for c in results["cells"]}
    p95 = {c["concurrency"]: c["e2e_ms"]["p95"] for c in results["cells"]}
    assert p95[8] == pytest.approx(200) and p95[16] == pytest.approx(400)  # the server as scripted
    assert rps[8] == pytest.approx(40, rel=0.05), f"req/s per level {rps} (true: 5, 20, 40, 40)"
    assert rps[4] == pytest.approx(20, rel=0.05), f"req/s per level {rps} (true: 5, 20, 40, 40)"
    assert results["knees"][0]["concurrency"] == 8, results["knees"][0]


def test_tpot_of_a_reasoning_model_is_its_time_per_token(virtual: Callable[..., Any]) -> None:
    """A reasoning model (vLLM with --reasoning-parser, llama-server's default reasoning format)
    streams its thinking as `reasoning_content` deltas, then the answer as `content`; `usage`
    counts both. Scripted: 20 tokens, the first at 100 ms, then one every 10 ms; the first 10
    are reasoning. The decode speed is 10 ms per token.

    Bench takes TTFT at the first *content* delta (200 ms) but divides the time after it by all
    20 tokens of usage: TPOT (290 - 200) / 19 = 4.7 ms, half the truth, so this model looks
    twice as fast at decoding as it is. (And a `short`/`json` answer that spends its 128 tokens
    thinking has no TTFT at all, yet counts as a success.)"""
    cell = virtual(_cell, lambda body, host: streamed(0.1, 0.01, 20, reasoning=10))
    assert cell["e2e_ms"]["p50"] == pytest.approx(290)  # as scripted
    assert cell["tpot_ms"]["p50"] == pytest.approx(10, rel=0.05), cell["tpot_ms"]


def test_an_endpoint_out_of_reach_does_not_throw_away_the_ones_already_measured(
    virtual: Callable[..., Any], tmp_path: Path
) -> None:
    """`--endpoint h100=... --endpoint l40s=...` without model=: bench asks each server for
    its model list when its turn comes. When the second is down (after the first's whole sweep,
    which may have taken an hour), the run ends with an error and writes nothing: no
    results.json, summary.csv or report.md, so the first endpoint's measurements are lost."""

    async def main() -> None:
        endpoints = [
            Endpoint("h100", resolve({"base_url": "http://h100.test/v1"})),
            Endpoint("l40s", resolve({"base_url": "http://l40s.test/v1"})),
        ]
        transport = Scripted(lambda body, host: streamed(0.05, 0.01, 5), down=("l40s.test",))
        # saying the second endpoint failed is fine; losing the first is not
        with contextlib.suppress(Exception):
            await run_bench(
                endpoints,
                Suite([SHORT]),
                LoadPlan(levels=(1, 2), repeat=2, warmup=0),
                tmp_path / "run",
                label="two",
                selftest=False,
                transport=transport,
                say=lambda _: None,
                show=lambda _: None,
            )

    virtual(main)
    written = tmp_path / "run" / "results.json"
    assert written.exists(), "nothing written: h100's measured cells are lost"
    cells = json.loads(written.read_text())["cells"]
    assert {(c["endpoint"], c["concurrency"]) for c in cells} >= {("h100", 1), ("h100", 2)}


def _run(endpoints: dict[str, float]) -> dict[str, Any]:
    """A results.json of several endpoints, each with one cell of that many output tok/s."""

    def cell(name: str, tps: float) -> dict[str, Any]:
        record = RequestRecord(name, "short", 4, True, 0.0, 100.0, ttft_ms=10.0)
        record.output_tokens = int(tps)
        summary = summarize([record], 1.0)
        return {"endpoint": name, "class": "short", "concurrency": 4, **summary}

    return {
        "label": "+".join(endpoints),
        "endpoints": [{"name": n} for n in endpoints],
        "cells": [cell(n, tps) for n, tps in endpoints.items()],
    }


def test_compare_of_runs_with_several_endpoints_says_which_endpoint_each_row_is() -> None:
    """Monday's run measured h100 and l40s; after a driver upgrade, so did Tuesday's. `bench
    compare MON TUE` matches cells by endpoint, but prints each row as only class and level:
    two rows 'short 4' (one 2.00x, one 0.50x) and no way to tell that h100 got twice as fast
    and l40s half as fast, or the reverse."""
    monday = _run({"h100": 1000.0, "l40s": 400.0})
    tuesday = _run({"h100": 2000.0, "l40s": 200.0})
    text = compare.render("mon", "tue", compare.ratios(monday, tuesday))
    rows = [line for line in text.splitlines() if "x" in line and "short" in line]
    h100 = [line for line in rows if "h100" in line]
    l40s = [line for line in rows if "l40s" in line]
    assert h100 and l40s, f"rows do not name their endpoint:\n{text}"
    assert "2.00x" in h100[0] and "0.50x" in l40s[0], text


def test_answers_without_token_counts_are_not_shown_as_zero_tokens_per_second(
    virtual: Callable[..., Any],
) -> None:
    """A server (or proxy) that ignores `stream: true` and answers plain JSON with no `usage`:
    every request succeeds with text, but its token count is unknown. Bench counts each as 0
    tokens and shows '0 out tok/s' with no note (tokens=chunks is said only for streamed
    answers), a figure that is simply false; and with 0 at every level, the knee can never see
    throughput stall, so it recommends the highest level whatever the latency."""

    def plain(body: dict[str, Any], host: str) -> tuple[int, dict[str, str], Events]:
        answer = {
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "A kettle boils water."},
                    "finish_reason": "stop",
                }
            ]
        }
        return 200, {"content-type": "application/json"}, [(0.3, orjson.dumps(answer))]

    cell = virtual(_cell, plain)
    assert cell["success_rate"] == 1.0
    row = report.table([{**cell, "endpoint": "gpu", "class": "short", "concurrency": 1}])[1]
    out_tok_s, note = row[4], row[-1]
    assert out_tok_s != "0" or "token" in note, f"shown as measured: {row}"
    # and summary.csv, read alone, says so too
    csv_row = report.csv_row({**cell, "endpoint": "gpu", "class": "short", "concurrency": 1})
    assert csv_row["tokens_unknown"] is True and csv_row["output_throughput"] is None


def test_e2e_counts_from_sending_to_the_last_byte_when_the_client_asks_twice(
    virtual: Callable[..., Any],
) -> None:
    """A server that closes its event streams without an event (python -m llama_cpp.server
    does so for some requests): the client asks once more without streaming, inside the same
    request. Scripted: the empty stream takes 500 ms, the plain answer 300 ms more. Bench's
    E2E is 'sending to the last byte', 800 ms, but it reports 300 ms: the first half of the
    wait is dropped, so this server looks 2.7 times faster than a user finds it."""

    def empty_then_plain(body: dict[str, Any], host: str) -> tuple[int, dict[str, str], Events]:
        if body.get("stream"):
            return 200, SSE, [(0.5, b"")]
        answer = {
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "A kettle boils water."},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 9, "completion_tokens": 5},
        }
        return 200, {"content-type": "application/json"}, [(0.3, orjson.dumps(answer))]

    cell = virtual(_cell, empty_then_plain)
    assert cell["success_rate"] == 1.0
    assert cell["e2e_ms"]["p50"] == pytest.approx(800, rel=0.02), cell["e2e_ms"]


class EmptyPastFour(httpx.AsyncBaseTransport):
    """A server that decodes 4 answers at a time (11 tokens in 200 ms each) and answers any
    request past those 4 at once with a 200 carrying no tokens (finish_reason stop, usage 0):
    a gateway or an overloaded engine shedding load with empty answers."""

    def __init__(self) -> None:
        self.busy = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await request.aread()
        if self.busy >= 4:
            empty = sse(
                {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
                {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 0}},
            )
            events: Events = [(0.005, empty + b"data: [DONE]\n\n")]
            counted = False
        else:
            events = streamed(0.1, 0.01, 11)[2]
            counted = True
            self.busy += 1
        return httpx.Response(200, headers=SSE, stream=Played(events, after=self._ended(counted)))

    def _ended(self, counted: bool) -> Callable[[], None]:
        def ended() -> None:
            self.busy -= counted

        return ended


def test_empty_answers_shed_under_load_are_not_counted_as_served_requests(
    virtual: Callable[..., Any], tmp_path: Path
) -> None:
    """Past 4 in flight this server answers with empty 200s in 5 ms. Bench counts them as
    successes: at 8 and 16 it reports 100% ok, 160 req/s (8 times what it served at 4), an
    E2E P50 of 5 ms, and recommends concurrency 16 ("throughput still growing"), where 7 of 8
    requests got nothing. TTFT and TPOT leave those answers out (no token), E2E and req/s count
    them, so the cell's figures do not even describe the same requests. (vLLM's benchmark marks
    a stream that never produced a token as failed.)"""

    async def main() -> dict[str, Any]:
        spec = resolve({"base_url": "http://gpu.test/v1", "model": "m"})
        return await run_bench(
            [Endpoint("gpu", spec)],
            Suite([SHORT]),
            LoadPlan(levels=(1, 4, 8, 16), repeat=32, warmup=0),
            tmp_path,
            label="shed",
            selftest=False,
            transport=EmptyPastFour(),
            say=lambda _: None,
            show=lambda _: None,
        )

    results = virtual(main)
    at = {c["concurrency"]: c for c in results["cells"]}
    assert at[4]["request_throughput"] == pytest.approx(20)  # as scripted: 4 per 200 ms
    assert at[16]["success_rate"] < 0.5, (
        f"{at[16]['success_rate']:.0%} ok, {at[16]['request_throughput']:.0f} req/s, "
        f"E2E p50 {at[16]['e2e_ms']['p50']:.0f} ms at 16 for a server that answered 4 of 32"
    )
    assert results["knees"][0]["concurrency"] == 4, results["knees"][0]


# --- a control: where bench is right, the harness gives the exact truth -------------------


def test_control_a_plain_streaming_server_is_measured_exactly(virtual: Callable[..., Any]) -> None:
    """Not a defect: passes today. Tokens 10 ms apart after a 100 ms first token, with empty
    content deltas and `usage: null` in between and usage only at the end; shows that the
    virtual-time harness above yields the true figures, so the failures above are bench's."""

    def noisy(body: dict[str, Any], host: str) -> tuple[int, dict[str, str], Events]:
        status, headers, events = streamed(0.1, 0.01, 11)
        blank = sse({"choices": [{"index": 0, "delta": {"content": ""}}], "usage": None})
        return status, headers, [(d, blank + data) for d, data in events]

    cell = virtual(_cell, noisy)
    assert cell["ttft_ms"]["p50"] == pytest.approx(100)
    assert cell["tpot_ms"]["p50"] == pytest.approx(10)
    assert cell["itl_ms"]["p50"] == pytest.approx(10) and cell["itl_ms"]["n"] == 4 * 10
    assert cell["e2e_ms"]["p50"] == pytest.approx(200)
    assert cell["request_throughput"] == pytest.approx(5)
    assert cell["output_throughput"] == pytest.approx(55)
