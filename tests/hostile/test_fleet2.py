"""Several endpoints in one job and prefix-aware order, attacked again (fleet2 review): each
test fails on the code it was written against, and names the defect it shows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from batchrun import jobs
from batchrun.config import resolve
from batchrun.jobs import Home
from batchrun.ledger import Ledger
from batchrun.run_state import RunnerSettings, RunStats
from batchrun.sim import SimConfig
from tests.fakes import FakeTime
from tests.unit.test_fleet import Hosts, SlowSim


async def night(
    tmp_path: Path,
    name: str,
    transport: httpx.AsyncBaseTransport,
    rows: list[dict[str, Any]],
    *,
    real_clock: bool = False,
    fake: FakeTime | None = None,
    **options: Any,
) -> tuple[Ledger, RunStats]:
    """One job `name` of `rows` in the ledger under tmp_path (several share it), run to its end."""
    home = Home.at(tmp_path, None)
    ledger = Ledger(home.ledger_url)
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = resolve({"concurrency": 4, "max_attempts": 1, **options})
    jobs.create_job(ledger, name, path, spec)
    if real_clock:
        settings = RunnerSettings(drain_timeout=0.0)
    else:
        fake = fake or FakeTime()
        settings = RunnerSettings(sleep=fake.sleep, clock=fake.clock, drain_timeout=0.0)
    with anyio.fail_after(20):  # a hang fails the test
        stats = await jobs.run_job(
            ledger, home, name, spec, transport=transport, settings=settings, handle_signals=False
        )
    jobs.finish(ledger, home, name, spec)
    return ledger, stats


ROWS = [{"id": f"r{i}", "prompt": f"summarise item {i}"} for i in range(20)]


@pytest.mark.anyio
async def test_a_second_night_reuses_answers_when_the_endpoints_serve_different_models(
    tmp_path: Path,
) -> None:
    # README's own fleet: a GPU server and a hosted fallback (weight=0) serving another
    # model. Night 1: `a` answers every line. Night 2, the same file: every line is sent and
    # paid for again (the real CLI with two `batchrun sim` servers: 40 of 40 sent again, the
    # simulator's /sim/stats "resent_after_success": 40). The run keys reuse on the job's
    # model (reuse.prepare(answer_spec(spec))), None when the endpoints' models differ, while
    # each answer is recorded under its endpoint's (Lane.answer_spec): they never match.
    hosts = Hosts({"a.test": SimConfig(), "b.test": SimConfig()})
    eps = ["a=http://a.test/v1,model=m-a", "b=http://b.test/v1,model=m-b,weight=0"]
    _, first = await night(tmp_path, "night1", hosts, ROWS, endpoints=eps)
    assert hosts.posts["a.test"] == 20
    assert first.aborted is None
    sent = sum(hosts.posts.values())
    ledger, second = await night(tmp_path, "night2", hosts, ROWS, endpoints=eps)
    assert ledger.counts("night2")["done"] == 20
    again = sum(hosts.posts.values()) - sent
    assert second.reused == 20 and again == 0, (second.reused, again)  # before: (0, 20)


@pytest.mark.anyio
async def test_an_endpoint_paced_by_its_rpm_does_not_hold_a_line_the_other_is_free_to_send(
    tmp_path: Path,
) -> None:
    # `a` may take 2 requests a minute (a hosted fallback's quota, `rpm=2`); `b` answers at
    # once. A line goes to whichever endpoint has a free slot, and a slot on `a` whose request
    # must wait 30 s for `a`'s pacer counts as free: the second line sent to `a` sits there for
    # 30 s while `b` is idle. On the real clock this 20-line job, which `b` alone answers in
    # 0.05 s, takes 30 s (10 s with rpm=6, 60 s with rpm=1): the job waits on the slowest quota.
    fake = FakeTime()
    hosts = Hosts({"a.test": SimConfig(), "b.test": SimConfig()})
    eps = ["a=http://a.test/v1,rpm=2", "b=http://b.test/v1"]
    ledger, _ = await night(tmp_path, "j", hosts, ROWS, endpoints=eps, model="m", fake=fake)
    assert ledger.counts("j")["done"] == 20
    # before: [30.0] -- a line slept 30 s for a's quota (hosts.posts: a 2, b 18)
    assert [s for s in fake.sleeps if s >= 1] == [], (fake.sleeps, dict(hosts.posts))


@pytest.mark.anyio
async def test_no_run_preview_counts_the_answers_a_run_over_the_same_endpoints_reuses(
    tmp_path: Path,
) -> None:
    # Both endpoints name their model (model=m in each `--endpoint`), no `--model`. Night 2's
    # `submit --no-run` says "would send 20 requests; 0 answered by earlier jobs (no --model:
    # ...)", while running it sends nothing: all 20 are reused. preview() keys reuse on the
    # job's spec, whose model is None with several endpoints; the run keys it on the model
    # the endpoints agree on.
    from batchrun.preview import preview

    hosts = Hosts({"a.test": SimConfig(), "b.test": SimConfig()})
    eps = ["a=http://a.test/v1,model=m", "b=http://b.test/v1,model=m"]
    await night(tmp_path, "night1", hosts, ROWS, endpoints=eps)
    home = Home.at(tmp_path, None)
    ledger = Ledger(home.ledger_url)
    (tmp_path / "night2.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    spec = resolve({"concurrency": 4, "endpoints": eps})
    jobs.create_job(ledger, "night2", tmp_path / "night2.jsonl", spec)
    ahead = preview(ledger, "night2", spec)
    sent = sum(hosts.posts.values())
    with anyio.fail_after(20):
        stats = await jobs.run_job(
            ledger,
            home,
            "night2",
            spec,
            transport=hosts,
            settings=RunnerSettings(drain_timeout=0.0),
            handle_signals=False,
        )
    assert stats.reused == 20 and sum(hosts.posts.values()) == sent  # the run: all reused
    assert (ahead.reused, ahead.send) == (20, 0), ahead.said()  # before: (0, 20)


class DeadAtB(Hosts):
    """`b.test` refuses every connection (GET /models too) until `back_at` on the fake clock
    (never, by default); POSTs to `a.test` are stamped with the fake clock's time."""

    def __init__(
        self, hosts: dict[str, SimConfig], fake: FakeTime, back_at: float = float("inf")
    ) -> None:
        super().__init__(hosts)
        self.fake = fake
        self.back_at = back_at
        self.a_posts_at: list[float] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.host == "b.test" and self.fake.now < self.back_at:
            raise httpx.ConnectError("connection refused", request=request)
        if request.method == "POST":
            self.a_posts_at.append(self.fake.now)
        return await super().handle_async_request(request)


