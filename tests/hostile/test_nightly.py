"""Nightly runs, attacked (reuse, dedup, budgets, retention, what the summary says): each test
failed on the code before its fix, and names the defect it showed."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from sqlalchemy import text

import batchrun
from batchrun import jobs
from batchrun.cli_report import summary_line
from batchrun.config import resolve
from batchrun.errors import OptionError
from batchrun.inputs import InputItem
from batchrun.jobs import Home
from batchrun.ledger import ItemResult, Ledger
from batchrun.report import JobReport
from batchrun.run_state import RunnerSettings, RunStats
from batchrun.sim import SimConfig, SimModel, SimTransport
from tests.fakes import FakeTime


class Counting(httpx.AsyncBaseTransport):
    """The simulator, counting the completions asked of it."""

    def __init__(self, model: SimModel | None = None) -> None:
        self.sim = SimTransport(model or SimModel())
        self.sent = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.sent += request.method == "POST"
        return await self.sim.handle_async_request(request)


async def run(
    tmp_path: Path,
    name: str,
    prompts: list[str] | None,
    *,
    transport: Counting | None = None,
    **options: Any,
) -> tuple[int, RunStats, dict[str, int], tuple[int, int]]:
    """Load (when `prompts`) and run a job; (requests sent, stats, counts, paid tokens)."""
    home = Home.at(tmp_path, None)
    ledger = Ledger(home.ledger_url)
    spec = resolve({"backend": "sim", "concurrency": 1, "server_metrics": "off", **options})
    if prompts is not None:
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        jobs.create_job(ledger, name, path, spec)
    counting, fake = transport or Counting(), FakeTime()
    settings = RunnerSettings(sleep=fake.sleep, clock=fake.clock, drain_timeout=0.0)
    stats = await jobs.run_job(
        ledger, home, name, spec, transport=counting, settings=settings, handle_signals=False
    )
    jobs.finish(ledger, home, name, spec)
    counts, paid = ledger.counts(name), ledger.paid_tokens(name)
    ledger.close()
    return counting.sent, stats, counts, paid


# --- budgets ---------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_budget_stop_mid_item_keeps_what_the_item_already_paid_for(
    tmp_path: Path,
) -> None:
    """One line, truncated at max_tokens 8, and --on-truncate retry-longer: the first request
    is admitted and answered (paid), the longer retry would pass the budget and is refused.
    The answer already received and its tokens must not vanish: README says what was spent
    is the job's paid usage, and that a resume with the same budget sends nothing more."""
    options: dict[str, Any] = {
        "max_tokens": 8,
        "on_truncate": "retry-longer",
        "max_total_tokens": 20,  # the first request (~2 + 8) fits; the retry (+ 16) does not
    }
    sent, stats, counts, paid = await run(tmp_path, "j", ["write a long story"], **options)
    assert counts["done"] == 1  # the answer stands (truncated: no schema, so done, "length")
    assert stats.aborted is not None and "--max-total-tokens 20 reached" in stats.aborted
    assert sent == 1  # one request was sent and answered, with usage
    assert sum(paid) > 0, f"the answered request's tokens are not counted: paid={paid}"
    again, _stats, _counts, _paid = await run(tmp_path, "j", None, **options)
    assert again == 0, "a resume with the same budget sent the same request again"


@pytest.mark.anyio
async def test_a_budget_stop_at_a_repair_keeps_the_answer_already_received(
    tmp_path: Path,
) -> None:
    """The same with a schema: the first answer is received (paid) and invalid, and its repair
    would pass the budget. The answer stands, judged as it is (`invalid`, as when a repair
    fails), with its tokens; the repair never sent is not counted, and the next night with the
    same budget sends nothing (before: the line went back to pending, its answer and tokens
    dropped, and every night paid for it again)."""
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "required": ["name"]}))
    model = SimModel(SimConfig(json_styles={"broken": 1.0}))  # first answers are broken JSON
    options: dict[str, Any] = {
        "schema": str(schema),
        "max_tokens": 40,
        "max_total_tokens": 80,  # the first request (~2 + 40) fits; its repair does not
    }
    sent, stats, counts, paid = await run(
        tmp_path, "j", ["extract the name"], transport=Counting(model), **options
    )
    assert stats.aborted is not None and sent == 1 and counts["invalid"] == 1
    assert sum(paid) > 0, f"an answered request's tokens are not counted: {paid}"
    assert stats.repairs == 0  # refused by the budget: never sent
    ledger = Ledger(Home.at(tmp_path, None).ledger_url)
    (item,) = ledger.iter_results("j")
    ledger.close()
    assert item.output and "--max-total-tokens 80 reached" in (item.error or "")
    again, _stats, _counts, _paid = await run(
        tmp_path, "j", None, transport=Counting(model), **options
    )
    assert again == 0


