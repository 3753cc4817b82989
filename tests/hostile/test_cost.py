"""What a job pays and what batchrun says it paid, attacked (budgets, usage, status, the
--no-run preview, prices): each test fails on the code as reviewed and names the defect."""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
import orjson
import pytest

import batchrun
from batchrun import jobs
from batchrun.config import resolve
from batchrun.jobs import Home
from batchrun.ledger import Ledger
from batchrun.run_state import RunnerSettings, RunStats
from tests.fakes import FakeTime


class Engine(httpx.AsyncBaseTransport):
    """A scripted OpenAI-compatible server that bills what it generates: an answer of
    `answer` tokens, cut at the request's limit the way vLLM reads it
    (`max_completion_tokens or max_tokens`, a whole-number float taken as an int; null or
    absent: no limit). Counts the requests and the tokens it served."""

    def __init__(self, answer: int = 40, *, usage: bool = True) -> None:
        self.answer = answer
        self.usage = usage
        self.requests = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.bodies: list[dict[str, Any]] = []

    def limit(self, body: dict[str, Any]) -> int | None:
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        if isinstance(limit, float) and limit.is_integer():
            limit = int(limit)
        return limit if isinstance(limit, int) and limit > 0 else None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method != "POST":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        body = json.loads(await request.aread())
        self.bodies.append(body)
        self.requests += 1
        limit = self.limit(body)
        n = self.answer if limit is None else min(limit, self.answer)
        choices = body.get("n") if isinstance(body.get("n"), int) else 1  # each billed
        finish = "length" if limit is not None and limit < self.answer else "stop"
        text = " ".join(["w"] * n)
        prompt = 5
        self.prompt_tokens += prompt
        self.completion_tokens += n * choices
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": n * choices,
            "total_tokens": prompt + n * choices,
        }
        if not body.get("stream"):
            answer: dict[str, Any] = {
                "id": f"c{self.requests}",
                "object": "chat.completion",
                "model": "m",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": finish,
                    }
                ],
            }
            if self.usage:
                answer["usage"] = usage
            return httpx.Response(200, json=answer)
        chunks: list[dict[str, Any]] = [
            {"id": "c", "model": "m", "choices": [{"index": 0, "delta": {"content": text}}]},
            {
                "id": "c",
                "model": "m",
                "choices": [{"index": 0, "delta": {}, "finish_reason": finish}],
            },
        ]
        if self.usage:
            chunks.append({"id": "c", "model": "m", "choices": [], "usage": usage})
        sse = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
        return httpx.Response(200, content=sse, headers={"content-type": "text/event-stream"})


async def run(
    tmp_path: Path,
    name: str,
    lines: list[dict[str, Any]] | None,
    transport: httpx.AsyncBaseTransport,
    **options: Any,
) -> tuple[RunStats, dict[str, int], tuple[int, int], Ledger]:
    """Load (when `lines`) and run a job against `transport`; (stats, counts, paid tokens,
    the ledger, still open)."""
    home = Home.at(tmp_path, None)
    ledger = Ledger(home.ledger_url)
    spec = resolve(
        {
            "backend": "vllm",
            "base_url": "http://engine.test/v1",
            "model": "m",
            "concurrency": 1,
            "server_metrics": "off",
            **options,
        }
    )
    if lines is not None:
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        jobs.create_job(ledger, name, path, spec)
    fake = FakeTime()
    settings = RunnerSettings(sleep=fake.sleep, clock=fake.clock, drain_timeout=0.0)
    stats = await jobs.run_job(
        ledger, home, name, spec, transport=transport, settings=settings, handle_signals=False
    )
    jobs.finish(ledger, home, name, spec)
    return stats, ledger.counts(name), ledger.paid_tokens(name), ledger


def results(tmp_path: Path, name: str) -> list[dict[str, Any]]:
    path = tmp_path / "outputs" / f"{name}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


# --- a budget is a limit ---------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_lines_own_max_completion_tokens_is_held_against_the_budget(
    tmp_path: Path,
) -> None:
    """A line asking `max_completion_tokens: 2000` (OpenAI's current name) under a job's
    --max-tokens 10: both go out, and vLLM and SGLang generate by `max_completion_tokens or
    max_tokens`, but the budget holds only the 10. The first request is "admitted" against a
    budget of 300 and the job pays 2,005 tokens."""
    engine = Engine(answer=2000)
    lines = [{"prompt": f"question {i}", "max_completion_tokens": 2000} for i in range(3)]
    _stats, _counts, _paid, _ledger = await run(
        tmp_path, "j", lines, engine, max_tokens=10, max_total_tokens=300
    )
    assert engine.prompt_tokens + engine.completion_tokens <= 300, (
        f"a budget of 300 tokens paid {engine.prompt_tokens + engine.completion_tokens:,} "
        f"({engine.requests} request(s) sent; bodies {engine.bodies[:1]})"
    )