@pytest.mark.anyio
@pytest.mark.parametrize("model", [None, "m"])
async def test_an_endpoint_dead_at_the_start_does_not_hold_the_healthy_one_back(
    tmp_path: Path, model: str | None
) -> None:
    # No --model: each endpoint is asked its model first. `b` refuses connections; it was
    # asked again and again for the whole --outage-timeout (60 s by default) before it was
    # left out, and `a`, which answered at once, was sent nothing meanwhile: a job over a
    # fleet with one dead member idled a minute before its first request. Now `b` waits for
    # its model in the run, as a lane that is down, while `a` works; with a model given,
    # nothing is asked at the start, and a dead endpoint is drained and probed.
    fake = FakeTime()
    hosts = DeadAtB({"a.test": SimConfig(), "b.test": SimConfig()}, fake)
    started = fake.now
    ledger, stats = await night(
        tmp_path,
        "j",
        hosts,
        ROWS,
        endpoints=["a=http://a.test/v1", "b=http://b.test/v1"],
        model=model,
        fake=fake,
    )
    assert ledger.counts("j")["done"] == 20
    assert {u.name: u.state for u in stats.endpoints}["b"] in ("out", "down")
    first = hosts.a_posts_at[0] - started
    assert first < 5, f"a's first request went {first:.0f} s (fake clock) into the run"


@pytest.mark.anyio
@pytest.mark.parametrize("a_is", ["", ",weight=0"])  # `a` a paid fallback, `b` the GPU server
async def test_an_endpoint_whose_model_was_not_known_at_the_start_joins_when_it_answers(
    tmp_path: Path, a_is: str
) -> None:
    # No --model, and `b` is away as the job starts, for 70 s: it was left out for the whole
    # run (after the minute above), so a GPU server back from a reboot five minutes into a
    # night was sent nothing, and its share went to the others (a paid fallback, say) until
    # the end. Now it is asked its model again, 1 s after and then twice as long each time up
    # to 30 s, and once it names one it is sent lines under that model, which results name.
    fake = FakeTime()
    b_sim = SimConfig(models=("b-model",))
    hosts = DeadAtB({"a.test": SimConfig(), "b.test": b_sim}, fake, back_at=fake.now + 70)
    hosts.sims["a.test"] = SlowSim(fake, SimConfig(models=("a-model",)), seconds=2.0)
    rows = [{"id": f"r{i}", "prompt": f"summarise item {i}"} for i in range(400)]
    eps = [f"a=http://a.test/v1{a_is}", "b=http://b.test/v1"]
    ledger, stats = await night(tmp_path, "j", hosts, rows, endpoints=eps, fake=fake)
    assert ledger.counts("j")["done"] == 400
    uses = {u.name: u for u in stats.endpoints}
    assert uses["b"].state == "up" and uses["b"].answered > 50, uses
    results = Home.at(tmp_path, None).output_path("j")
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    models = {(line["answered_by"], line["model"]) for line in lines}
    assert models == {("a", "a-model"), ("b", "b-model")}, models


