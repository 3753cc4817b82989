"""`--mode batch`, attacked: each test failed on the code before its fix, and names the defect
it showed."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import httpx
import orjson
import pytest

from batchrun import api, batch_mode, hosted, jobs, reuse
from batchrun.backends import batch_api
from batchrun.config import ANSWER_FIELDS, resolve
from batchrun.errors import OptionError
from batchrun.jobs import Home
from batchrun.ledger import Joining, Ledger, chunks
from batchrun.run_state import RunnerSettings
from batchrun.sim import SimConfig, SimModel, SimTransport
from tests.unit.test_hosted import Killed, _kill, load, sim
from tests.unit.test_hosted_faults import Rewritten, run


async def _killed_after_create(
    ledger: Ledger, home: Home, spec: Any, model: SimModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run killed after its create reached the provider, before the batch id was recorded."""
    with monkeypatch.context() as patch:
        patch.setattr(hosted, "_crash_point", lambda name: _kill(name, "created"))
        with pytest.raises(Killed):
            await run(ledger, home, spec, SimTransport(model))


def _more_batches(model: SimModel, count: int) -> None:
    """Other batches made at the provider (another job, another app of the same project)."""
    line = {"custom_id": "0", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}
    for _ in range(count):
        file_id = model.batches._store("batch", "other.jsonl", orjson.dumps(line) + b"\n")
        body = {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}
        status, _ = model.batches._create(orjson.dumps(body))
        assert status == 200


@pytest.mark.anyio
async def test_a_list_page_not_in_openais_shape_is_not_taken_for_no_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed after the create: the resume looks for the batch. A provider whose list answers an
    object without `data` (`{"batches": [...]}`) is not OpenAI's shape; it must stop the run,
    not be read as 'no batch' and pay for a second one."""
    ledger, home, spec = load(tmp_path, 6)
    model = sim(batch_seconds=0.2)
    await _killed_after_create(ledger, home, spec, model, monkeypatch)
    assert model.batches.created == 1

    def other_shape(m: str, p: str, n: int, r: httpx.Response) -> httpx.Response | None:
        if (m, p) == ("GET", "/v1/batches"):
            return httpx.Response(200, json={"object": "list", "batches": r.json()["data"]})
        return None

    monkeypatch.setattr(chunks, "_alive", lambda _owner: False)  # the killed run's process
    await run(ledger, home, spec, Rewritten(model, other_shape))
    assert model.batches.created == 1  # never a second batch for the same lines


@pytest.mark.anyio
async def test_a_batch_listed_past_the_pages_looked_at_is_not_created_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README: the look lists the batches 'newest first, back to an hour before the chunk was
    made'. It stops after LIST_PAGES pages (50, 5,000 batches) and then says 'none', though it
    never reached the chunk's time: a busy project's resume pays for a second batch."""
    monkeypatch.setattr(batch_api, "LIST_PAGES", 2)  # stands for 50 pages of 100
    ledger, home, spec = load(tmp_path, 6)
    model = sim(batch_seconds=0.2)
    await _killed_after_create(ledger, home, spec, model, monkeypatch)
    _more_batches(model, 250)  # made since, all within the hour: the chunk's is on page 3
    made = model.batches.created
    monkeypatch.setattr(chunks, "_alive", lambda _owner: False)
    await run(ledger, home, spec, SimTransport(model))
    assert model.batches.created == made  # adopted (or stopped), never created again


def _html(m: str, p: str, n: int, r: httpx.Response) -> httpx.Response | None:
    """The output file is an HTML page (a proxy's, a CDN's), not JSONL."""
    if m == "GET" and p.endswith("/content") and b"choices" in r.content:
        return httpx.Response(200, text="<html><body>Service page</body></html>")
    return None


def _json_array(m: str, p: str, n: int, r: httpx.Response) -> httpx.Response | None:
    """The output file is one JSON array of the records, not JSONL."""
    if m == "GET" and p.endswith("/content") and b"choices" in r.content:
        return httpx.Response(200, json=[json.loads(x) for x in r.content.splitlines()])
    return None


