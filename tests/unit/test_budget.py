"""Budgets: the job stops before a request would take it past --max-total-tokens or --max-cost,
nothing is sent past it, untouched items stay pending, and a resume with more continues."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import text

from batchrun import jobs
from batchrun.budget import Budget, BudgetReached, ShareSpent
from batchrun.config import resolve
from batchrun.errors import OptionError
from batchrun.jobs import Home
from batchrun.ledger import ItemResult, Ledger
from batchrun.run_state import RunnerSettings, RunStats
from batchrun.sim import SimModel, SimTransport
from tests.fakes import FakeTime


def test_a_budget_holds_estimates_in_flight_and_spends_what_was_used() -> None:
    budget = Budget(max_tokens=100)
    budget.admit(30, 20)
    budget.admit(30, 20)  # 100: exactly the limit
    with pytest.raises(BudgetReached, match="--max-total-tokens 100 reached"):
        budget.admit(1, 0)
    budget.settle(30, 20, (25, 5))  # it used less than its estimate
    assert budget.spent == 30
    with pytest.raises(BudgetReached, match="30 tokens spent, 50 in flight"):
        budget.admit(30, 10)  # 30 spent + 50 held + 40 > 100
    budget.admit(10, 10)  # 30 + 50 + 20 = 100


def test_workers_share_what_was_left_and_look_again_as_their_part_runs_down() -> None:
    """Two workers alive when it looked at 400 of 1,000 spent: this one's part is 300 more.
    Half of it spent since, it looks again before the next request (ShareSpent); once it has
    looked, it goes up to its part and no further, while the whole budget is not reached."""
    budget = Budget(max_tokens=1000)
    budget.saw_spent(400, 0, workers=2)  # part: 400 + 600 / 2 = 700
    budget.admit(100, 40)  # 540: 140 of its 300
    with pytest.raises(ShareSpent):
        budget.admit(10, 10)  # 560: more than half its part since it looked
    budget.admit(10, 10, looked=True)  # it looked (nothing new): 560, within 700
    budget.settle(100, 40, (100, 40))
    with pytest.raises(BudgetReached, match=r"this worker's part, 1 of 2 alive"):
        budget.admit(100, 60, looked=True)  # 720 > 700
    budget.saw_spent(500, 40, workers=1)  # the other left: its part is all that is left
    budget.admit(100, 60)  # 540 + 20 held + 160 = 720, a look due at 770
    with pytest.raises(BudgetReached, match=r"--max-total-tokens 1,000 reached: 540"):
        budget.admit(300, 0, looked=True)  # 1,020: past the whole budget, whatever the part


def test_a_cost_budget_prices_prompt_and_output_apart() -> None:
    budget = Budget(max_cost=1.0, price_in=2.0, price_out=8.0)  # per million tokens
    budget.admit(100_000, 50_000)  # 0.2 + 0.4
    with pytest.raises(BudgetReached, match="--max-cost 1 reached"):
        budget.admit(100_000, 50_000)  # would make 1.2
    budget.settle(100_000, 50_000, None)  # failed: nothing spent
    assert budget.cost(budget.spent_in, budget.spent_out) == 0.0
    budget.saw_spent(400_000, 0)  # another worker paid 0.8
    with pytest.raises(BudgetReached):
        budget.admit(100_000, 50_000)


async def run_job(
    tmp_path: Path, name: str, *, transport: Any = None, **options: Any
) -> tuple[RunStats, dict[str, int]]:
    home = Home.at(tmp_path, None)
    ledger = Ledger(home.ledger_url)
    spec = resolve({"backend": "sim", "concurrency": 4, "server_metrics": "off", **options})
    if ledger.get_job(name) is None:
        path = tmp_path / "in.jsonl"
        path.write_text("".join(json.dumps({"prompt": f"item {i}"}) + "\n" for i in range(40)))
        jobs.create_job(ledger, name, path, spec)
    fake = FakeTime()
    settings = RunnerSettings(sleep=fake.sleep, clock=fake.clock, drain_timeout=0.0)
    transport = transport or SimTransport(SimModel())
    stats = await jobs.run_job(
        ledger, home, name, spec, transport=transport, settings=settings, handle_signals=False
    )
    counts = ledger.counts(name)
    paid = ledger.paid_tokens(name)
    ledger.close()
    return stats, {**counts, "paid": sum(paid)}


@pytest.mark.anyio
async def test_the_job_stops_at_its_token_budget_and_resumes_with_more(tmp_path: Path) -> None:
    stats, seen = await run_job(tmp_path, "j", max_tokens=30, max_total_tokens=600)
    assert stats.aborted is not None and "--max-total-tokens 600 reached" in stats.aborted
    assert 0 < seen["done"] < 40 and seen["pending"] == 40 - seen["done"]
    assert seen["failed"] == 0 and seen["paid"] <= 600  # nothing sent past it
    assert stats.requests == seen["done"]  # the refused request was never sent
    stats, seen = await run_job(tmp_path, "j", max_tokens=30, max_total_tokens=100_000)
    assert stats.aborted is None and seen["done"] == 40


@pytest.mark.anyio
async def test_a_cost_budget_needs_prices(tmp_path: Path) -> None:
    with pytest.raises(OptionError, match="max_cost needs price_in and price_out"):
        await run_job(tmp_path, "j", max_cost=1.0)


class NoUsage(SimTransport):
    """The simulator with `usage` taken out of its (not streamed) answers."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await super().handle_async_request(request)
        body = json.loads(await response.aread())
        if isinstance(body, dict):
            body.pop("usage", None)
        return httpx.Response(response.status_code, json=body)