class BackWithout(DeadAtB):
    """`b.test`, back, answers GET /models with `status` (a key it refuses, say)."""

    status = 401

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        back = request.url.host == "b.test" and self.fake.now >= self.back_at
        if back and request.method == "GET":
            return httpx.Response(self.status, json={"error": {"message": "no"}})
        return await super().handle_async_request(request)


@pytest.mark.anyio
@pytest.mark.parametrize("status", [401, 404])
async def test_an_endpoint_away_at_the_start_that_then_refuses_to_name_its_model_is_out(
    tmp_path: Path, status: int
) -> None:
    """Once back, it answers the probe's question about its model with a 401 or 404: taken
    out, as a request's 401 would take it out; the line that probed it goes to `a`, free."""
    fake = FakeTime()
    hosts = BackWithout({"a.test": SimConfig(), "b.test": SimConfig()}, fake, fake.now + 3)
    hosts.status = status
    hosts.sims["a.test"] = SlowSim(fake, seconds=0.5)
    eps = ["a=http://a.test/v1", "b=http://b.test/v1"]
    ledger, stats = await night(tmp_path, "j", hosts, ROWS, endpoints=eps, fake=fake)
    assert ledger.counts("j")["done"] == 20  # one attempt each (max_attempts=1)
    b = {u.name: u for u in stats.endpoints}["b"]
    assert (b.state, b.answered, str(status) in b.reason) == ("out", 0, True), b
    assert hosts.posts["b.test"] == 0


@pytest.mark.anyio
@pytest.mark.parametrize("status", [520, 524, 529])
async def test_an_endpoint_answering_every_request_with_a_5xx_fails_no_line_another_answers(
    tmp_path: Path, status: int
) -> None:
    # README: an endpoint that answers "5xx on two items with no answer since" is drained,
    # and its failed requests go elsewhere at no attempt's cost. Only 500-504 count
    # (retrying.OUTAGE_STATUSES): behind Cloudflare a dead origin answers 520-524, an
    # overloaded gateway 529. Such an endpoint answers at once, so it is always the least
    # busy: it is picked again and again, each failure costs the line an attempt, and it is
    # never drained. Here 23 of 60 lines fail (max_attempts 2) that `a` answers at once.
    def broken(request: httpx.Request, n: int) -> httpx.Response:
        return httpx.Response(status, json={"error": {"message": f"origin error {status}"}})

    rows = [{"id": f"r{i}", "prompt": f"summarise item {i}"} for i in range(60)]
    hosts = Hosts({"a.test": SimConfig(), "b.test": SimConfig()}, {"b.test": broken})
    ledger, stats = await night(
        tmp_path,
        "j",
        hosts,
        rows,
        endpoints=["a=http://a.test/v1", "b=http://b.test/v1"],
        model="m",
        max_attempts=2,
    )
    counts = ledger.counts("j")
    assert stats.aborted is None
    assert (counts["done"], counts["failed"]) == (60, 0), (counts, dict(hosts.posts))


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["cut", "nonjson"])
async def test_an_endpoint_that_breaks_every_answer_is_drained_not_sent_most_lines(
    tmp_path: Path, kind: str
) -> None:
    # `b` cuts every answer after its first piece (or answers 200 with a body that is not
    # JSON): a broken proxy, an engine crashing on each request. Each line it breaks goes to
    # `a` at no attempt's cost, so the job ends well, but `b` is never drained: it answers
    # at once, stays the least busy and `up`, and is sent 48 of the 60 lines first (each
    # cut stream's tokens paid for on a hosted API). An endpoint refusing lines is drained
    # after 4 (REFUSALS_TO_DRAIN); one that breaks them never is.
    rows = [{"id": f"r{i}", "prompt": f"summarise item {i}"} for i in range(60)]
    hosts = Hosts({"a.test": SimConfig(), "b.test": SimConfig(faults={kind: 1.0})})
    ledger, stats = await night(
        tmp_path,
        "j",
        hosts,
        rows,
        endpoints=["a=http://a.test/v1", "b=http://b.test/v1"],
        model="m",
        max_attempts=2,
    )
    assert ledger.counts("j")["done"] == 60
    state = {u.name: u.state for u in stats.endpoints}
    # before: b.test 48 requests, b "up"; after: 15 (4 lines broken before it is drained,
    # what its slots held meanwhile, and its probes)
    assert hosts.posts["b.test"] <= 20 and state["b"] == "down", (dict(hosts.posts), state)