@pytest.mark.anyio
@pytest.mark.parametrize("limit", [None, 50.0])
async def test_a_lines_own_max_tokens_of_another_type_is_held_against_the_budget(
    tmp_path: Path, limit: float | None
) -> None:
    """A line's own `max_tokens` wins over --max-tokens (the README), but the budget's
    estimate reads only an int: `null` (sent as is: no limit at the server) is held as 256
    tokens, and `50.0` (a server reads it as 50) as none at all. --max-total-tokens then lets
    a request through that costs far more than what is left."""
    engine = Engine(answer=2000)
    lines = [{"prompt": f"question {i}", "max_tokens": limit} for i in range(3)]
    budget = 300 if limit is None else 30
    stats, _counts, _paid, _ledger = await run(
        tmp_path, "j", lines, engine, max_tokens=10, max_total_tokens=budget
    )
    spent = engine.prompt_tokens + engine.completion_tokens
    assert spent <= budget, (
        f"a budget of {budget} tokens paid {spent:,} ({engine.requests} request(s); the job "
        f"{'stopped: ' + stats.aborted if stats.aborted else 'was not stopped'})"
    )


@pytest.mark.anyio
async def test_a_cost_budget_reached_says_cost_when_a_token_budget_is_given_too(
    tmp_path: Path,
) -> None:
    """--max-total-tokens 1,000,000 and --max-cost 0.001 together: the cost runs out first,
    and the reason says `--max-total-tokens 1,000,000 reached ... the next request may take
    0.0002; resume with a higher --max-total-tokens`: the wrong limit, a price printed as
    tokens, and advice that stops the resume at the same place. The --max-cost, once given
    (at a resume too), is kept in the job's options, so every later `resume --max-total-tokens
    M` stops at once with the same words, whatever M: the user cannot tell what to raise."""
    engine = Engine(answer=40)
    lines = [{"prompt": f"question {i}"} for i in range(50)]
    stats, counts, _paid, _ledger = await run(
        tmp_path,
        "j",
        lines,
        engine,
        max_tokens=40,
        max_total_tokens=1_000_000,
        max_cost=0.001,
        price_in=1.0,
        price_out=10.0,
    )
    assert stats.aborted is not None and counts["pending"] > 0
    assert "--max-cost" in stats.aborted and "--max-total-tokens" not in stats.aborted, (
        stats.aborted
    )


@pytest.mark.anyio
async def test_a_longer_retry_the_budget_refused_says_so_in_the_error(tmp_path: Path) -> None:
    """README, Budgets: a longer retry the budget refuses is not sent, the answer stands
    (`done` without a schema) "with the budget's reason in `error`". Without a schema the
    line is `done` with `error: null`: a cut-off answer with no word of why it was not
    retried longer."""
    engine = Engine(answer=100)
    _stats, _counts, _paid, _ledger = await run(
        tmp_path,
        "j",
        [{"prompt": "tell me a story"}],
        engine,
        max_tokens=20,
        on_truncate="retry-longer",
        max_total_tokens=40,  # the first ask (~4 + 20) fits, the longer one (+ 40) does not
    )
    assert engine.requests == 1
    (line,) = results(tmp_path, "j")
    assert line["finish_reason"] == "length"
    assert line["error"] and "--max-total-tokens" in line["error"], line


@pytest.mark.anyio
async def test_a_lines_n_is_held_against_the_budget(tmp_path: Path) -> None:
    """A line asking `n: 4` (four samples, a request field batchrun sends) is billed four
    answers, but the budget holds one: four such requests at --concurrency 4 are all
    admitted against --max-total-tokens 400 and the job pays 660."""
    engine = Engine(answer=40)
    lines = [{"prompt": f"question {i}", "n": 4} for i in range(8)]
    _stats, _counts, paid, _ledger = await run(
        tmp_path, "j", lines, engine, max_tokens=40, max_total_tokens=400, concurrency=4
    )
    spent = engine.prompt_tokens + engine.completion_tokens
    assert spent <= 400, (
        f"a budget of 400 tokens paid {spent:,} ({engine.requests} requests of n=4; "
        f"the ledger says {sum(paid):,} paid)"
    )


class SlowFor(Engine):
    """The engine, answering prompts that hold `slow` only after `delay` seconds."""

    def __init__(self, slow: str, delay: float, answer: int = 40) -> None:
        super().__init__(answer)
        self.slow, self.delay = slow, delay
        self.arrived = 0  # requests that reached it (a slow one counts before it answers)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.arrived += request.method == "POST"
        if request.method == "POST" and self.slow.encode() in request.content:
            await anyio.sleep(self.delay)
        return await super().handle_async_request(request)