def _no_output_id(m: str, p: str, n: int, r: httpx.Response) -> httpx.Response | None:
    """`completed`, every line counted as answered, but no output_file_id (yet)."""
    if m == "GET" and p.startswith("/v1/batches/") and r.json().get("status") == "completed":
        return httpx.Response(200, json={**r.json(), "output_file_id": None})
    return None


@pytest.mark.parametrize("odd", [_html, _json_array, _no_output_id], ids=lambda f: f.__name__)
@pytest.mark.anyio
async def test_a_completed_batchs_answers_it_cannot_read_are_not_paid_for_again(
    tmp_path: Path, odd: Any
) -> None:
    """A completed batch (every line answered, paid for, request_counts say so) whose output
    batchrun cannot read (an HTML page, a JSON array, no output file id) is read as 'no
    answers': every line goes back to pending and --then online pays for each again. Not
    OpenAI's shape: it should stop saying so, the lines kept in their chunk, as an unreadable
    poll does."""
    ledger, home, spec = load(tmp_path, 6, then="online")
    model = sim()
    stats = await run(ledger, home, spec, Rewritten(model, odd))
    assert model.batches.created == 1
    assert model.requests == 6, stats  # the batch's answers, not the same lines again online
    assert stats.aborted is not None and ledger.counts("j")["batched"] == 6  # kept, said


@pytest.mark.anyio
async def test_an_output_line_whose_custom_id_is_not_a_string_stops_without_a_traceback(
    tmp_path: Path,
) -> None:
    """An output line with a custom_id that is a list (a provider's bug) raises TypeError
    (unhashable) out of the run: README promises 'never a traceback'."""

    def odd(m: str, p: str, n: int, r: httpx.Response) -> httpx.Response | None:
        if m == "GET" and p.endswith("/content") and b"choices" in r.content:
            bad = {"custom_id": ["0"], "response": None, "error": None}
            return httpx.Response(200, content=orjson.dumps(bad) + b"\n" + r.content)
        return None

    ledger, home, spec = load(tmp_path, 6)
    stats = await run(ledger, home, spec, Rewritten(sim(), odd))
    assert ledger.counts("j")["done"] == 6 or stats.aborted is not None


@pytest.mark.anyio
async def test_items_a_killed_online_run_held_are_sent_by_a_batch_mode_resume(
    tmp_path: Path,
) -> None:
    """An online run killed -9 leaves items `running`, leased to a worker that is gone. A
    `resume --mode batch` (to pay half for the rest) never puts them back to pending: only an
    online worker's join reclaims leases, so they are never batched, and every batch-mode
    resume ends with them left ('not finished'), for ever."""
    ledger, home, spec = load(tmp_path, 6)
    held = ledger.claim("j", "killed-worker", 2, lease_ttl=0.001)  # a worker that is gone
    assert len(held) == 2 and ledger.counts("j")["running"] == 2
    model = sim()
    stats = await run(ledger, home, spec, SimTransport(model))
    assert stats.aborted is None
    assert ledger.counts("j")["done"] == 6, ledger.counts("j")


@pytest.mark.anyio
async def test_a_resume_in_batch_mode_stores_its_mode_with_the_job(tmp_path: Path) -> None:
    """README: '`--mode` is stored with the job, so `resume` polls without being told', and a
    resume's options become the job's. A batch-mode run never stores its spec (only an online
    worker's join does): after `resume j --mode batch` is stopped while its batch runs, a plain
    `resume j` runs online: it looks once and leaves, never waiting for the batch."""
    (tmp_path / "in.jsonl").write_text(
        "".join(json.dumps({"id": i, "prompt": f"p {i}"}) + "\n" for i in range(4))
    )
    await api.submit_async(
        tmp_path / "in.jsonl", job="j", home=tmp_path, backend="sim", model="sim-1", run=False
    )
    with anyio.move_on_after(2.0):  # Ctrl-C while the batch runs at the provider
        await api.resume_async(
            "j",
            home=tmp_path,
            mode="batch",
            poll_interval=0.02,
            sim_options={"batch_seconds": 60.0},
        )
    ledger = Ledger(Home.at(tmp_path, None).ledger_url)
    assert ledger.counts("j")["batched"] == 4  # a batch at the provider
    job = ledger.get_job("j")
    assert job is not None
    assert jobs.job_spec(job).mode == "batch"  # what a plain `resume j` will run with