@pytest.mark.anyio
async def test_an_endpoint_added_at_resume_is_asked_its_own_model(tmp_path: Path) -> None:
    # Night run over `a` and `b`, no --model: both name `m`, so the run takes `m` as the
    # job's model, and stores it with the job as if `--model m` had been given. The odd
    # lines fail (both refuse them) and `retry` puts them back. `resume --endpoint a=...
    # --endpoint c=...`: `c` serves `m2`, and README says an endpoint's `model` "defaults to
    # `--model`, else to the first model the endpoint lists". `c` is sent `m` instead, answers
    # 404, and is taken out of the job for a model nobody asked for.
    def odd_refused(request: httpx.Request, n: int) -> httpx.Response | None:
        prompt = json.loads(request.content)["messages"][-1]["content"]
        if int(prompt.rsplit(" ", 1)[1]) % 2:
            return httpx.Response(400, json={"error": {"message": "not today"}})
        return None

    strict = {"a.test": SimConfig(models=("m",), strict_models=True)}
    hosts = Hosts(
        {
            **strict,
            "b.test": SimConfig(models=("m",)),
            "c.test": SimConfig(models=("m2",), strict_models=True),
        },
        {"a.test": odd_refused, "b.test": odd_refused},
    )
    ledger, _ = await night(
        tmp_path,
        "j",
        hosts,
        ROWS,
        endpoints=["a=http://a.test/v1", "b=http://b.test/v1"],
        max_attempts=1,
    )
    assert ledger.counts("j")["failed"] == 10
    assert ledger.requeue("j") == 10
    hosts.hooks.clear()
    job = ledger.get_job("j")
    spec = jobs.resolve_for_job(job, {"endpoints": ["a=http://a.test/v1", "c=http://c.test/v1"]})
    home = Home.at(tmp_path, None)
    fake = FakeTime()
    settings = RunnerSettings(sleep=fake.sleep, clock=fake.clock, drain_timeout=0.0)
    with anyio.fail_after(20):
        stats = await jobs.run_job(
            ledger, home, "j", spec, transport=hosts, settings=settings, handle_signals=False
        )
    uses = {u.name: (u.state, u.answered, u.reason[:60]) for u in stats.endpoints}
    assert ledger.counts("j")["done"] == 20
    # before: {'a': ('up', 10, ''), 'c': ('out', 0, '404 ... model m ...')}
    assert uses["c"][0] == "up" and uses["c"][1] > 0, uses


@pytest.mark.anyio
async def test_a_weight_0_fallback_does_not_make_a_short_rate_limit_fail_lines(
    tmp_path: Path,
) -> None:
    # `a` is over its rate limit for the first 2 s (429, Retry-After 1 s); `b` is a healthy
    # fallback (weight=0: sent to only while `a` is down or out, and a 429 is neither). Alone,
    # `a`'s lines wait out the Retry-After and are answered. With the fallback there, the
    # retry policy asks Fleet.resend_now, which says "another endpoint takes it now" (b is up
    # and not resting), so no Retry-After is waited: each line is sent to `a` 7 times at the
    # same instant (4 free, 3 charged), `b` is never picked (it has weight 0), and every line
    # fails. Adding a fallback turned a 2-second rate limit into failed lines.
    fake = FakeTime()
    at: list[float] = []

    def limited(request: httpx.Request, n: int) -> httpx.Response | None:
        at.append(fake.now)
        if fake.now - 1000 < 2:  # FakeTime starts at 1000
            return httpx.Response(
                429, headers={"retry-after": "1"}, json={"error": {"message": "rate limit"}}
            )
        return None

    rows = [{"id": f"r{i}", "prompt": f"summarise item {i}"} for i in range(3)]
    hosts = Hosts({"a.test": SimConfig(), "b.test": SimConfig()}, {"a.test": limited})
    # (the same job with `base_url="http://a.test/v1"` alone: 3 done, 0 failed)
    where = {"endpoints": ["a=http://a.test/v1", "b=http://b.test/v1,weight=0"]}
    ledger, _ = await night(
        tmp_path, "j", hosts, rows, model="m", max_attempts=3, fake=fake, **where
    )
    counts = ledger.counts("j")
    # before, with the fallback: done 0, failed 3, 21 requests to `a`, all at fake time 0
    assert (counts["done"], counts["failed"]) == (3, 0), (counts, dict(hosts.posts), at[:8])
