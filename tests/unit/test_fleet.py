"""Several endpoints in one job: work shared, failover without spent attempts, an endpoint
taken out on 401, fallbacks, per-endpoint status; and prefix-group claim order."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import anyio
import httpx
import pytest
from anyio import wait_all_tasks_blocked

from batchrun import jobs
from batchrun.backends import Backend
from batchrun.cli_report import summary_line
from batchrun.config import resolve
from batchrun.endpoints import parse_endpoint, parse_endpoints
from batchrun.errors import AuthFailed, BadRequest, UsageError
from batchrun.fleet import Fleet
from batchrun.jobs import Home
from batchrun.lanes import Lane, Route
from batchrun.ledger import Ledger
from batchrun.prefixes import PREFIX_CHARS, Grouper, prefix_key
from batchrun.retrying import OutageWatch
from batchrun.routes import by_prefix, opened_routes
from batchrun.run_state import RunnerSettings, RunStats
from batchrun.sim import SimConfig, SimModel, SimTransport
from batchrun.status_view import job_detail, render_detail
from batchrun.throttle import Throttle
from tests.fakes import FakeTime
from tests.unit.test_runner import report

Hook = Callable[[httpx.Request, int], httpx.Response | None]


class Hosts(httpx.AsyncBaseTransport):
    """Each endpoint's host has its own simulator; `hooks[host](request, n)` may answer the
    host's n-th POST instead (a Response), or raise for it (a connection refused)."""

    def __init__(self, hosts: dict[str, SimConfig], hooks: dict[str, Hook] | None = None) -> None:
        self.sims = {host: SimTransport(SimModel(config)) for host, config in hosts.items()}
        self.hooks = hooks or {}
        self.posts: Counter[str] = Counter()
        self.sent: list[tuple[str, str]] = []  # (host, prompt) in the order requests came

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if request.method == "POST":
            self.posts[host] += 1
            body = json.loads(request.content)
            prompt = body["messages"][-1]["content"] if "messages" in body else body["prompt"]
            self.sent.append((host, prompt))
            hook = self.hooks.get(host)
            answer = hook(request, self.posts[host]) if hook else None
            if answer is not None:
                return answer
        return await self.sims[host].handle_async_request(request)


