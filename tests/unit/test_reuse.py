"""Reuse across jobs and dedup within one: in the ledger (on SQLite and PostgreSQL), and end to
end through a run over the simulator, counting what reaches the server."""

from __future__ import annotations

import hashlib
import json
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import text

from batchrun import jobs
from batchrun.config import resolve
from batchrun.errors import OptionError, UsageError
from batchrun.inputs import InputItem
from batchrun.jobs import Home
from batchrun.ledger import ItemResult, Joining, Ledger, reuse
from batchrun.preview import preview
from batchrun.run_state import RunnerSettings, RunStats
from batchrun.sim import SimModel, SimTransport, prompt_tag
from batchrun.status_view import job_detail, render_detail
from tests.fakes import FakeTime

SPEC_A, SPEC_B = "a" * 64, "b" * 64


@pytest.fixture
def ledger(ledger_url: str) -> Iterator[Ledger]:
    opened = Ledger(ledger_url)
    yield opened
    opened.close()


def load(ledger: Ledger, name: str, requests: list[str]) -> None:
    """A job whose line n sends `requests[n - 1]` (its digest is the request's)."""
    lines = [
        InputItem(
            line=n,
            item_id=f"{name}-{n}",
            endpoint="chat",
            body=b"{}",
            digest=hashlib.sha256(text.encode()).hexdigest(),
            meta=None,
        )
        for n, text in enumerate(requests, start=1)
    ]
    spec: dict[str, Any] = {}
    ledger.create_job(
        name, input_path="in", input_digest=name, spec=spec, lines=lines, skip_invalid=False
    )


def answer_all(ledger: Ledger, name: str, spec: str, *, status: str = "done") -> list[int]:
    """Send nothing: claim every claimable item and record an answer naming its line."""
    worker = f"w{time.monotonic_ns()}"
    ledger.join(name, worker, ttl=60)
    claimed = ledger.claim(name, worker, 1000, lease_ttl=60)
    answers = [
        ItemResult(c.line, status, 1, output=f"{name}:{c.line}", prompt_tokens=3) for c in claimed
    ]
    ledger.record(name, worker, answers, answer_spec=spec)
    ledger.release(name, worker)
    return [c.line for c in claimed]


def outputs(ledger: Ledger, name: str) -> list[tuple[str, str | None, str | None]]:
    return [(i.status, i.output, i.reused_job) for i in ledger.iter_results(name)]


def test_an_earlier_jobs_answer_is_reused_only_under_the_same_options(ledger: Ledger) -> None:
    load(ledger, "night1", ["x", "y", "z"])
    answer_all(ledger, "night1", SPEC_A)
    load(ledger, "night2", ["y", "new", "x"])
    assert ledger.prepare_reuse("night2", SPEC_B, reuse_since=None) == (0, 0)  # other options
    assert ledger.prepare_reuse("night2", SPEC_A, reuse_since=None) == (0, 2)
    assert outputs(ledger, "night2") == [
        ("done", "night1:2", "night1"),
        ("pending", None, None),
        ("done", "night1:1", "night1"),
    ]
    reused = next(ledger.iter_results("night2"))
    assert (reused.reused_line, reused.prompt_tokens, reused.item_id) == (2, 3, "night2-1")
    assert answer_all(ledger, "night2", SPEC_A) == [2]  # only the new line is sent
    # a copy is not a source: night 3 reuses night 1's answer for x, night 2's for "new"
    load(ledger, "night3", ["x", "new"])
    assert ledger.prepare_reuse("night3", SPEC_A, reuse_since=None) == (0, 2)
    assert [i.reused_job for i in ledger.iter_results("night3")] == ["night1", "night2"]


def test_a_run_other_workers_would_refuse_copies_no_answer_into_their_job(
    ledger: Ledger,
) -> None:
    load(ledger, "last-week", ["x", "y"])
    answer_all(ledger, "last-week", SPEC_B)  # under the options of the run refused below
    load(ledger, "j", ["x", "y"])
    ledger.join("j", "running", ttl=60, spec={"schema": "v2"}, same=("schema",))
    refused = Joining({"schema": "v1"}, ("schema",), 60)
    with pytest.raises(OptionError):
        ledger.prepare_reuse("j", SPEC_B, reuse_since=None, joining=refused)
    assert ledger.counts("j")["pending"] == 2  # nothing copied under the refused options
    agreeing = Joining({"schema": "v2"}, ("schema",), 60)
    assert ledger.prepare_reuse("j", SPEC_A, reuse_since=None, joining=agreeing) == (0, 0)


