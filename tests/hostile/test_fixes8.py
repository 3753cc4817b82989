"""fixes8 review: the fixes in 369a4ee..HEAD attacked. Each test fails on the code it was
written against, and names the defect it shows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from batchrun import jobs
from batchrun.config import resolve
from batchrun.errors import OptionError
from batchrun.jobs import Home
from batchrun.ledger import Ledger
from batchrun.run_state import RunnerSettings
from batchrun.sim import SimConfig
from tests.fakes import FakeTime
from tests.hostile.test_fleet2 import night
from tests.unit.test_fleet import Hosts

CUT = (
    b'data: {"id":"x","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":{"content":"half an ans"},"finish_reason":null}]}\n\n'
)


def cut_stream(request: httpx.Request) -> httpx.Response:
    """A broken proxy: a 200 stream that stops before its final chunk."""
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=CUT)


def results_of(tmp_path: Path, name: str) -> dict[str, dict[str, Any]]:
    out = Home.at(tmp_path, None).output_path(name)
    return {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}


@pytest.mark.anyio
async def test_a_line_that_asked_its_own_model_names_it_in_an_endpoints_job(
    tmp_path: Path,
) -> None:
    # README (results): "a line that asked its own model names it". A job given its one
    # server by name (`--endpoint a=URL`, the model learned from the server): since 7a79d96
    # the learned model is no longer kept as the job's --model, and result_of names a line's
    # model only where the job has one (`job_model and ...`): the line that asked for
    # `other-model` comes back without `model`, indistinguishable from the job's lines.
    hosts = Hosts({"a.test": SimConfig(models=("sim-1",))})
    rows = [
        {"id": "own", "prompt": "hello", "model": "other-model"},
        {"id": "plain", "prompt": "hello there"},
    ]
    await night(tmp_path, "j", hosts, rows, endpoints=["a=http://a.test/v1"])
    got = results_of(tmp_path, "j")
    assert got["own"]["status"] == "done"
    assert got["own"].get("model") == "other-model", got["own"]


def refuse_posts(request: httpx.Request, n: int) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


@pytest.mark.anyio
async def test_a_worker_whose_endpoint_serves_another_model_is_refused_beside_a_live_one(
    tmp_path: Path,
) -> None:
    # README: a worker asking other answers than the live workers' ("model picked from
    # /v1/models at run time" among them) is refused, exit 2. Worker 1 runs a job given its
    # server by name (`--endpoint gpu0=URL`), no --model: its server lists sim-1. Since 7a79d96
    # run_job keeps the learned model out of an endpoints job's spec, so what it stores to be
    # compared has model None and endpoint_models {"gpu0": None}. Worker 2, on another host,
    # `--endpoint gpu0=URL2` whose server lists sim-2, joins while worker 1 is live: the check
    # compares None with None and lets it in; the job's lines are then answered by two models
    # (before 7a79d96 the learned model was stored and compared, and it was refused).
    home = Home.at(tmp_path, None)
    ledger = Ledger(home.ledger_url)
    path = tmp_path / "in.jsonl"
    path.write_text(
        "".join(json.dumps({"id": f"r{i}", "prompt": f"p {i}"}) + "\n" for i in range(4))
    )
    spec1 = resolve({"concurrency": 2, "outage_timeout": 5, "endpoints": ["gpu0=http://a.test/v1"]})
    jobs.create_job(ledger, "j", path, spec1)
    fake = FakeTime()
    settings = RunnerSettings(sleep=fake.sleep, clock=fake.clock, drain_timeout=0.0, worker="w1")
    # worker 1: its server answers /v1/models (sim-1) but its POSTs fail: the run stops
    # with every line pending, its spec stored with the job as any run stores it
    down = Hosts({"a.test": SimConfig(models=("sim-1",))}, hooks={"a.test": refuse_posts})
    with anyio.fail_after(20):
        first = await jobs.run_job(
            ledger, home, "j", spec1, transport=down, settings=settings, handle_signals=False
        )
    assert first.aborted, first
    assert ledger.counts("j").get("pending") == 4
    ledger.join("j", "w1-back", ttl=600)  # worker 1, live again (the spec it stored stays)
    spec2 = resolve({"concurrency": 2, "endpoints": ["gpu0=http://b.test/v1"]})
    other = Hosts({"b.test": SimConfig(models=("sim-2",))})
    fake2 = FakeTime()
    settings2 = RunnerSettings(sleep=fake2.sleep, clock=fake2.clock, drain_timeout=0.0, worker="w2")
    with anyio.fail_after(20):
        with pytest.raises(OptionError):
            await jobs.run_job(
                ledger, home, "j", spec2, transport=other, settings=settings2, handle_signals=False
            )
    assert other.posts["b.test"] == 0  # nothing answered by sim-2 in sim-1's job


class _Waited(Exception):
    pass


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("how", ["submit_spec_file", "resume_spec_file"])
def test_a_run_whose_outage_timeout_is_0_does_not_wait_for_a_ledger_away(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    # README: a run waits out a PostgreSQL restart as it opens the ledger "up to its outage
    # timeout"; --outage-timeout 0 turns outage handling off. api._patience reads the
    # outage timeout from the keyword options only: one set in a spec file (`spec=`, the
    # CLI's --spec) is ignored, on submit and resume alike, and the open waits RunSpec's
    # default 60 s for a database that is not there, a try a second (the keyword
    # outage_timeout=0 does not wait).
    import batchrun
    from batchrun.errors import LedgerError
    from batchrun.ledger import migrations

    def no_wait(seconds: float) -> None:
        if seconds >= 1.0:  # the out-of-reach wait (a busy lock waits 0.05 s)
            raise _Waited(f"waited {seconds} s for a ledger away, outage timeout 0")

    url = f"postgresql+psycopg://u:p@127.0.0.1:{_closed_port()}/db"
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "hi"}\n')
    spec = tmp_path / "spec.toml"
    spec.write_text("outage_timeout = 0\nbackend = 'sim'\n")
    monkeypatch.setattr(migrations.time, "sleep", no_wait)
    with pytest.raises(LedgerError):
        if how == "submit_spec_file":
            batchrun.submit(inp, home=tmp_path, ledger=url, spec=spec, run=False)
        else:
            batchrun.resume("in", home=tmp_path, ledger=url, spec=spec)


@pytest.mark.anyio
async def test_status_of_a_job_given_its_server_by_name_says_the_model_it_asked(
    tmp_path: Path,
) -> None:
    # The same cause as above, in `status`: a job run with `--endpoint a=URL` and no --model
    # (the README's way to name a server) asked sim-1 of it, but the model learned is no
    # longer kept with the job, and `status` (one endpoint: the one-endpoint header) says
    # `model=None`; nothing else in its output names the model the answers came from.
    from batchrun.status_view import job_detail, render_detail

    hosts = Hosts({"a.test": SimConfig(models=("sim-1",))})
    ledger, _ = await night(tmp_path, "j", hosts, ROWS4, endpoints=["a=http://a.test/v1"])
    job = ledger.get_job("j")
    assert job is not None
    shown = render_detail(job_detail(ledger, job))
    assert "sim-1" in shown, shown


ROWS4 = [{"id": f"r{i}", "prompt": f"line {i}"} for i in range(4)]


def test_a_rejoin_after_the_ledger_was_away_past_the_lease_reclaims_no_other_worker(
    tmp_path: Path,
) -> None:
    # A PostgreSQL restart (or a lock) keeps the ledger away for every worker longer than the
    # lease. Ledger.heartbeat knows this case: a beat that finds its own last one older than
    # the lease judges nobody ("the others' too, and they are not judged by it now"). But a
    # worker's sender that wants to send during the outage calls Feeder.recheck -> Ledger.rejoin,
    # waiting in LedgerCalls beside the stuck heartbeat; when the database is back and the
    # rejoin lands first (each call retries on its own), rejoin writes the worker's heartbeat,
    # and the heartbeat that lands next sees itself "away" 0 s and reclaims every other worker
    # whose beat has not landed yet: worker B's items, answered during the outage and waiting
    # for their commit, go back to pending and are sent (paid) again; B's commit is turned away.
    from batchrun import reuse
    from batchrun.ledger import Joining

    home = Home.at(tmp_path, None)
    led = Ledger(home.ledger_url)
    path = tmp_path / "in.jsonl"
    path.write_text(
        "".join(json.dumps({"id": f"r{i}", "prompt": f"p {i}"}) + "\n" for i in range(4))
    )
    spec = resolve({"base_url": "http://a.test/v1", "model": "m"})
    jobs.create_job(led, "j", path, spec)
    same = reuse.joined(spec)
    for w in ("A", "B"):
        led.join("j", w, ttl=60, spec=same, same=reuse.SAME)
    b_lines = {c.line for c in led.claim("j", "B", 2, lease_ttl=60)}
    led.claim("j", "A", 2, lease_ttl=60)
    import sqlite3

    from batchrun.ledger import ledger_file

    found = ledger_file(home.ledger_url)
    assert found is not None
    where = found[0]
    db = sqlite3.connect(where)
    with db:  # the ledger was away 90 s for everyone (lease 60 s): nobody beat meanwhile
        db.execute("UPDATE workers SET heartbeat = heartbeat - 90")
        db.execute("UPDATE items SET lease_expires = lease_expires - 90 WHERE owner IS NOT NULL")
    db.close()
    # worker A, back: its sender's recheck lands first, then its stuck heartbeat
    led.rejoin("j", Joining(same, reuse.SAME, 60, "A"))
    back = led.heartbeat("j", "A", lease_ttl=60)
    with sqlite3.connect(where) as db:
        rows = db.execute("SELECT line, status, owner FROM items WHERE job = 'j'").fetchall()
    owners = {line: (status, owner) for line, status, owner in rows if line in b_lines}
    assert back == 0 and all(o == ("running", "B") for o in owners.values()), (back, owners)