@pytest.mark.anyio
async def test_a_budget_stop_keeps_the_answers_it_already_admitted(tmp_path: Path) -> None:
    """Two requests fit the budget and go out together; the third does not, so the job stops.
    The stop is handled as a Ctrl-C: the second request, admitted and being paid for, gets
    the drain's grace (10 s by default, here 0.1 s) and is then cut off; its item goes back
    to pending and the budget counts it as nothing, so `resume` pays for it again. A budget
    has no reason to drop what it let through: it was within the limit."""
    engine = SlowFor("slow", delay=1.0, answer=40)
    stats, ledger = await run_to_the_budget(tmp_path, engine, RunnerSettings(drain_timeout=0.1))
    assert stats.aborted and "--max-total-tokens 100 reached" in stats.aborted
    done = {s.item_id: s.status for s in ledger.iter_results("j")}
    assert done == {"1": "done", "2": "done", "3": "pending"}, (
        f"{done}: the request the budget admitted was cut off at the stop "
        f"({engine.arrived} sent, {engine.requests} answered, the ledger's paid tokens "
        f"{ledger.paid_tokens('j')})"
    )


def _preview_then_run(
    tmp_path: Path, lines: list[dict[str, Any]], engine: Engine, **options: Any
) -> tuple[Any, int]:
    """`submit --no-run`'s preview of a job, then a run of it against `engine`: (the
    preview, the tokens the engine then served)."""
    path = tmp_path / "j.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    opts: dict[str, Any] = {
        "backend": "vllm",
        "base_url": "http://engine.test/v1",
        "model": "m",
        **options,
    }
    report = batchrun.submit(path, job="j", home=tmp_path, run=False, **opts)
    assert report.preview is not None
    anyio.run(functools.partial(run, tmp_path, "j", None, engine, **options))
    return report.preview, engine.prompt_tokens + engine.completion_tokens


def test_the_previews_tokens_at_most_count_the_longer_retries_a_run_sends(
    tmp_path: Path,
) -> None:
    """`submit --no-run` says "would send 1 requests (~14 tokens at most)" for a line whose
    answer outgrows --max-tokens 10 under --on-truncate retry-longer; the run then sends 5
    requests and pays 275 tokens. "At most" is the README's word (and what a user sizes a
    --max-total-tokens by); the longer retries (and repairs) are left out."""
    engine = Engine(answer=100)
    preview, served = _preview_then_run(
        tmp_path,
        [{"prompt": "tell me a story"}],
        engine,
        max_tokens=10,
        on_truncate="retry-longer",
    )
    assert served <= preview.tokens, (
        f"the preview said {preview.said()!r}; the run sent {engine.requests} requests and "
        f"paid {served} tokens"
    )


def test_the_preview_counts_the_items_a_killed_run_left(tmp_path: Path) -> None:
    """A run killed with 3 of 5 items claimed: a second `submit --no-run` says "5 item(s)
    still to send" and then "would send 2 requests (~N tokens at most)": the claimed items,
    which the next run takes back and sends, are neither requests nor tokens in the
    preview, which understates what `resume` will cost."""
    path = tmp_path / "j.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(5)))
    opts: dict[str, Any] = {"backend": "sim", "model": "sim-1", "max_tokens": 64}
    first = batchrun.submit(path, job="j", home=tmp_path, run=False, **opts)
    assert first.preview is not None and first.preview.send == 5
    ledger = Ledger(Home.at(tmp_path, None).ledger_url)
    ledger.join("j", "killed", ttl=0.01)  # a worker that then died (kill -9): its lease runs out
    assert len(ledger.claim("j", "killed", 3, lease_ttl=0.01)) == 3
    ledger.close()
    time.sleep(0.05)
    said: list[str] = []
    again = batchrun.submit(path, job="j", home=tmp_path, run=False, on_message=said.append, **opts)
    assert again.preview is not None
    assert again.preview.send == 5 and again.preview.tokens == first.preview.tokens, said


async def run_to_the_budget(
    tmp_path: Path, engine: httpx.AsyncBaseTransport, settings: RunnerSettings
) -> tuple[RunStats, Ledger]:
    """Three lines at 2 in flight under --max-total-tokens 100: two of ~42 tokens each fit,
    the third does not, so the budget stops the run while the second may be on the wire."""
    lines = [{"prompt": "fast one"}, {"prompt": "slow one"}, {"prompt": "third one"}]
    home = Home.at(tmp_path, None)
    ledger = Ledger(home.ledger_url)
    spec = resolve(
        {
            "backend": "vllm",
            "base_url": "http://engine.test/v1",
            "model": "m",
            "concurrency": 2,
            "server_metrics": "off",
            "order": "input",
            "max_tokens": 40,
            "max_total_tokens": 100,
        }
    )
    path = tmp_path / "j.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    jobs.create_job(ledger, "j", path, spec)
    stats = await jobs.run_job(
        ledger, home, "j", spec, transport=engine, settings=settings, handle_signals=False
    )
    return stats, ledger