@pytest.mark.parametrize("budget", [{"max_total_tokens": 1000}, {"max_cost": 1.0}])
def test_a_budget_without_max_tokens_is_refused(budget: dict[str, Any]) -> None:
    """The estimate held against a budget is a request's prompt and its max_tokens: without
    one, an answer's length has no bound (the estimate assumed 256 output tokens, and a
    server that wrote 2,000 took a budget of 1,000 to 2,003 on its first request). So a budget
    without --max-tokens is refused before anything is sent; with it, it holds."""
    prices = {"price_in": 1.0, "price_out": 1.0} if "max_cost" in budget else {}
    with pytest.raises(OptionError, match="needs max_tokens"):
        resolve({"backend": "sim", **budget, **prices})
    assert resolve({"backend": "sim", **budget, **prices, "max_tokens": 64}).max_tokens == 64


# --- what the summary says -------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_batch_mode_night_says_how_many_answers_it_reused(tmp_path: Path) -> None:
    """README: "`status` and the summary count reused answers apart". In --mode batch the
    reuse pass runs (jobs._batches_first) but its count is thrown away: the run's stats, and
    so the summary line and JobReport.stats, say nothing was reused."""
    home = Home.at(tmp_path, None)
    ledger = Ledger(home.ledger_url)
    spec = resolve({"backend": "sim", "mode": "batch", "poll_interval": 0.02, "model": "sim-1"})
    model = SimModel(SimConfig(batch_seconds=0.05))
    for name, n in (("n1", 20), ("n2", 25)):  # night 2: the same 20 lines and 5 new ones
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"prompt": f"prompt {i}"}) + "\n" for i in range(n)))
        jobs.create_job(ledger, name, path, spec)
        stats = await jobs.run_job(
            ledger,
            home,
            name,
            spec,
            transport=SimTransport(model),
            settings=RunnerSettings(drain_timeout=0.0),
            handle_signals=False,
        )
    assert model.requests == 25  # the 20 unchanged lines were reused, not sent ...
    assert ledger.item_stats("n2")["reused"] == 20  # ... and status says so
    counts = ledger.counts("n2")
    ledger.close()
    said = summary_line(JobReport("n2", counts, True, None, stats=stats))
    assert stats.reused == 20, f"the run's stats say {stats.reused} reused; summary: {said}"


# --- retention and re-running the same command -----------------------------------------------


def test_the_same_nightly_api_call_still_runs_after_gc(tmp_path: Path) -> None:
    """A nightly pipeline calls batchrun.submit(rows, ...) with no job name: the job is named
    from the rows and options, so a night whose rows did not change finds last night's job
    ("nothing left to do") and touches nothing. `gc --older-than 30d` then takes that job for
    untouched and collects it, and from then on the very same call fails for ever with
    "collected by `gc` ... submit the file under another name (--job NAME)": a name the
    pipeline never chose, and its kept answers are never served to it."""
    rows = [{"prompt": f"describe product {i}"} for i in range(3)]
    options: dict[str, Any] = {"home": tmp_path, "backend": "sim", "server_metrics": "off"}
    first = batchrun.submit(rows, **options)  # night 1
    assert first.counts["done"] == 3
    ledger = Ledger(Home.at(tmp_path, None).ledger_url)
    with ledger.engine.begin() as conn:  # ... weeks go by
        conn.execute(text("UPDATE jobs SET updated_at = 0"))
    ledger.close()
    assert batchrun.submit(rows, **options).counts["done"] == 3  # a night: nothing to do
    assert batchrun.gc("30d", home=tmp_path).jobs == [first.job]  # taken for untouched
    again = batchrun.submit(rows, **options)  # the next night, the same call
    assert again.counts["done"] == 3