def test_answers_older_than_the_age_limit_and_failures_are_not_reused(ledger: Ledger) -> None:
    load(ledger, "old", ["x"])
    answer_all(ledger, "old", SPEC_A)
    load(ledger, "bad", ["y"])
    answer_all(ledger, "bad", SPEC_A, status="failed")
    load(ledger, "new", ["x", "y"])
    assert ledger.prepare_reuse("new", SPEC_A, reuse_since=time.time() + 60) == (0, 0)
    assert ledger.prepare_reuse("new", SPEC_A, reuse_since=time.time() - 60) == (0, 1)
    assert [s for s, _o, _j in outputs(ledger, "new")] == ["done", "pending"]


def test_status_latencies_are_of_this_jobs_own_requests_not_of_answers_it_copied(
    ledger: Ledger,
) -> None:
    load(ledger, "night1", ["x", "y", "z"])
    worker = "w1"
    ledger.join("night1", worker, ttl=60)
    lines = [c.line for c in ledger.claim("night1", worker, 10, lease_ttl=60)]
    slow = [ItemResult(line, "done", 1, output="old", latency_ms=900.0) for line in lines]
    ledger.record("night1", worker, slow, answer_spec=SPEC_A)
    load(ledger, "night2", ["y", "new", "x", "new"])
    assert ledger.prepare_reuse("night2", SPEC_A, reuse_since=None) == (1, 2)
    ledger.join("night2", worker, ttl=60)
    [sent] = ledger.claim("night2", worker, 10, lease_ttl=60)
    fast = ItemResult(sent.line, "done", 1, output="new", latency_ms=10.0)
    ledger.record("night2", worker, [fast], answer_spec=SPEC_A)
    assert ledger.counts("night2")["done"] == 4
    # one request this night: the reused answers' 900 ms were last night's, and the repeated
    # line's answer is that one request's
    assert ledger.item_stats("night2")["latency_ms"] == {"p50": 10.0, "p95": 10.0, "p99": 10.0}


def test_repeated_lines_are_sent_once_and_each_keeps_its_own_id(ledger: Ledger) -> None:
    load(ledger, "j", ["x", "y", "x", "x", "z"])
    assert ledger.prepare_reuse("j", SPEC_A, reuse_since=None, earlier=False) == (2, 0)
    assert answer_all(ledger, "j", SPEC_A) == [1, 2, 5]  # lines 3 and 4 wait for line 1
    results = list(ledger.iter_results("j"))
    assert [(r.item_id, r.status, r.output) for r in results] == [
        ("j-1", "done", "j:1"),
        ("j-2", "done", "j:2"),
        ("j-3", "done", "j:1"),
        ("j-4", "done", "j:1"),
        ("j-5", "done", "j:5"),
    ]
    assert ledger.counts("j")["done"] == 5


def test_a_commit_counts_each_line_it_finished_by_status_repeats_and_all(ledger: Ledger) -> None:
    load(ledger, "j", ["x", "y", "x", "y", "z", "x"])
    ledger.prepare_reuse("j", SPEC_A, reuse_since=None, earlier=False)
    ledger.join("j", "w", ttl=60)
    assert [c.line for c in ledger.claim("j", "w", 10, lease_ttl=60)] == [1, 2, 5]
    ledger.join("j", "other", ttl=60)
    results = [
        ItemResult(1, "failed", 1, error="HTTP 500"),
        ItemResult(2, "done", 1, output="y"),
        ItemResult(5, "invalid", 1, output="z", error="no JSON"),
    ]
    recorded = ledger.record("j", "w", results, answer_spec=SPEC_A)
    assert recorded.by_status == {"failed": 3, "done": 2, "invalid": 1}
    # A late duplicate in a group is turned away by the guard: neither it nor its repeats
    # count again, and the rest of the group and their repeats do.
    load(ledger, "k", ["x", "y", "x", "y"])
    ledger.prepare_reuse("k", SPEC_A, reuse_since=None, earlier=False)
    ledger.join("k", "w", ttl=60)
    ledger.claim("k", "w", 10, lease_ttl=60)
    first = ItemResult(1, "failed", 1, error="HTTP 500")
    assert ledger.record("k", "w", [first], answer_spec=SPEC_A).by_status == {"failed": 2}
    group = [first, ItemResult(2, "done", 1, output="y")]
    assert ledger.record("k", "w", group, answer_spec=SPEC_A).by_status == {"done": 2}