@pytest.mark.anyio
async def test_estimates_charged_where_no_usage_came_count_on_resume(tmp_path: Path) -> None:
    options: dict[str, Any] = {"stream": False, "max_tokens": 30, "max_total_tokens": 600}
    sent = []
    for _run in range(2):  # the same budget again: it was spent, nothing more is sent
        stats, seen = await run_job(tmp_path, "j", transport=NoUsage(SimModel()), **options)
        assert stats.aborted is not None and "--max-total-tokens 600" in stats.aborted
        sent.append(stats.requests)
    assert sent[0] > 0 and sent[1] == 0
    assert seen["paid"] > 0  # the estimates, kept


def test_tokens_of_answers_a_retry_set_aside_stay_paid(tmp_path: Path) -> None:
    home = Home.at(tmp_path, None)
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"prompt": "one"}) + "\n")
    ledger = Ledger(home.ledger_url)
    jobs.create_job(ledger, "j", path, resolve({"backend": "sim"}))
    for status, tokens in (("invalid", (10, 5)), ("done", (7, 3))):
        ledger.join("j", "w", ttl=60)
        (claimed,) = ledger.claim("j", "w", 1, lease_ttl=60)
        answer = ItemResult(
            claimed.line, status, 1, prompt_tokens=tokens[0], completion_tokens=tokens[1]
        )
        ledger.record("j", "w", [answer])
        ledger.release("j", "w")
        if status == "invalid":
            assert ledger.requeue("j") == 1
            assert ledger.paid_tokens("j") == (10, 5)  # set aside, still paid
    assert ledger.paid_tokens("j") == (17, 8)  # both answers were paid for
    assert ledger.item_stats("j")["prompt_tokens"] == 17
    (stored,) = ledger.iter_results("j")
    assert (stored.prompt_tokens, stored.completion_tokens) == (7, 3)  # the answer's own usage
    assert ledger.requeue("j", ("done",)) == 1
    with ledger.engine.begin() as conn:  # then answered by a copy (reuse, or a repeat's)
        conn.execute(text("UPDATE items SET status='done', prompt_tokens=1, reused_job='old'"))
    assert ledger.paid_tokens("j") == (17, 8)  # what it paid stays paid