def refused(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


def endpoints(*names: str, extra: str = "") -> list[str]:
    return [f"{n}=http://{n}.test/v1{extra}" for n in names]


async def run(
    tmp_path: Path,
    transport: Hosts,
    *,
    n: int = 40,
    lines: list[dict[str, Any]] | None = None,
    fake: FakeTime | None = None,
    **options: Any,
) -> tuple[Ledger, RunStats]:
    home = Home.at(tmp_path, None)
    ledger = Ledger(home.ledger_url)
    rows = lines or [{"id": f"p{i}", "prompt": f"prompt number {i}"} for i in range(n)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = resolve({"concurrency": 4, "max_attempts": 1, "model": "sim-1", **options})
    jobs.create_job(ledger, "j", tmp_path / "in.jsonl", spec)
    fake = fake or FakeTime()
    settings = RunnerSettings(sleep=fake.sleep, clock=fake.clock, drain_timeout=0.0)
    stats = await jobs.run_job(
        ledger, home, "j", spec, transport=transport, settings=settings, handle_signals=False
    )
    jobs.finish(ledger, home, "j", spec)
    return ledger, stats


async def run_real(
    tmp_path: Path, transport: Hosts, rows: list[dict[str, Any]], **options: Any
) -> tuple[Ledger, RunStats]:
    """`run` on the real clock: probes come due, and the outage grace passes."""
    home = Home.at(tmp_path, None)
    ledger = Ledger(home.ledger_url)
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = resolve({"concurrency": 2, "max_attempts": 3, "model": "sim-1", **options})
    jobs.create_job(ledger, "j", tmp_path / "in.jsonl", spec)
    settings = RunnerSettings(drain_timeout=0.0)
    with anyio.fail_after(30):  # a hang fails the test
        stats = await jobs.run_job(
            ledger, home, "j", spec, transport=transport, settings=settings, handle_signals=False
        )
    return ledger, stats


def read_results(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def answered_by(ledger: Ledger) -> Counter[str | None]:
    return Counter(item.answered_by for item in ledger.iter_results("j"))


@pytest.mark.anyio
async def test_work_is_shared_and_each_result_names_its_endpoint(tmp_path: Path) -> None:
    hosts = Hosts({h: SimConfig() for h in ("a.test", "b.test", "c.test")})
    ledger, stats = await run(tmp_path, hosts, endpoints=endpoints("a", "b", "c"))
    assert ledger.counts("j")["done"] == 40
    by = answered_by(ledger)
    assert set(by) == {"a", "b", "c"} and sum(by.values()) == 40
    assert by == Counter({u.name: u.answered for u in stats.endpoints})
    records = list(read_results(tmp_path / "outputs" / "j.jsonl"))
    assert [r["id"] for r in records] == [f"p{i}" for i in range(40)]
    assert {r["answered_by"] for r in records} == {"a", "b", "c"}
    assert "endpoints: a " in summary_line(report(ledger.counts("j"), stats))


@pytest.mark.anyio
async def test_one_endpoint_given_by_name_is_named_in_its_results(tmp_path: Path) -> None:
    # A job of two endpoints resumed on one of them (`--endpoint a=URL`): its later lines had
    # no answered_by, the earlier ones had: one results file, two shapes.
    hosts = Hosts({"a.test": SimConfig()})
    ledger, _ = await run(tmp_path, hosts, endpoints=["a=http://a.test/v1"])
    assert answered_by(ledger) == Counter({"a": 40})


@pytest.mark.anyio
async def test_one_endpoint_has_no_name_in_its_results(tmp_path: Path) -> None:
    hosts = Hosts({"a.test": SimConfig()})
    ledger, _ = await run(tmp_path, hosts, base_url="http://a.test/v1")
    assert answered_by(ledger) == Counter({None: 40})
    records = list(read_results(tmp_path / "outputs" / "j.jsonl"))
    assert "answered_by" not in records[0]


@pytest.mark.anyio
async def test_an_endpoint_that_dies_hands_its_items_over_without_spending_attempts(
    tmp_path: Path,
) -> None:
    # max_attempts 1: a failure counted against any item would fail it
    def dies(request: httpx.Request, n: int) -> httpx.Response | None:
        return refused(request) if n > 5 else None

    hosts = Hosts({"a.test": SimConfig(), "b.test": SimConfig()}, {"b.test": dies})
    ledger, stats = await run(tmp_path, hosts, n=200, endpoints=endpoints("a", "b"))
    assert ledger.counts("j")["done"] == 200
    assert stats.aborted is None
    uses = {u.name: u for u in stats.endpoints}
    assert uses["b"].state == "down" and "refused" in uses["b"].reason
    assert uses["b"].answered == 5 and uses["a"].answered == 195
    assert hosts.posts["b.test"] > 5  # it failed, and was probed, and never cost an item


@pytest.mark.anyio
async def test_a_dead_endpoint_comes_back_after_a_probe(tmp_path: Path) -> None:
    fake = FakeTime()

    def outage(request: httpx.Request, n: int) -> httpx.Response | None:
        return refused(request) if n in (4, 5) else None  # two items: down, then a probe

    hosts = Hosts({"a.test": SimConfig(), "b.test": SimConfig()}, {"b.test": outage})
    # a slow `a` keeps the job going long enough for b's probe to come due
    hosts.sims["a.test"] = SlowSim(fake)
    ledger, stats = await run(tmp_path, hosts, n=400, fake=fake, endpoints=endpoints("a", "b"))
    assert ledger.counts("j")["done"] == 400
    log = (tmp_path / "logs" / "j.log").read_text()
    assert '"event":"endpoint_down"' in log and '"event":"endpoint_up"' in log
    uses = {u.name: u for u in stats.endpoints}
    assert uses["b"].state == "up" and uses["b"].answered > 3


class SlowSim(SimTransport):
    """A simulator whose every answer takes `seconds` of the fake clock."""

    def __init__(
        self, fake: FakeTime, config: SimConfig | None = None, *, seconds: float = 0.05
    ) -> None:
        super().__init__(SimModel(config or SimConfig()))
        self.fake = fake
        self.seconds = seconds

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            await self.fake.sleep(self.seconds)
        return await super().handle_async_request(request)


@pytest.mark.anyio
async def test_a_401_takes_one_endpoint_out_and_the_others_finish_the_job(
    tmp_path: Path,
) -> None:
    def unauthorized(request: httpx.Request, n: int) -> httpx.Response:
        return httpx.Response(401, json={"error": {"message": "invalid api key"}})

    hosts = Hosts({"a.test": SimConfig(), "b.test": SimConfig()}, {"b.test": unauthorized})
    ledger, stats = await run(tmp_path, hosts, endpoints=endpoints("a", "b"))
    assert ledger.counts("j")["done"] == 40 and stats.aborted is None
    uses = {u.name: u for u in stats.endpoints}
    assert uses["b"].state == "out" and "401" in uses["b"].reason
    assert hosts.posts["b.test"] == 1  # out after its first answer
    said = summary_line(report(ledger.counts("j"), stats))
    assert "b 0 answered (out: " in said
    log = (tmp_path / "logs" / "j.log").read_text()
    assert '"event":"endpoint_out"' in log


class NoModels(Hosts):
    """Hosts whose `b.test` refuses the key when asked its models, before any request."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET" and request.url.host == "b.test":
            return httpx.Response(401, json={"error": {"message": "invalid api key"}})
        return await super().handle_async_request(request)


@pytest.mark.anyio
async def test_an_endpoint_left_out_at_start_is_in_the_summary_with_its_reason(
    tmp_path: Path,
) -> None:
    hosts = NoModels({"a.test": SimConfig(), "b.test": SimConfig()})
    ledger, stats = await run(tmp_path, hosts, model=None, endpoints=endpoints("a", "b"))
    assert ledger.counts("j")["done"] == 40 and hosts.posts["b.test"] == 0
    uses = {u.name: u for u in stats.endpoints}
    assert uses["a"].answered == 40
    assert uses["b"].state == "out" and "401" in uses["b"].reason and uses["b"].answered == 0
    said = summary_line(report(ledger.counts("j"), stats))
    assert "endpoints: a 40 answered, b 0 answered (out: " in said
    job = ledger.get_job("j")
    assert job is not None
    text = render_detail(job_detail(ledger, job))  # `status` names it too
    assert "endpoint   a: up, 40 done" in text and "endpoint   b: out (" in text
    # the header named the first endpoint's URL and model=None, as if it were the job's one
    assert "endpoints  2, each below (chat)" in text and "model=None" not in text
    assert "401" in text
    assert answered_by(ledger) == Counter({"a": 40})  # a job of several names who answered


@pytest.mark.anyio
async def test_when_every_endpoint_refuses_the_key_the_job_stops_with_that_error(
    tmp_path: Path,
) -> None:
    def unauthorized(request: httpx.Request, n: int) -> httpx.Response:
        return httpx.Response(401, json={"error": {"message": "invalid api key"}})

    hooks = {"a.test": unauthorized, "b.test": unauthorized}
    hosts = Hosts({"a.test": SimConfig(), "b.test": SimConfig()}, hooks)
    ledger, stats = await run(tmp_path, hosts, endpoints=endpoints("a", "b"))
    assert stats.aborted is not None and "401" in stats.aborted
    assert ledger.counts("j")["pending"] == 40


@pytest.mark.anyio
async def test_the_job_stops_only_when_every_endpoint_is_down_past_the_grace(
    tmp_path: Path,
) -> None:
    def down(request: httpx.Request, n: int) -> httpx.Response:
        return refused(request)

    hosts = Hosts({"a.test": SimConfig(), "b.test": SimConfig()}, {"a.test": down, "b.test": down})
    home = Home.at(tmp_path, None)
    ledger = Ledger(home.ledger_url)
    (tmp_path / "in.jsonl").write_text("".join(f'{{"prompt": "p{i}"}}\n' for i in range(20)))
    spec = resolve(
        {
            "endpoints": endpoints("a", "b"),
            "model": "sim-1",
            "outage_timeout": 0.3,
            "concurrency": 2,
        }
    )
    jobs.create_job(ledger, "j", tmp_path / "in.jsonl", spec)
    settings = RunnerSettings(drain_timeout=0.0)  # real time: probes are timed by the clock
    stats = await jobs.run_job(ledger, home, "j", spec, transport=hosts, settings=settings)
    assert stats.aborted is not None and "every endpoint unreachable" in stats.aborted
    assert ledger.counts("j")["pending"] == 20  # nothing failed, nothing lost


def blip_errors_then_restart(fake: FakeTime, restart_s: float) -> Hook:
    """A server whose first request fails to connect, whose next ten get a 400 ten seconds
    apart, and which then restarts: it refuses connections for `restart_s`, then answers."""
    back_at: list[float] = []

    def hook(request: httpx.Request, n: int) -> httpx.Response | None:
        if n == 1:
            return refused(request)
        if n <= 11:
            fake.now += 10.0
            return httpx.Response(400, json={"error": {"message": "context length exceeded"}})
        if not back_at:
            back_at.append(fake.now + restart_s)
        return refused(request) if fake.now < back_at[0] else None

    return hook


@pytest.mark.anyio
async def test_a_restart_after_a_stretch_of_error_answers_gets_the_whole_grace(
    tmp_path: Path,
) -> None:
    # 100 s of 400s since the one failed request: the server was reachable all that time, so
    # its restart (30 s, within the 60 s grace) is an outage of 30 s, not of 130 s
    fake = FakeTime()
    hosts = Hosts({"a.test": SimConfig()}, {"a.test": blip_errors_then_restart(fake, 30.0)})
    ledger, stats = await run(
        tmp_path, hosts, fake=fake, max_attempts=3, outage_timeout=60.0, base_url="http://a.test/v1"
    )
    assert stats.aborted is None
    counts = ledger.counts("j")
    assert counts["pending"] == 0 and counts["done"] >= 28  # 10 lines failed with a 400


@pytest.mark.anyio
async def test_a_fallback_of_weight_0_is_sent_to_only_while_the_others_are_down(
    tmp_path: Path,
) -> None:
    def dies(request: httpx.Request, n: int) -> httpx.Response | None:
        return refused(request) if n > 20 else None

    hosts = Hosts({"a.test": SimConfig(), "b.test": SimConfig()}, {"a.test": dies})
    names = ["a=http://a.test/v1", "b=http://b.test/v1,weight=0"]
    ledger, stats = await run(tmp_path, hosts, n=100, endpoints=names)
    assert ledger.counts("j")["done"] == 100
    first = [host for host, _ in hosts.sent[:20]]
    assert set(first) == {"a.test"}  # b waited while a was up
    assert {u.name: u.answered for u in stats.endpoints} == {"a": 20, "b": 80}


@pytest.mark.anyio
async def test_status_shows_each_endpoint(tmp_path: Path) -> None:
    def unauthorized(request: httpx.Request, n: int) -> httpx.Response:
        return httpx.Response(401, json={"error": {"message": "invalid api key"}})

    hosts = Hosts({"a.test": SimConfig(), "b.test": SimConfig()}, {"b.test": unauthorized})
    ledger, _ = await run(tmp_path, hosts, endpoints=endpoints("a", "b"))
    job = ledger.get_job("j")
    assert job is not None
    detail = job_detail(ledger, job)
    shown = {e["name"]: e for e in detail["endpoints"]}
    assert shown["a"]["items"] == {"done": 40} and shown["a"]["state"] == "up"
    assert shown["b"]["state"] == "out" and shown["b"]["errors"] == 1
    text = render_detail(detail)
    assert "endpoint   a: up, 40 done" in text and "endpoint   b: out (" in text
    # the header named the first endpoint's URL and model=None, as if it were the job's one
    assert "endpoints  2, each below (chat)" in text and "model=None" not in text


@pytest.mark.anyio
async def test_each_endpoint_sends_its_own_model(tmp_path: Path) -> None:
    hosts = Hosts({"a.test": SimConfig(models=("m-a",)), "b.test": SimConfig(models=("m-b",))})
    names = ["a=http://a.test/v1,model=m-a", "b=http://b.test/v1"]  # b: asked of the server
    ledger, _ = await run(tmp_path, hosts, model=None, endpoints=names)
    assert ledger.counts("j")["done"] == 40


# --- parsing ------------------------------------------------------------------------------


def test_endpoint_parts_are_parsed_and_checked() -> None:
    e = parse_endpoint("gpu1=http://10.0.0.5:8000/v1/,model=m,key=GPU_KEY,weight=2,rpm=600")
    assert (e.name, e.url, e.model, e.key, e.weight, e.rpm) == (
        "gpu1",
        "http://10.0.0.5:8000/v1",
        "m",
        "GPU_KEY",
        2.0,
        600.0,
    )
    with pytest.raises(UsageError, match="weight must be a number"):
        parse_endpoint("a=http://x,weight=-1")
    with pytest.raises(UsageError, match="same name"):
        parse_endpoints(["a=http://x", "a=http://y"])
    with pytest.raises(UsageError, match="weight 0"):
        parse_endpoints(["a=http://x,weight=0"])


def test_a_key_pasted_into_an_endpoint_is_never_echoed() -> None:
    secret = "sk-live-abcdef123456"
    with pytest.raises(UsageError) as caught:
        parse_endpoint(f"a=http://x,apikey={secret}")
    assert secret not in str(caught.value)
    with pytest.raises(UsageError) as caught:
        resolve({"endpoints": [f"a=http://x,key={secret}"]})
    assert secret not in str(caught.value)


def test_one_endpoint_replaces_several_and_several_replace_one() -> None:
    spec = resolve({"backend": "vllm"}, {"endpoints": endpoints("a", "b")})
    assert spec.endpoints and spec.base_url == "http://a.test/v1" and spec.backend == "custom"
    again = resolve(spec.to_json(), {"base_url": "http://c.test/v1"})
    assert again.endpoints == () and again.base_url == "http://c.test/v1"


# --- prefix groups ------------------------------------------------------------------------

SYSTEMS = ["You are a careful extractor. " * 100, "You are a terse translator. " * 100]


def chat(system: str, question: str) -> dict[str, Any]:
    return {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]
    }


def test_prefix_keys_need_a_long_shared_start() -> None:
    assert prefix_key(chat("short system prompt", "q")) is None
    assert prefix_key({"prompt": "x" * PREFIX_CHARS}) is None  # nothing after the prefix
    one, two = prefix_key(chat(SYSTEMS[0], "a")), prefix_key(chat(SYSTEMS[0], "b"))
    assert one is not None and one == two
    assert prefix_key(chat(SYSTEMS[1], "a")) != one
    as_user = {"messages": [{"role": "user", "content": SYSTEMS[0]}]}
    assert prefix_key(as_user) != one  # the role is part of the prefix


def test_groups_follow_their_first_line_in_input_order() -> None:
    grouper = Grouper()
    keys = [1, None, 2, 1, None, 2, 1]
    order = sorted(range(7), key=lambda i: grouper.position(i + 1, keys[i]))
    assert [i + 1 for i in order] == [1, 4, 7, 2, 3, 6, 5]
    assert (grouper.groups, grouper.grouped) == (2, 5)


def switches(hosts: Hosts) -> int:
    """How often the prefix group changed from one request sent to the next."""
    groups = [int(prompt.split()[-1]) % 2 for _host, prompt in hosts.sent]
    return sum(a != b for a, b in itertools.pairwise(groups))


def test_claims_come_in_prefix_group_order(tmp_path: Path) -> None:
    ledger = Ledger(f"sqlite:///{tmp_path / 'l.db'}")
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in interleaved(10)))
    jobs.create_job(ledger, "j", tmp_path / "in.jsonl", resolve({"backend": "sim"}))
    first = ledger.claim("j", "me", 3, lease_ttl=60)
    rest = ledger.claim("j", "me", 10, lease_ttl=60, after=first[-1].sched)
    assert [c.line for c in first + rest] == [1, 3, 5, 7, 9, 2, 4, 6, 8, 10]
    assert [c.group for c in first[:2]] == [1, 1]  # the group's first line, itself too


def interleaved(n: int) -> list[dict[str, Any]]:
    return [{"id": f"q{i}", **chat(SYSTEMS[i % 2], f"question {i}")} for i in range(n)]


@pytest.mark.anyio
async def test_prefix_order_sends_groups_together_and_writes_input_order(tmp_path: Path) -> None:
    hosts = Hosts({"a.test": SimConfig()})
    ledger, _ = await run(
        tmp_path, hosts, lines=interleaved(40), base_url="http://a.test/v1", concurrency=1
    )
    assert switches(hosts) <= 3  # one group, then the other (a free slot may take one early)
    records = list(read_results(tmp_path / "outputs" / "j.jsonl"))
    assert [r["id"] for r in records] == [f"q{i}" for i in range(40)]
    log = (tmp_path / "logs" / "j.log").read_text()
    assert ledger.counts("j")["done"] == 40 and '"event":"run_started"' in log


@pytest.mark.anyio
async def test_order_input_sends_in_input_order(tmp_path: Path) -> None:
    hosts = Hosts({"a.test": SimConfig()})
    await run(
        tmp_path,
        hosts,
        lines=interleaved(40),
        base_url="http://a.test/v1",
        concurrency=1,
        order="input",
    )
    assert switches(hosts) >= 30


@pytest.mark.anyio
async def test_a_prefix_group_keeps_to_one_endpoint_when_it_has_room(tmp_path: Path) -> None:
    hosts = Hosts({"a.test": SimConfig(), "b.test": SimConfig()})
    await run(tmp_path, hosts, lines=interleaved(200), endpoints=endpoints("a", "b"))
    by_group: dict[int, Counter[str]] = {0: Counter(), 1: Counter()}
    for host, prompt in hosts.sent:
        by_group[int(prompt.split()[-1]) % 2][host] += 1
    for counts in by_group.values():  # most of each group on one endpoint
        assert counts.most_common(1)[0][1] >= 0.75 * sum(counts.values())


@pytest.mark.anyio
async def test_a_prompt_that_fails_on_every_endpoint_still_runs_out_of_attempts(
    tmp_path: Path,
) -> None:
    def poison(request: httpx.Request, n: int) -> httpx.Response | None:
        if b"prompt number 3" in request.content:
            return httpx.Response(502, text="bad gateway")
        return None

    hosts = Hosts(
        {"a.test": SimConfig(), "b.test": SimConfig()}, {"a.test": poison, "b.test": poison}
    )
    ledger, stats = await run(tmp_path, hosts, n=20, max_attempts=2, endpoints=endpoints("a", "b"))
    counts = ledger.counts("j")
    assert counts["done"] == 19 and counts["failed"] == 1 and stats.aborted is None
    tries = sum(1 for _host, prompt in hosts.sent if prompt == "prompt number 3")
    assert 2 <= tries <= 2 + 2 * 2  # its attempts, and at most two free tries per endpoint


@pytest.mark.anyio
async def test_one_named_endpoint_sends_its_own_model(tmp_path: Path) -> None:
    hosts = Hosts({"a.test": SimConfig(models=("m-a",), strict_models=True)})
    ledger, stats = await run(
        tmp_path, hosts, model=None, endpoints=["a=http://a.test/v1,model=m-a"]
    )
    assert ledger.counts("j")["done"] == 40 and stats.aborted is None


@pytest.mark.anyio
async def test_a_down_endpoint_that_answers_a_probe_with_an_error_status_is_up(
    tmp_path: Path,
) -> None:
    fake = FakeTime()

    def down_then_400(request: httpx.Request, n: int) -> httpx.Response | None:
        if n in (4, 5):
            return refused(request)
        if n == 6:  # the probe: the server is back, and finds this prompt too long
            return httpx.Response(400, json={"error": {"message": "context length exceeded"}})
        return None

    hosts = Hosts({"a.test": SimConfig(), "b.test": SimConfig()}, {"b.test": down_then_400})
    hosts.sims["a.test"] = SlowSim(fake)
    ledger, stats = await run(tmp_path, hosts, n=400, fake=fake, endpoints=endpoints("a", "b"))
    uses = {u.name: u for u in stats.endpoints}
    assert uses["b"].state == "up" and uses["b"].answered > 3
    assert ledger.counts("j")["done"] + ledger.counts("j")["failed"] == 400


@pytest.mark.anyio
async def test_the_in_process_simulator_serves_its_metrics_to_its_route(tmp_path: Path) -> None:
    spec = resolve({"backend": "sim"})
    opened = opened_routes(
        spec, transport=None, sleep=FakeTime().sleep, clock=lambda: 0.0, note=print
    )
    async with opened as routes:
        (route,) = routes
        assert route.server_load is not None
        load = await route.server_load()
        assert load is not None and load.running == 0  # the same simulator the requests reach


class Timeline(SimTransport):
    """A simulator that takes 0.05 s of the fake clock per answer and notes when each
    question's request was sent and answered."""

    def __init__(self, fake: FakeTime) -> None:
        super().__init__(SimModel())
        self.fake = fake
        self.events: list[tuple[str, int]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method != "POST":
            return await super().handle_async_request(request)
        question = int(json.loads(request.content)["messages"][-1]["content"].split()[-1])
        self.events.append(("sent", question))
        await self.fake.sleep(0.05)
        response = await super().handle_async_request(request)
        self.events.append(("answered", question))
        return response


@pytest.mark.anyio
async def test_a_group_waits_for_its_first_line_to_compute_the_prefix(tmp_path: Path) -> None:
    fake = FakeTime()
    timeline = Timeline(fake)
    hosts = Hosts({"a.test": SimConfig()})
    hosts.sims["a.test"] = timeline
    ledger, _ = await run(
        tmp_path,
        hosts,
        lines=interleaved(40),
        fake=fake,
        base_url="http://a.test/v1",
        concurrency=8,
        stream=False,
    )
    assert ledger.counts("j")["done"] == 40
    events = timeline.events
    for lead in (0, 1):  # each group's first line, alone until answered
        start, end = events.index(("sent", lead)), events.index(("answered", lead))
        during = [q for kind, q in events[start + 1 : end] if kind == "sent"]
        assert all(q % 2 != lead % 2 for q in during), during
    first_wave = [q for kind, q in events[:8] if kind == "sent"]
    assert first_wave[0] == 0 and len(first_wave) < 8  # not eight cold copies of one prefix


def test_auto_order_groups_prefixes_except_against_llama_cpp() -> None:
    def routes(*backends: str) -> list[Route]:
        specs = [resolve({"backend": b}) for b in backends]
        return [Route(f"e{i}", s, backend=None) for i, s in enumerate(specs)]  # type: ignore

    assert by_prefix(resolve({"backend": "vllm"}), routes("vllm"))
    assert not by_prefix(resolve({"backend": "llamacpp"}), routes("llamacpp"))
    assert not by_prefix(resolve({"backend": "vllm"}), routes("vllm", "llamacpp"))
    assert by_prefix(resolve({"backend": "llamacpp", "order": "prefix"}), routes("llamacpp"))
    assert not by_prefix(resolve({"backend": "vllm", "order": "input"}), routes("vllm"))


@pytest.mark.anyio
async def test_items_waiting_for_a_slot_are_sent_in_their_turn(tmp_path: Path) -> None:
    # Before: the worker that freed a slot went on to its next item without a trip through
    # the event loop and took the slot back before the waiter it woke could run, so items
    # whose workers waited for a slot were sent long after their turn (40 places here).
    class Paced(Hosts):  # each answer takes a moment: workers wait for slots meanwhile
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            if request.method == "POST":
                await anyio.sleep(0.002)
            return await super().handle_async_request(request)

    hosts = Paced({"a.test": SimConfig(), "b.test": SimConfig()})
    await run(tmp_path, hosts, n=200, endpoints=endpoints("a", "b"), concurrency=2, order="input")
    sent = [int(prompt.split()[-1]) for _, prompt in hosts.sent]
    assert sorted(sent) == list(range(200))
    late = max(at - line for at, line in enumerate(sent))
    assert late <= 8  # a request waits behind at most the others then in flight or waiting


@pytest.mark.anyio
async def test_an_endpoint_that_refuses_everything_at_once_fails_no_item(
    tmp_path: Path,
) -> None:
    def too_long(request: httpx.Request, n: int) -> httpx.Response:  # a smaller context, say
        return httpx.Response(400, json={"error": {"message": "maximum context length is 4096"}})

    hosts = Hosts({"a.test": SimConfig(), "b.test": SimConfig()}, {"a.test": too_long})
    ledger, stats = await run(tmp_path, hosts, endpoints=endpoints("a", "b"))
    assert ledger.counts("j")["done"] == 40 and stats.aborted is None
    assert answered_by(ledger) == {"b": 40}  # each refused by a, at most once, then sent to b
    assert {u.name: u.errors for u in stats.endpoints}["a"] == hosts.posts["a.test"]


@pytest.mark.anyio
async def test_a_404_to_a_lines_own_model_fails_that_line_not_the_job(tmp_path: Path) -> None:
    strict = {"a.test": SimConfig(models=("m-a",), strict_models=True)}
    strict["b.test"] = SimConfig(models=("m-b",), strict_models=True)
    rows = [
        {"id": f"p{i}", "prompt": f"prompt number {i}", **({"model": "m-b"} if i < 5 else {})}
        for i in range(20)
    ]
    rows[5]["model"] = "m-nowhere"  # no endpoint has it
    ends = ["a=http://a.test/v1,model=m-a", "b=http://b.test/v1,model=m-b"]
    ledger, stats = await run(tmp_path, Hosts(strict), lines=rows, model=None, endpoints=ends)
    assert stats.aborted is None
    results = {item.item_id: item for item in ledger.iter_results("j")}
    assert all(results[f"p{i}"].answered_by == "b" for i in range(5))  # where m-b is
    assert results["p5"].status == "failed" and "m-nowhere" in (results["p5"].error or "")
    assert ledger.counts("j")["done"] == 19
    assert all(u.state == "up" for u in stats.endpoints)  # neither taken out by a line's own


@pytest.mark.anyio
async def test_a_line_asking_an_api_an_endpoint_lacks_does_not_take_it_out(
    tmp_path: Path,
) -> None:
    def chat_only(request: httpx.Request, n: int) -> httpx.Response | None:
        if request.url.path.endswith("/completions") and "/chat/" not in request.url.path:
            return httpx.Response(404, json={"error": {"message": "no route"}})
        return None

    rows: list[dict[str, Any]] = [{"id": f"p{i}", "prompt": f"prompt {i}"} for i in range(20)]
    rows[3] = {"custom_id": "c3", "method": "POST", "url": "/v1/completions"}
    rows[3]["body"] = {"prompt": "complete this"}  # a line of its own API kind
    hooks = {"a.test": chat_only, "b.test": chat_only}
    hosts = Hosts({"a.test": SimConfig(), "b.test": SimConfig()}, hooks)
    ledger, stats = await run(tmp_path, hosts, lines=rows, endpoints=endpoints("a", "b"))
    assert stats.aborted is None and all(u.state == "up" for u in stats.endpoints)
    counts = ledger.counts("j")
    assert counts["done"] == 19 and counts["failed"] == 1  # that line alone: no one serves it


P3 = b'prompt number 3"'


def refused_first(second: Hook) -> dict[str, Hook]:
    """Whichever host gets line 3 first refuses it (a 400); the other answers it by `second`."""
    first: list[str] = []

    def hook(request: httpx.Request, n: int) -> httpx.Response | None:
        if P3 in request.content:
            first.extend([] if first else [request.url.host])
            if request.url.host == first[0]:
                return httpx.Response(400, json={"error": {"message": "context is 4096"}})
            return second(request, n)
        return None

    return {"a.test": hook, "b.test": hook}


@pytest.mark.anyio
async def test_a_refused_line_whose_other_endpoints_left_the_job_fails_and_the_job_ends(
    tmp_path: Path,
) -> None:
    def revoked(request: httpx.Request, n: int) -> httpx.Response:  # a key revoked mid-run
        return httpx.Response(401, json={"error": {"message": "invalid api key"}})

    hosts = Hosts({"a.test": SimConfig(), "b.test": SimConfig()}, refused_first(revoked))
    with anyio.fail_after(30):
        ledger, stats = await run(tmp_path, hosts, n=10, endpoints=endpoints("a", "b"))
    counts = ledger.counts("j")
    assert counts["done"] == 9 and counts["failed"] == 1 and stats.aborted is None


@pytest.mark.anyio
async def test_after_a_refusal_the_other_endpoints_retry_after_is_still_waited(
    tmp_path: Path,
) -> None:
    def busy(request: httpx.Request, n: int) -> httpx.Response:
        return httpx.Response(429, headers={"retry-after": "20"}, json={"error": {"message": "!"}})

    fake = FakeTime()
    hosts = Hosts({"a.test": SimConfig(), "b.test": SimConfig()}, refused_first(busy))
    await run(tmp_path, hosts, n=10, max_attempts=3, fake=fake, endpoints=endpoints("a", "b"))
    assert fake.sleeps.count(20) >= 2  # not sent again at once on the endpoint that said wait


@pytest.mark.anyio
async def test_outage_handling_off_still_drains_a_dead_endpoint_among_several(
    tmp_path: Path,
) -> None:
    # Before: `--outage-timeout 0` kept a dead endpoint up. Failing at once, it was always the
    # least busy, so items went there again and again until their attempts ran out.
    def dies(request: httpx.Request, n: int) -> httpx.Response | None:
        return refused(request) if n > 5 else None

    hosts = Hosts({"a.test": SimConfig(), "b.test": SimConfig()}, {"b.test": dies})
    ledger, stats = await run(
        tmp_path, hosts, n=200, outage_timeout=0, max_attempts=2, endpoints=endpoints("a", "b")
    )
    assert ledger.counts("j")["done"] == 200 and stats.aborted is None
    uses = {u.name: u for u in stats.endpoints}
    assert uses["b"].state == "down" and "refused" in uses["b"].reason
    assert uses["b"].answered == 5 and uses["a"].answered == 195


@pytest.mark.anyio
async def test_outage_handling_off_fails_items_when_every_endpoint_is_dead(
    tmp_path: Path,
) -> None:
    # Drained lanes are sent to as before once none is up: the items fail by their attempts,
    # and the job ends (it neither stops with exit 3 nor waits for a probe for ever).
    def down(request: httpx.Request, n: int) -> httpx.Response:
        return refused(request)

    hosts = Hosts({"a.test": SimConfig(), "b.test": SimConfig()}, {"a.test": down, "b.test": down})
    with anyio.fail_after(30):
        ledger, stats = await run(
            tmp_path, hosts, n=20, outage_timeout=0, max_attempts=2, endpoints=endpoints("a", "b")
        )
    assert stats.aborted is None
    assert ledger.counts("j")["failed"] == 20
    assert all(u.state == "down" for u in stats.endpoints)


@pytest.mark.anyio
async def test_an_endpoint_that_refuses_the_lines_others_answer_is_drained(
    tmp_path: Path,
) -> None:
    # Before: failing at once, it was always the least busy, so it got every line first (199
    # refused requests for 200 lines). Now it is drained after a few, and probed.
    def too_long(request: httpx.Request, n: int) -> httpx.Response:
        return httpx.Response(400, json={"error": {"message": "maximum context length is 4096"}})

    hosts = Hosts({"a.test": SimConfig(), "b.test": SimConfig()}, {"a.test": too_long})
    ledger, stats = await run(tmp_path, hosts, n=200, endpoints=endpoints("a", "b"))
    assert ledger.counts("j")["done"] == 200 and stats.aborted is None
    uses = {u.name: u for u in stats.endpoints}
    assert uses["a"].state == "down" and "maximum context length" in uses["a"].reason
    assert hosts.posts["a.test"] <= 20
    log = (tmp_path / "logs" / "j.log").read_text()
    assert '"event":"endpoint_down"' in log


@pytest.mark.anyio
async def test_an_endpoint_with_a_wrong_path_is_drained_when_lines_name_their_model(
    tmp_path: Path,
) -> None:
    # Every line names its model, so a 404 may be the line's own (a model the endpoint lacks)
    # and takes nothing out; but an endpoint that 404s what others answer is drained.
    def no_route(request: httpx.Request, n: int) -> httpx.Response:
        return httpx.Response(404, json={"error": {"message": "no route /v2/chat/completions"}})

    rows = [{"id": f"p{i}", "prompt": f"prompt {i}", "model": "sim-1"} for i in range(200)]
    hosts = Hosts({"a.test": SimConfig(), "b.test": SimConfig()}, {"a.test": no_route})
    ledger, stats = await run(tmp_path, hosts, lines=rows, endpoints=endpoints("a", "b"))
    assert ledger.counts("j")["done"] == 200 and stats.aborted is None
    assert {u.name: u.state for u in stats.endpoints} == {"a": "down", "b": "up"}
    assert hosts.posts["a.test"] <= 20


@pytest.mark.anyio
async def test_a_drained_refusing_endpoint_that_answers_a_probe_is_up_again(
    tmp_path: Path,
) -> None:
    fake = FakeTime()

    def refuses_at_first(request: httpx.Request, n: int) -> httpx.Response | None:
        if n <= 12:
            return httpx.Response(400, json={"error": {"message": "not yet"}})
        return None

    hosts = Hosts({"a.test": SimConfig(), "b.test": SimConfig()}, {"a.test": refuses_at_first})
    hosts.sims["b.test"] = SlowSim(fake)  # time passes: a's probe comes due
    ledger, stats = await run(tmp_path, hosts, n=400, fake=fake, endpoints=endpoints("a", "b"))
    assert ledger.counts("j")["done"] == 400
    log = (tmp_path / "logs" / "j.log").read_text()
    assert '"event":"endpoint_down"' in log and '"event":"endpoint_up"' in log
    uses = {u.name: u for u in stats.endpoints}
    assert uses["a"].state == "up" and uses["a"].answered > 10


@pytest.mark.anyio
async def test_lines_refused_by_one_endpoint_wait_for_another_one_down_not_fail(
    tmp_path: Path,
) -> None:
    # `a` refuses every line (drained for it), `b` answers some and goes down: the lines are
    # b's to answer, so they wait for it, and the job stops past the grace with them pending.
    def too_long(request: httpx.Request, n: int) -> httpx.Response:
        return httpx.Response(400, json={"error": {"message": "maximum context length is 4096"}})

    def dies(request: httpx.Request, n: int) -> httpx.Response | None:
        return refused(request) if n > 20 else None

    hosts = Hosts({"a.test": SimConfig(), "b.test": SimConfig()}, {"a.test": too_long})
    hosts.hooks["b.test"] = dies
    home = Home.at(tmp_path, None)
    ledger = Ledger(home.ledger_url)
    (tmp_path / "in.jsonl").write_text("".join(f'{{"prompt": "p{i}"}}\n' for i in range(60)))
    options = {"endpoints": endpoints("a", "b"), "model": "sim-1", "outage_timeout": 1.5}
    spec = resolve({**options, "concurrency": 2, "max_attempts": 3})
    jobs.create_job(ledger, "j", tmp_path / "in.jsonl", spec)
    settings = RunnerSettings(drain_timeout=0.0)  # real time: probes are timed by the clock
    with anyio.fail_after(30):
        stats = await jobs.run_job(ledger, home, "j", spec, transport=hosts, settings=settings)
    assert stats.aborted is not None and "every endpoint unreachable" in stats.aborted
    assert "a: refused 4 lines in a row" in stats.aborted  # why `a` did not take them
    counts = ledger.counts("j")
    assert counts["done"] == 20 and counts["failed"] == 0 and counts["pending"] == 40
    uses = {u.name: u for u in stats.endpoints}
    assert uses["a"].state == "down" and "refused" in uses["a"].reason
    assert hosts.posts["a.test"] > 1  # probed while b was down: a refusal made it wait


# Found by a hostile review of the draining of refusing endpoints (the first two were faults of
# it; the third is older: a line waited for ever for an endpoint that had died).


@pytest.mark.anyio
async def test_lines_only_an_endpoint_drained_for_refusing_serves_go_to_it(
    tmp_path: Path,
) -> None:
    # The first 20 lines ask m-b (a 404s them, b answers: a is drained for refusing); the
    # next 20 ask m-a, which only a serves: b 404s them, and they go to a, reachable.
    fake = FakeTime()
    a = SimConfig(models=("m-a",), strict_models=True)
    b = SimConfig(models=("m-b",), strict_models=True)
    hosts = Hosts({"a.test": a, "b.test": b})
    hosts.sims["b.test"] = SlowSim(fake, b)
    rows = [
        {"id": f"p{i}", "prompt": f"prompt number {i}", "model": "m-b" if i < 20 else "m-a"}
        for i in range(40)
    ]
    ends = ["a=http://a.test/v1,model=m-a", "b=http://b.test/v1,model=m-b"]
    with anyio.fail_after(30):
        ledger, stats = await run(
            tmp_path, hosts, lines=rows, fake=fake, model=None, endpoints=ends
        )
    assert stats.aborted is None and ledger.counts("j")["done"] == 40  # before: 7 failed
    assert answered_by(ledger) == Counter({"a": 20, "b": 20})


@pytest.mark.anyio
async def test_an_endpoint_drained_for_refusing_that_then_dies_stops_the_job(
    tmp_path: Path,
) -> None:
    # `a` refuses what b answers (drained), b's key is revoked (out), and a, all that is
    # left, is sent to until its server dies: an outage like any other, past the grace the
    # job stops (before: it went on for ever, each failure free).
    revoked: list[bool] = []

    def refuses_then_dies(request: httpx.Request, n: int) -> httpx.Response | None:
        if not revoked:
            return httpx.Response(400, json={"error": {"message": "maximum context 4096"}})
        return refused(request)

    def revoked_later(request: httpx.Request, n: int) -> httpx.Response | None:
        if n > 12:
            revoked.append(True)
            return httpx.Response(401, json={"error": {"message": "invalid api key"}})
        return None

    hosts = Hosts({"a.test": SimConfig(), "b.test": SimConfig()})
    hosts.hooks = {"a.test": refuses_then_dies, "b.test": revoked_later}
    rows = [{"id": f"p{i}", "prompt": f"prompt number {i}"} for i in range(40)]
    ledger, stats = await run_real(
        tmp_path, hosts, rows, endpoints=endpoints("a", "b"), outage_timeout=0.5
    )
    assert stats.aborted is not None and "every endpoint unreachable" in stats.aborted
    assert ledger.counts("j")["failed"] == 0


@pytest.mark.anyio
async def test_a_refused_line_waits_for_a_dead_endpoint_only_until_the_grace_is_past(
    tmp_path: Path,
) -> None:
    # `a` refuses line x (too long for it) and answers the rest; `b`, which could take x,
    # dies for good. x waits for b through the grace, then fails; the job ends.
    def too_long_for_a(request: httpx.Request, n: int) -> httpx.Response | None:
        if b"LONG" in request.content:
            return httpx.Response(400, json={"error": {"message": "maximum context 4096"}})
        return None

    def dies(request: httpx.Request, n: int) -> httpx.Response | None:
        return refused(request) if n > 4 or b"LONG" in request.content else None

    hosts = Hosts({"a.test": SimConfig(), "b.test": SimConfig()})
    hosts.hooks = {"a.test": too_long_for_a, "b.test": dies}
    rows = [{"id": "x", "prompt": "LONG prompt"}]
    rows += [{"id": f"p{i}", "prompt": f"prompt number {i}"} for i in range(40)]
    ledger, stats = await run_real(
        tmp_path, hosts, rows, endpoints=endpoints("a", "b"), outage_timeout=0.5
    )
    assert stats.aborted is None
    counts = ledger.counts("j")
    assert counts["done"] == 40 and counts["failed"] == 1
    failed = [item for item in ledger.iter_results("j") if item.status == "failed"]
    assert failed[0].item_id == "x" and "maximum context" in (failed[0].error or "")


def bare_fleet(*names: str) -> Fleet:
    """A fleet of lanes of one slot each on the fake clock, for its placing rules alone."""
    fake = FakeTime()
    spec = resolve({"backend": "sim", "concurrency": 1, "model": "sim-1"})

    def lane(name: str) -> Lane:
        throttle = Throttle.for_pacing(spec.pacing, clock=fake.clock, sleep=fake.sleep)
        backend = cast(Backend, None)  # never called: the fleet only places requests
        return Lane(Route(name, spec, backend), throttle, OutageWatch(60, clock=fake.clock), "")

    return Fleet([lane(name) for name in names], clock=fake.clock)


async def free(lane: Lane) -> None:
    """A request on `lane` ends: its slot comes free."""
    async with lane.throttle.slot(1, taken=True):
        pass


@pytest.mark.anyio
@pytest.mark.parametrize("y_comes", ["before the slot frees", "after it"])
async def test_a_slot_freed_wakes_a_line_that_may_take_it(y_comes: str) -> None:
    # Found by a second review: `a` refused line x, which waits for `b`, full. A slot freed
    # on `a` woke x, the first waiter; x could not take it and went back to the front, and
    # the line behind it was never woken: `a` stood idle while lines waited for it. Found by
    # a later review (tests/hostile): y that came after the slot was free queued behind x,
    # and no wake-up came for it: `a` stood idle again, until `b` freed a slot twice.
    fleet = bare_fleet("a", "b")
    a, b = fleet.lanes
    assert await fleet.pick("k0") is a and await fleet.pick("k1") is b  # both full
    assert fleet.refused(a, "x", BadRequest("maximum context 4096", status=400))
    got: dict[str, Lane] = {}

    async def pick(key: str) -> None:
        got[key] = await fleet.pick(key)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(pick, "x")
            await wait_all_tasks_blocked()
            if y_comes == "before the slot frees":
                tg.start_soon(pick, "y")  # behind x
                await wait_all_tasks_blocked()
            await free(a)
            await wait_all_tasks_blocked()
            if y_comes == "after it":
                tg.start_soon(pick, "y")
                await wait_all_tasks_blocked()
            assert got == {"y": a}  # before: {} (y waited while `a` was free)
            await free(b)
    assert got == {"y": a, "x": b}


@pytest.mark.anyio
async def test_a_line_an_endpoint_refused_and_then_answered_is_not_held_against_it() -> None:
    fleet = bare_fleet("a", "b")
    a, b = fleet.lanes
    assert await fleet.pick("x") is a
    assert fleet.refused(a, "x", BadRequest("maximum context 4096", status=400))
    await free(a)
    assert await fleet.pick("x") is b  # kept from the lane that refused it
    await free(b)
    fleet.success("x")  # answered elsewhere: one against `a`
    assert a.refusals == 1
    assert await fleet.pick("y") is a
    assert fleet.refused(a, "y", BadRequest("maximum context 4096", status=400))
    await free(a)
    assert fleet.take_out(b, AuthFailed("invalid api key", status=401))
    assert await fleet.pick("y") is a  # nowhere else to go: back to `a`, which answers it
    fleet.success("y")
    assert a.refusals == 0  # its own answer (before: 1, as if another had answered it)