def test_gc_removes_the_rows_files_that_only_collected_jobs_read(tmp_path: Path) -> None:
    """A pipeline hands batchrun.submit new rows every night: each night's rows are written to
    HOME/inputs/rows-*.jsonl (so a resume reads them). `gc` collected the nights' jobs and
    left their files: a year of nightly rows kept on disk, read by no job that can run again.
    A file that a job left to run still reads (the same rows again after gc) stays."""
    options: dict[str, Any] = {"home": tmp_path, "backend": "sim", "server_metrics": "off"}
    nights = [[{"prompt": f"night {n} product {i}"} for i in range(3)] for n in range(2)]
    for rows in nights:
        assert batchrun.submit(rows, **options).counts["done"] == 3
    own = tmp_path / "mine.jsonl"  # a user's own file, in the same folder
    own.write_text(json.dumps({"prompt": "mine"}) + "\n")
    (tmp_path / "inputs" / "rows-mine.jsonl").write_bytes(own.read_bytes())  # no job's
    batchrun.submit(own, job="own", **options)
    ledger = Ledger(Home.at(tmp_path, None).ledger_url)
    with ledger.engine.begin() as conn:  # ... weeks go by
        conn.execute(text("UPDATE jobs SET updated_at = 0"))
    ledger.close()
    written = {p.name for p in (tmp_path / "inputs").glob("rows-*.jsonl")}
    assert len(written) == 3
    assert len(batchrun.gc("30d", home=tmp_path).jobs) == 3
    assert {p.name for p in (tmp_path / "inputs").glob("rows-*.jsonl")} == {"rows-mine.jsonl"}
    assert own.exists()  # never a user's own file
    again = batchrun.submit(nights[1], **options)  # the same rows again: a new job reads them
    assert again.counts["done"] == 3 and again.stats.reused == 3
    batchrun.gc("30d", home=tmp_path)  # the new job is recent: its file stays
    assert len(list((tmp_path / "inputs").glob("rows-*.jsonl"))) == 2
    assert batchrun.resume(again.job, home=tmp_path).counts["done"] == 3
    assert batchrun.gc("0s", everything=True, home=tmp_path).jobs  # --all: jobs deleted
    assert {p.name for p in (tmp_path / "inputs").glob("rows-*.jsonl")} == {"rows-mine.jsonl"}


# --- dedup -----------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_no_reuse_on_resume_sends_repeated_lines_too(tmp_path: Path) -> None:
    """README: `--no-reuse` sends everything, and turns dedup off too (a file that repeats a
    prompt to get several samples). A first run that stopped early (here its budget, before
    anything was sent) has marked the repeats as waiting (items.dup_of); a resume with
    --no-reuse still passes them over and copies the first line's answer to them."""
    prompts = ["sample a poem", "other", "sample a poem", "sample a poem"]
    sent, stats, counts, _paid = await run(tmp_path, "j", prompts, max_tokens=8, max_total_tokens=1)
    assert stats.aborted is not None and sent == 0 and counts["pending"] == 4
    sent, stats, counts, _paid = await run(tmp_path, "j", None, max_tokens=8, reuse=False)
    assert counts["done"] == 4
    assert sent == 4, f"--no-reuse sent {sent} requests for 4 lines"


# --- reuse: what a copy may pass for ---------------------------------------------------------


def _load(ledger: Ledger, name: str, requests: list[str]) -> None:
    """A job whose line n sends `requests[n - 1]` (its digest is the request's)."""
    lines = [
        InputItem(n, f"{name}-{n}", "chat", b"{}", hashlib.sha256(t.encode()).hexdigest(), None)
        for n, t in enumerate(requests, start=1)
    ]
    ledger.create_job(
        name, input_path="in", input_digest=name, spec={}, lines=lines, skip_invalid=False
    )