@pytest.mark.anyio
async def test_a_created_at_without_a_zone_is_not_read_as_local_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README: '`created_at` is read as epoch seconds or an ISO 8601 time'. A provider's time
    without a zone (`2025-01-01T10:00:00`, UTC as servers keep it) is read as this machine's
    local time: two hours east of UTC, a batch made a minute after the chunk looks made an hour
    and more before it, the look stops there, before it reaches the chunk's own batch, and the
    resume pays for a second one."""
    monkeypatch.setenv("TZ", "Etc/GMT-2")  # UTC+2: Berlin in summer
    time.tzset()
    try:
        ledger, home, spec = load(tmp_path, 6)
        model = sim(batch_seconds=0.2)
        await _killed_after_create(ledger, home, spec, model, monkeypatch)
        _more_batches(model, 1)  # another job's batch, made since

        def naive(m: str, p: str, n: int, r: httpx.Response) -> httpx.Response | None:
            if (m, p) != ("GET", "/v1/batches"):
                return None
            page = r.json()
            for batch in page["data"]:
                made = datetime.fromtimestamp(batch["created_at"], UTC)
                batch["created_at"] = made.replace(tzinfo=None).isoformat()
            return httpx.Response(200, json=page)

        made = model.batches.created
        monkeypatch.setattr(chunks, "_alive", lambda _owner: False)
        await run(ledger, home, spec, Rewritten(model, naive))
        assert model.batches.created == made  # the killed run's batch adopted
    finally:
        monkeypatch.undo()  # TZ as it was
        time.tzset()


# --- 4. batch mode counting reuse, with --then online ----------------------------------------


@pytest.mark.anyio
async def test_a_batch_night_then_online_says_how_many_answers_it_reused(tmp_path: Path) -> None:
    """Today's fix (jobs._batches_first) gives a batch run's stats its reuse count. With
    `--mode batch --then online`, when the batches leave a line pending (here the provider's
    output lacks one line), the online part runs: run_job sets its own `_reuse` count (0: the
    copies were made before the batches) and `_after` adds the batch part's recorded lines,
    batches and tokens but not its reused ones: the summary says nothing was reused."""
    home = Home.at(tmp_path, None)
    ledger = Ledger(home.ledger_url)
    base = {"backend": "sim", "mode": "batch", "poll_interval": 0.02, "model": "sim-1"}
    model = SimModel(SimConfig(batch_seconds=0.05))

    def one_line_lost(m: str, p: str, n: int, r: httpx.Response) -> httpx.Response | None:
        if m == "GET" and p.endswith("/content") and b"choices" in r.content:
            kept = [x for x in r.content.splitlines() if b'"custom_id":"21"' not in x]
            return httpx.Response(200, content=b"\n".join(kept) + b"\n")
        return None

    stats = None
    for name, n, then in (("n1", 20, "none"), ("n2", 25, "online")):  # 20 unchanged, 5 new
        spec = resolve({**base, "then": then, "server_metrics": "off"})
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"prompt": f"prompt {i}"}) + "\n" for i in range(n)))
        jobs.create_job(ledger, name, path, spec)
        transport = SimTransport(model) if name == "n1" else Rewritten(model, one_line_lost)
        stats = await jobs.run_job(
            ledger,
            home,
            name,
            spec,
            transport=transport,
            settings=RunnerSettings(drain_timeout=0.0),
            handle_signals=False,
        )
    assert stats is not None
    counts = ledger.counts("n2")
    reused = ledger.item_stats("n2")["reused"]
    ledger.close()
    assert counts["done"] == 25 and reused == 20  # set up as meant
    assert stats.reused == 20, f"the run's stats say {stats.reused} reused, status says {reused}"


# --- 6. hosted: a completed batch whose output is gone -----------------------------------------


@pytest.mark.anyio
async def test_the_way_out_the_no_output_stop_names_gives_the_lines_up(tmp_path: Path) -> None:
    """A completed batch says its lines were answered, and its output file is no longer kept
    (404: OpenAI deletes files after their retention). hosted._collect now stops the run,
    lines kept batched, and says "`batchrun cancel JOB --forget` gives them up". But
    cancel_batches passes over every chunk whose state is in FINISHED (`completed`, noted by
    _look before _collect raised): --forget does nothing, and every resume stops the same way
    for ever; the job can never finish."""

    def output_gone(m: str, p: str, n: int, r: httpx.Response) -> httpx.Response | None:
        if m == "GET" and p.endswith("/content") and b"choices" in r.content:
            return httpx.Response(404, json={"error": {"message": "No such File object"}})
        return None

    ledger, home, spec = load(tmp_path, 6)
    model = sim()
    stats = await run(ledger, home, spec, Rewritten(model, output_gone))
    assert stats.aborted is not None and "--forget" in stats.aborted
    assert ledger.counts("j")["batched"] == 6
    await batch_mode.cancel_batches(
        ledger, "j", spec, forget=True, transport=Rewritten(model, output_gone)
    )
    counts = ledger.counts("j")
    again = await run(ledger, home, spec, Rewritten(model, output_gone))
    ledger.close()
    assert counts["batched"] == 0, (
        f"after `cancel --forget` {counts['batched']} lines are still batched; the next "
        f"resume says again: {again.aborted}"
    )


# --- 6. hosted: a batch-mode run joined as a worker --------------------------------------------


@pytest.mark.anyio
async def test_a_batch_run_that_joined_as_a_worker_stays_alive_while_it_polls(
    tmp_path: Path,
) -> None:
    """run_batches now joins the job as a worker (its options the job's, checked against
    other live workers'), but never beats: past its --lease, while its batches still run
    (they take hours at a provider), it counts as gone. `status` shows it dead, and another
    worker with other answer options (here a temperature) joins, unrefused, while its batch
    answers are still to be collected under the first options."""
    ledger, home, spec = load(tmp_path, 4, lease=1.0)
    model = sim(batch_seconds=3.0)
    seen: dict[str, Any] = {}

    async def other_worker() -> None:
        await anyio.sleep(2.0)  # the batch run is polling; its lease (1 s) has run out
        seen["live"] = len(ledger.live_workers("j", ttl=1.0))
        other = {**spec.to_json(), "temperature": 1.5}
        try:
            ledger.join("j", "online-worker", ttl=60.0, spec=other, same=ANSWER_FIELDS)
            seen["joined"] = True
            ledger.release("j", "online-worker")
        except Exception as exc:
            seen["joined"] = exc

    async with anyio.create_task_group() as tg:
        tg.start_soon(other_worker)
        stats = await run(ledger, home, spec, SimTransport(model))
    ledger.close()
    assert stats.aborted is None
    assert seen["live"] == 1 and seen["joined"] is not True, (
        f"while the batch run polled: {seen['live']} live workers; a worker with another "
        f"temperature joined: {seen['joined']}"
    )


@pytest.mark.anyio
async def test_a_batch_run_joins_in_the_pass_that_copies_answers_into_the_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two `--mode batch` runs with other options start at once. The batch run's reuse pass
    only checked the workers (jobs._batches_first), and joined later (run_batches): a second
    run whose pass came between the two was let in, and copied answers made its own way into
    the job that the first was batching. As online runs do, the batch run now joins in the
    transaction that copies, so the second is refused before it changes anything."""
    ledger, home, spec = load(tmp_path, 4)
    seen: dict[str, Any] = {}
    real = batch_mode.run_batches

    async def between(*args: Any, **kwargs: Any) -> Any:
        other = Joining({**reuse.joined(spec), "temperature": 1.5}, reuse.SAME, 60, worker="b")
        try:  # the other run's reuse pass, after this one's and before its join
            ledger.prepare_reuse("j", "b" * 64, reuse_since=None, joining=other)
            seen["other"] = "let in"
        except OptionError as exc:
            seen["other"] = exc
        return await real(*args, **kwargs)

    monkeypatch.setattr(batch_mode, "run_batches", between)
    stats = await run(ledger, home, spec, SimTransport(sim()))
    assert stats.aborted is None and ledger.counts("j")["done"] == 4
    assert isinstance(seen["other"], OptionError), seen["other"]
    assert len(ledger.live_workers("j", ttl=60.0)) == 0  # the batch run left when it ended