def test_repeats_are_found_in_request_order_across_write_batches(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    # read in request order, written a few at a time: memory bounded, not a dict of every key
    monkeypatch.setattr(reuse, "WRITE_BATCH", 3)
    requests = [f"r{n % 7}" if n % 2 else f"once {n}" for n in range(1, 41)]
    load(ledger, "j", requests)
    firsts = {text: n for n, text in reversed(list(enumerate(requests, start=1)))}
    repeats = len(requests) - len(firsts)
    none = lambda body: (1, 1)  # noqa: E731
    assert ledger.preview("j", SPEC_A, reuse_since=None, estimate=none) == (
        len(firsts),
        repeats,
        0,
        (len(firsts), len(firsts)),
    )
    assert ledger.prepare_reuse("j", SPEC_A, reuse_since=None, earlier=False) == (repeats, 0)
    assert answer_all(ledger, "j", SPEC_A) == sorted(firsts.values())
    outputs = [r.output for r in ledger.iter_results("j")]
    assert outputs == [f"j:{firsts[text]}" for text in requests]


def test_marking_a_file_of_repeats_keeps_memory_flat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # every repeat's (line, leader) was kept until the end: memory grew with the repeats
    monkeypatch.setattr(reuse, "WRITE_BATCH", 100)
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    load(ledger, "distinct", [f"q {n}" for n in range(30_000)])
    load(ledger, "repeats", ["the same question"] * 30_000)

    def marking(name: str) -> tuple[int, int]:
        tracemalloc.start()
        try:
            waiting, _ = ledger.prepare_reuse(name, SPEC_A, reuse_since=None, earlier=False)
            return waiting, tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    (none, distinct), (waiting, repeats) = marking("distinct"), marking("repeats")
    ledger.close()
    assert none == 0 and waiting == 29_999
    assert repeats < distinct + 1_000_000, (distinct, repeats)  # bytes at the peak


def test_a_late_result_turned_away_by_the_lease_answers_no_duplicate(ledger: Ledger) -> None:
    load(ledger, "j", ["x", "x"])
    ledger.prepare_reuse("j", SPEC_A, reuse_since=None, earlier=False)
    ledger.join("j", "gone", ttl=60)
    ledger.claim("j", "gone", 10, lease_ttl=60)
    ledger.release("j", "gone")  # its lease is over: line 1 is pending again
    late = ItemResult(1, "done", 1, output="late")
    assert ledger.record("j", "gone", [late], answer_spec=SPEC_A).finished == 0
    assert ledger.counts("j")["pending"] == 2  # the duplicate still waits
    answer_all(ledger, "j", SPEC_A)
    assert [o for _s, o, _j in outputs(ledger, "j")] == ["j:1", "j:1"]


# --- end to end: a run over the simulator --------------------------------------------------


class Counting(httpx.AsyncBaseTransport):
    """The simulator, counting the completions asked of it."""

    def __init__(self) -> None:
        self.sim = SimTransport(SimModel())
        self.sent = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.sent += request.method == "POST"
        return await self.sim.handle_async_request(request)


async def night(
    tmp_path: Path, name: str, prompts: list[str], **options: Any
) -> tuple[int, RunStats, list[dict[str, Any]]]:
    """Load and run a job in the same home; (requests sent, stats, results file lines)."""
    home = Home.at(tmp_path, None)
    ledger = Ledger(home.ledger_url)
    path = tmp_path / f"{name}.jsonl"
    path.write_text(
        "".join(
            json.dumps({"id": f"p{i}", "prompt": p, "meta": i}) + "\n"
            for i, p in enumerate(prompts)
        )
    )
    spec = resolve({"backend": "sim", "concurrency": 4, "server_metrics": "off", **options})
    jobs.create_job(ledger, name, path, spec)
    counting, fake = Counting(), FakeTime()
    settings = RunnerSettings(sleep=fake.sleep, clock=fake.clock, drain_timeout=0.0)
    stats = await jobs.run_job(
        ledger, home, name, spec, transport=counting, settings=settings, handle_signals=False
    )
    jobs.finish(ledger, home, name, spec)
    lines = (home.root / "outputs" / f"{name}.jsonl").read_text().splitlines()
    ledger.close()
    return counting.sent, stats, [json.loads(line) for line in lines]


@pytest.mark.anyio
async def test_a_second_night_sends_only_what_changed(tmp_path: Path) -> None:
    first = [f"rewrite product {i}" for i in range(20)]
    sent, _stats, _out = await night(tmp_path, "n1", first, temperature=0.7)
    assert sent == 20
    second = [*first[:15], "rewrite product 99", "rewrite product 3", *first[15:]]
    sent, stats, out = await night(tmp_path, "n2", second, temperature=0.7)
    assert sent == 1  # only the new line: the repeated "product 3" is yesterday's answer
    assert (stats.reused, stats.requests) == (21, 1)
    assert [o["id"] for o in out] == [f"p{i}" for i in range(22)]
    assert [o["meta"] for o in out] == [{"meta": i} for i in range(22)]  # each its own
    for record, prompt in zip(out, second, strict=True):
        assert record["output"].startswith(prompt_tag(prompt))
    assert out[0]["reused_from"] == {"job": "n1", "line": 1}
    assert "reused_from" not in out[15]
    home = Home.at(tmp_path, None)
    ledger = Ledger(home.ledger_url)
    job = ledger.get_job("n2")
    assert job is not None
    shown = render_detail(job_detail(ledger, job))
    assert "21 answers from earlier jobs" in shown
    paid = ledger.item_stats("n2")
    assert paid["reused"] == 21 and 0 < paid["completion_tokens"] < 100  # one answer's worth
    ledger.close()


@pytest.mark.anyio
@pytest.mark.parametrize(
    "change",
    [{"temperature": 0.2}, {"model": "sim-2"}, {"max_tokens": 9}, {"schema": "other"}],
    ids=["temperature", "model", "max_tokens", "schema"],
)
async def test_anything_that_changes_an_answer_is_sent_again(
    tmp_path: Path, change: dict[str, Any]
) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object"}')
    base: dict[str, Any] = {"temperature": 0.7, "schema": str(schema), "model": "sim-1"}
    prompts = [f"extract {i}" for i in range(6)]
    await night(tmp_path, "n1", prompts, **base)
    if change.get("schema"):  # the same path, other content
        schema.write_text('{"type": "object", "required": ["name"]}')
        change = {}
    sent, stats, _out = await night(tmp_path, "n2", prompts, **{**base, **change})
    assert sent >= 6 and stats.reused == 0  # (an invalid answer may take a repair request too)


@pytest.mark.anyio
async def test_simulated_answers_are_never_reused_for_a_real_server(tmp_path: Path) -> None:
    prompts = [f"extract {i}" for i in range(4)]
    await night(tmp_path, "dry-run", prompts, model="m")  # --backend sim, the same model name
    real = {"model": "m", "backend": "custom", "base_url": "http://127.0.0.1:9/v1"}
    sent, stats, _out = await night(tmp_path, "n1", prompts, **real)
    assert (sent, stats.reused) == (4, 0)
    sent, stats, _out = await night(tmp_path, "n2", prompts, **real)
    assert (sent, stats.reused) == (0, 4)  # a real server's answers are reused as before


@pytest.mark.anyio
async def test_no_reuse_sends_every_line_even_repeated_ones(tmp_path: Path) -> None:
    prompts = ["same"] * 4 + ["other"]
    sent, stats, out = await night(tmp_path, "n1", prompts)
    assert (sent, stats.duplicates) == (2, 3)  # repeated lines answered once
    assert len({o["output"] for o in out[:4]}) == 1
    sent, stats, _out = await night(tmp_path, "n2", prompts, reuse=False)
    assert (sent, stats.reused, stats.duplicates) == (5, 0, 0)


def test_the_age_limit_is_read_with_its_unit() -> None:
    from batchrun.reuse import seconds

    assert seconds("7d", key="reuse_max_age") == 7 * 86400
    assert seconds("90", key="reuse_max_age") == 90
    assert seconds("1.5h", key="reuse_max_age") == 5400
    with pytest.raises(OptionError, match="reuse_max_age must be a number"):
        seconds("a week", key="reuse_max_age")


@pytest.mark.anyio
async def test_a_dry_run_says_what_would_be_sent_and_reused(tmp_path: Path) -> None:
    await night(tmp_path, "n1", ["a", "b"], model="sim-1", max_tokens=10)
    home = Home.at(tmp_path, None)
    ledger = Ledger(home.ledger_url)
    path = tmp_path / "n2.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["a", "c", "c", "d"]))
    options = {"backend": "sim", "model": "sim-1", "max_tokens": 10, "price_out": 2.0}
    spec = resolve(options)
    jobs.create_job(ledger, "n2", path, spec)
    ahead = preview(ledger, "n2", spec)
    assert (ahead.send, ahead.reused, ahead.repeated) == (2, 1, 1)
    assert ahead.tokens == 2 * (1 + 10)  # a one-token prompt and max_tokens each, at most
    assert ahead.cost == pytest.approx(2 * 10 * 2.0 / 1e6)
    assert "would send 2 requests" in ahead.said()
    assert ledger.counts("n2")["pending"] == 4  # nothing changed
    nothing = preview(ledger, "n2", resolve({**options, "reuse": False}))
    assert (nothing.send, nothing.reused, nothing.repeated) == (4, 0, 0)
    ledger.close()


# --- retention -------------------------------------------------------------------------------


def age_jobs(ledger: Ledger) -> None:
    with ledger.engine.begin() as conn:
        conn.execute(text("UPDATE jobs SET updated_at = 0"))


def test_gc_keeps_what_reuse_needs_and_never_touches_a_running_job(ledger: Ledger) -> None:
    load(ledger, "old", ["x", "y", "z"])
    ledger.join("old", "w0", ttl=60)
    ledger.claim("old", "w0", 2, lease_ttl=60)
    ledger.record("old", "w0", [ItemResult(1, "done", 1, output="X")], answer_spec=SPEC_A)
    ledger.record("old", "w0", [ItemResult(2, "failed", 1, error="e")], answer_spec=SPEC_A)
    ledger.release("old", "w0")
    load(ledger, "busy", ["x"])
    ledger.join("busy", "alive", ttl=60)  # this process: a live worker
    age_jobs(ledger)
    done = ledger.collect(before=time.time(), everything=False, ttl=60)
    assert (done.jobs, done.running, done.kept, done.removed) == (["old"], ["busy"], 1, 2)
    assert ledger.counts("busy")["pending"] == 1
    kept = list(ledger.iter_results("old"))
    assert [(i.line, i.output) for i in kept] == [(1, "X")]
    load(ledger, "new", ["x"])  # what was kept is still reused
    assert ledger.prepare_reuse("new", SPEC_A, reuse_since=None) == (0, 1)
    ledger.release("busy", "alive")
    age_jobs(ledger)
    everything = ledger.collect(before=time.time(), everything=True, ttl=60)
    assert sorted(everything.jobs) == ["busy", "new", "old"]
    assert ledger.list_jobs() == []


def test_gc_from_the_api_removes_results_files_and_logs(tmp_path: Path) -> None:
    import batchrun

    report = batchrun.submit(
        [{"prompt": "a"}], job="tiny", home=tmp_path, backend="sim", server_metrics="off"
    )
    assert report.output is not None and report.output.exists()
    assert batchrun.gc("30d", home=tmp_path).jobs == []  # too recent
    ledger = Ledger(Home.at(tmp_path, None).ledger_url)
    age_jobs(ledger)
    ledger.close()
    done = batchrun.gc("30d", home=tmp_path)
    assert done.jobs == ["tiny"] and done.kept == 1
    assert not report.output.exists() and not (tmp_path / "logs" / "tiny.log").exists()
    with pytest.raises(OptionError, match="older_than must be a number"):
        batchrun.gc("a month", home=tmp_path)


def test_a_job_gc_collected_is_never_run_or_exported_as_if_whole(tmp_path: Path) -> None:
    import batchrun

    path = tmp_path / "weekly.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"line {i}"}) + "\n" for i in range(8)))
    options: dict[str, Any] = {"home": tmp_path, "backend": "sim", "server_metrics": "off"}
    budget = {"max_tokens": 20, "max_total_tokens": 100}  # stops it with lines left pending
    with pytest.raises(batchrun.JobAborted, match="--max-total-tokens 100 reached") as stop:
        batchrun.submit(path, job="weekly", concurrency=1, **options, **budget)
    report = stop.value.report
    assert 0 < report.counts["done"] < 8
    ledger = Ledger(Home.at(tmp_path, None).ledger_url)
    age_jobs(ledger)
    ledger.close()
    assert batchrun.gc("30d", home=tmp_path).jobs == ["weekly"]
    assert batchrun.status("weekly", home=tmp_path)["state"].startswith("collected by gc")
    for again in (
        lambda: batchrun.submit(path, job="weekly", **options),
        lambda: batchrun.resume("weekly", home=tmp_path),
        lambda: batchrun.export("weekly", home=tmp_path),
    ):
        with pytest.raises(UsageError, match="collected by `gc`"):
            again()
    fresh = batchrun.submit(path, job="weekly-2", max_tokens=20, **options)
    assert fresh.counts["done"] == 8 and fresh.stats.reused == report.counts["done"]
    whole = batchrun.submit([{"prompt": "other"}], job="whole", **options)
    assert whole.counts["done"] == 1
    ledger = Ledger(Home.at(tmp_path, None).ledger_url)
    age_jobs(ledger)  # a job whose every line its own request answered: all of it kept
    ledger.close()
    assert "whole" in batchrun.gc("30d", home=tmp_path).jobs
    assert "whole" not in batchrun.gc("30d", home=tmp_path).jobs  # collected once
    assert batchrun.status("whole", home=tmp_path)["state"].startswith("collected by gc")
    with pytest.raises(UsageError, match="collected by `gc`"):
        batchrun.export("whole", home=tmp_path)


def test_a_line_left_waiting_for_a_leader_already_answered_is_answered_at_the_end(
    ledger: Ledger,
) -> None:
    load(ledger, "j", ["x", "y", "x"])
    assert ledger.prepare_reuse("j", SPEC_A, reuse_since=None, earlier=False) == (1, 0)
    # What a race on PostgreSQL leaves: line 1 recorded by a worker whose fan-out did not yet
    # see line 3 waiting for it (another run's mark, committed after that record).
    with ledger.engine.begin() as conn:
        conn.execute(text("UPDATE items SET status='done', output='x!' WHERE job='j' AND line=1"))
    assert answer_all(ledger, "j", SPEC_A) == [2]  # line 3 is not claimed: it waits
    assert ledger.more_may_come("j", "w") is True  # answered now, from line 1
    assert outputs(ledger, "j")[2] == ("done", "x!", None)
    assert ledger.more_may_come("j", "w") is False  # so the job ends


def test_postgresql_knows_a_loaded_jobs_size_before_reuse_plans_on_it(
    postgres_server: str,
) -> None:
    from tests.postgres import fresh_database

    with fresh_database(postgres_server) as url:
        ledger = Ledger(url)
        load(ledger, "big", [f"prompt {i}" for i in range(3000)])
        with ledger.engine.connect() as conn:
            rows = conn.execute(text("SELECT reltuples FROM pg_class WHERE relname = 'items'"))
            estimated = rows.scalar()
        ledger.close()
    # The planner's estimate, not a count: before the load was analysed it took the table for
    # empty, and joined a job's items by nested loops (minutes for 20,000 lines).
    assert estimated is not None and estimated >= 3000


def test_a_line_waiting_for_a_line_at_a_hosted_batch_does_not_hold_an_online_run(
    ledger: Ledger,
) -> None:
    load(ledger, "j", ["x", "y", "x"])
    ledger.prepare_reuse("j", SPEC_A, reuse_since=None, earlier=False)
    with ledger.engine.begin() as conn:  # line 1 went out in a batch that is still running
        conn.execute(text("UPDATE items SET status='batched', chunk=1 WHERE job='j' AND line=1"))
    assert answer_all(ledger, "j", SPEC_A) == [2]
    assert ledger.more_may_come("j", "w") is False  # the batch's collection answers line 3
    assert outputs(ledger, "j")[2] == ("pending", None, None)