def test_a_copy_onto_a_line_that_once_failed_is_not_a_source_under_its_old_options(
    tmp_path: Path,
) -> None:
    """README: "Only answers that a request made are sources (a copy is not)". A line that
    failed under options B keeps answer_spec B through `retry` (Ledger.requeue does not clear
    it); a resume under options A then copies an earlier job's A answer onto it, and the copy
    (status done, answer_spec B) is now a source of B answers: night 3 under B is handed an
    answer made under A (another model, temperature, schema...)."""
    spec_a, spec_b = "a" * 64, "b" * 64
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    _load(ledger, "n1", ["x"])
    ledger.join("n1", "w1", ttl=60)
    ledger.claim("n1", "w1", 10, lease_ttl=60)
    ledger.record("n1", "w1", [ItemResult(1, "done", 1, output="made under A")], answer_spec=spec_a)
    ledger.release("n1", "w1")
    _load(ledger, "n2", ["x"])
    ledger.join("n2", "w2", ttl=60)
    ledger.claim("n2", "w2", 10, lease_ttl=60)  # night 2 runs under B: its request fails
    ledger.record("n2", "w2", [ItemResult(1, "failed", 1, error="HTTP 500")], answer_spec=spec_b)
    ledger.release("n2", "w2")
    assert ledger.requeue("n2") == 1  # `batchrun retry n2`, then resumed under A:
    assert ledger.prepare_reuse("n2", spec_a, reuse_since=None) == (0, 1)  # night 1's answer
    _load(ledger, "n3", ["x"])
    reused = ledger.prepare_reuse("n3", spec_b, reuse_since=None)  # night 3, under B again
    got = [(i.status, i.output, i.reused_job) for i in ledger.iter_results("n3")]
    ledger.close()
    assert reused == (0, 0), f"an answer made under A was handed out under B: {got}"


@pytest.mark.anyio
async def test_the_summary_does_not_call_repeated_lines_answered_when_none_was(
    tmp_path: Path,
) -> None:
    """The summary line says "N repeated lines answered once" from RunStats.duplicates, which
    is the number of lines marked as waiting before the run, whatever the run then did: a run
    stopped by its budget before anything was sent reports 2 repeated lines answered while all
    4 lines are pending."""
    prompts = ["a poem", "a poem", "a poem", "other"]
    sent, stats, counts, _paid = await run(tmp_path, "j", prompts, max_tokens=8, max_total_tokens=1)
    assert sent == 0 and counts["pending"] == 4 and counts["done"] == 0
    said = summary_line(JobReport("j", counts, False, None, stats=stats))
    assert "answered once" not in said, said


class Gated(httpx.AsyncBaseTransport):
    """The simulator, holding each completion until `gate` has seen `wait_for` of them: two
    workers have then each read what the job spent (nothing) before any answer came."""

    def __init__(self, sim: SimTransport, gate: dict[str, Any], wait_for: int) -> None:
        self.sim, self.gate, self.wait_for = sim, gate, wait_for

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and not self.gate["open"].is_set():
            self.gate["seen"] += 1
            if self.gate["seen"] >= self.wait_for:
                self.gate["open"].set()
            await self.gate["open"].wait()
        return await self.sim.handle_async_request(request)


@pytest.mark.anyio
async def test_two_workers_overrun_a_budget_by_no_more_than_they_hold_in_flight(
    tmp_path: Path,
) -> None:
    """Two workers at --concurrency 1 (one request in flight each, at most 1 + 30 tokens).
    Before, each read the ledger's spending only at its start and with each heartbeat (20 s;
    20 minutes here: lease 3600) and counted only its own answers between: within a heartbeat
    every worker could spend the whole budget, and the two paid 1,181 tokens of 600. Now each
    takes its part of what was left and looks again (its own answers committed first) each
    time half its part is spent: together they pass it by no more than they hold in flight."""
    home = Home.at(tmp_path, None)
    options = {"backend": "sim", "model": "sim-1", "concurrency": 1, "server_metrics": "off"}
    spec = resolve({**options, "max_tokens": 30, "max_total_tokens": 600})
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"item {i}"}) + "\n" for i in range(60)))
    setup = Ledger(home.ledger_url)
    jobs.create_job(setup, "j", path, spec)
    setup.close()
    gate: dict[str, Any] = {"open": anyio.Event(), "seen": 0}
    sim = SimTransport(SimModel())

    async def worker() -> None:
        ledger = Ledger(home.ledger_url)
        settings = RunnerSettings(lease_ttl=3600.0, drain_timeout=0.0)
        await jobs.run_job(
            ledger,
            home,
            "j",
            spec,
            transport=Gated(sim, gate, 2),
            settings=settings,
            handle_signals=False,
        )
        ledger.close()

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker)
        tg.start_soon(worker)
    ledger = Ledger(home.ledger_url)
    paid = sum(ledger.paid_tokens("j"))
    ledger.close()
    in_flight = 2 * (1 + 30)  # what two workers at concurrency 1 may hold at once
    assert paid <= 600 + in_flight, f"the job paid {paid} tokens of a budget of 600"


class Recording(httpx.AsyncBaseTransport):
    """The simulator, keeping the bodies of the completions asked of it, as sent."""

    def __init__(self) -> None:
        self.sim = SimTransport(SimModel())
        self.bodies: list[bytes] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            self.bodies.append(request.content)
        return await self.sim.handle_async_request(request)


@pytest.mark.anyio
async def test_a_lines_schema_goes_out_with_its_properties_in_the_order_written(
    tmp_path: Path,
) -> None:
    """Guided decoding (vLLM, SGLang, llama.cpp) generates an object's properties in the order
    its schema lists them: "reasoning" before "answer" is the usual way to have a model think
    before it answers. The line's body is stored with its keys sorted (inputs.py, orjson
    OPT_SORT_KEYS, for a stable digest) and sent as stored, so the server is told "answer"
    first: another request than the one written, and other answers."""
    schema = {
        "type": "object",
        "properties": {"reasoning": {"type": "string"}, "answer": {"type": "string"}},
        "required": ["reasoning", "answer"],
    }
    home = Home.at(tmp_path, None)
    ledger = Ledger(home.ledger_url)
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"prompt": "is 7 prime?", "schema": schema}) + "\n")
    spec = resolve({"backend": "sim", "concurrency": 1, "server_metrics": "off"})
    jobs.create_job(ledger, "j", path, spec)
    recording, fake = Recording(), FakeTime()
    settings = RunnerSettings(sleep=fake.sleep, clock=fake.clock, drain_timeout=0.0)
    await jobs.run_job(
        ledger, home, "j", spec, transport=recording, settings=settings, handle_signals=False
    )
    ledger.close()
    sent = json.loads(recording.bodies[0])  # json keeps the order of the bytes sent
    properties = sent["response_format"]["json_schema"]["schema"]["properties"]
    assert list(properties) == ["reasoning", "answer"], list(properties)


def test_a_requests_digest_keeps_its_properties_order_and_nothing_else() -> None:
    """Lines that differ only in the order of their keys are one request (dedup and reuse
    find each other), and a body with no schema keeps the digest it always had (sha256 of the
    body with its keys sorted: last night's answers still match). Lines whose schemas list
    their properties in another order are two requests: the answers written differ."""
    from batchrun.inputs import canonical_digest

    def schema(*names: str) -> dict[str, Any]:
        props = {n: {"type": "string"} for n in names}
        return {"type": "json_schema", "json_schema": {"schema": {"properties": props}}}

    plain = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    reordered = {"max_tokens": 8, "messages": [{"content": "hi", "role": "user"}]}
    old = hashlib.sha256(json.dumps(plain, sort_keys=True, separators=(",", ":")).encode())
    assert canonical_digest(plain) == canonical_digest(reordered) == old.hexdigest()
    first = {**plain, "response_format": schema("reasoning", "answer")}
    second = {**plain, "response_format": schema("answer", "reasoning")}
    assert canonical_digest(first) != canonical_digest(second)
    assert canonical_digest(second) == canonical_digest(dict(reversed(second.items())))
