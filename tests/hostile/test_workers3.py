"""One job run by several workers at once, attacked (review "workers3"): a worker woken after
its lease ran out, workers joining with other options, summaries and exit codes of workers,
budgets shared between workers, the results file. Each test fails on the code as reviewed and
names the defect it shows."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from batchrun import reuse
from batchrun.config import resolve
from batchrun.errors import OptionError
from batchrun.jobs import Home, create_job
from batchrun.ledger import Ledger
from tests.integration.conftest import cli, sim_server
from tests.integration.helpers import CLI, sim_stats, write_prompts

__all__ = ["cli", "sim_server"]  # the fixtures, shared with tests/integration

pytestmark = pytest.mark.integration

SLOW = ("--ttft-ms", "30", "--tpot-ms", "1")


def _loaded(cli: CLI, tmp_path: Path, job: str, items: int, *extra: str) -> None:
    inp = tmp_path / f"{job}.jsonl"
    write_prompts(inp, items)
    done = cli.run("submit", str(inp), "--no-run", "--quiet", *extra)
    assert done.returncode == 0, done.stderr


def _wait(proc: subprocess.Popen[str], timeout: float = 60) -> tuple[int, str]:
    try:
        _out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _out, err = proc.communicate()
        raise AssertionError(f"worker hung: {err}") from None
    return proc.returncode, err


def test_a_worker_woken_after_its_lease_sends_nothing_for_items_it_no_longer_holds(
    cli: CLI, sim_server: Callable[..., str], tmp_path: Path
) -> None:
    """README: a worker that stalls past its lease "loses its items to the live ones and commits
    nothing for them when it wakes". It commits nothing, but it still SENDS them: the items it
    had claimed and not yet sent (a worker leases at least 32, here 31 beyond its one request
    in flight) are requested again when it wakes, after the live worker has already paid for
    them. Only what was in flight at the freeze may be paid twice."""
    url = sim_server(*SLOW)
    _loaded(cli, tmp_path, "woken", 80)
    run = ("resume", "woken", "--base-url", url, "--concurrency", "1", "--lease", "2", "-q")
    frozen = cli.start(*run)
    try:
        cli.wait_for("woken", 3, frozen)
        frozen.send_signal(signal.SIGSTOP)  # mid-run: one request in flight, ~31 queued
        held = cli.counts("woken").get("running", 0)
        assert held > 1, held
        live = cli.run(*run)  # reclaims the frozen worker's items once its lease ran out
        assert live.returncode == 0, live.stderr
        assert cli.counts("woken") == {"done": 80}
        before = sim_stats(url)
    finally:
        frozen.send_signal(signal.SIGCONT)
    code, err = _wait(frozen)
    assert code == 0, err
    after = sim_stats(url)
    sent_after_waking = after["requests"] - before["requests"]
    assert sent_after_waking <= 1, (
        f"the woken worker sent {sent_after_waking} requests for items the live worker had "
        f"already answered (paid twice); it held {held} items, one in flight"
    )


def test_a_worker_with_the_in_process_simulator_is_not_let_into_a_real_servers_job(
    tmp_path: Path,
) -> None:
    """README "Workers must ask for the same answers": a worker asking for other answers is
    refused while others run the job ("or, with --backend sim, other simulator options"). A
    `resume --backend sim` (synthetic answers, which reuse never takes for a real server's:
    reuse.answer_spec marks them `simulated`) joins a job a real server is answering, with the
    same model name: the check compares `sim_options`, which are the same (the defaults) for
    both, never whether the answers are simulated. Its made-up answers land in the job's
    results beside the real ones."""
    home = Home.at(tmp_path, None)
    led = Ledger(home.ledger_url)
    inp = tmp_path / "in.jsonl"
    write_prompts(inp, 4)
    real = resolve({"base_url": "http://127.0.0.1:9/v1", "model": "m"})
    simulated = resolve({"backend": "sim", "model": "m"})
    assert reuse.answer_spec(real) != reuse.answer_spec(simulated)  # other answers, by reuse
    create_job(led, "j", inp, real)
    led.join("j", "real-worker", ttl=60, spec=reuse.joined(real), same=reuse.SAME)
    try:
        with pytest.raises(OptionError):
            led.join("j", "sim-worker", ttl=60, spec=reuse.joined(simulated), same=reuse.SAME)
    finally:
        led.close()


def _answer_specs(cli: CLI, job: str) -> dict[str, int]:
    db = cli.home / "jobs" / "ledger.db"
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        rows = conn.execute(
            "SELECT answer_spec, count(*) FROM items WHERE job = ? AND status = 'done' "
            "GROUP BY answer_spec",
            (job,),
        ).fetchall()
    finally:
        conn.close()
    return dict(rows)


def test_a_worker_woken_after_another_took_the_job_over_with_other_options_does_not_mix_answers(
    cli: CLI, sim_server: Callable[..., str], tmp_path: Path
) -> None:
    """README: a worker asking for other answers (another --model) "cannot join a running job".
    Worker A runs with --model sim-1 and is frozen past its lease; B then joins with --model
    sim-2: A counts as gone, so B is let in (right: "alone on the job, a worker's options
    become the job's") and the job's spec says sim-2. But A, woken, "carries on with new
    claims" under its own --model sim-1 beside B, unchecked: two live workers asking for other
    answers, the very thing the join check refuses, and the job's lines answered by both
    models at once, interleaved, while its spec names one."""
    url = sim_server(*SLOW)
    _loaded(cli, tmp_path, "mixed", 300)
    base = ("resume", "mixed", "--base-url", url, "--lease", "2", "-q")
    first = cli.start(*base, "--model", "sim-1", "--concurrency", "2")
    second: subprocess.Popen[str] | None = None
    try:
        cli.wait_for("mixed", 10, first)
        first.send_signal(signal.SIGSTOP)
        time.sleep(3.0)  # past its 2 s lease: it counts as gone
        (first_model, before), *others = _answer_specs(cli, "mixed").items()
        assert not others
        second = cli.start(*base, "--model", "sim-2", "--concurrency", "1")
        done = cli.counts("mixed").get("done", 0)
        cli.wait_for("mixed", done + 10, second)  # the second one runs the job now
    finally:
        first.send_signal(signal.SIGCONT)
    code_first, err_first = _wait(first, 120)
    assert second is not None
    _code_second, err_second = _wait(second, 120)
    assert cli.counts("mixed") == {"done": 300}, (err_first, err_second)
    specs = _answer_specs(cli, "mixed")
    after = specs[first_model]
    assert after == before, (
        f"{after - before} answers of --model sim-1 committed after a worker with --model "
        f"sim-2 took the job over ({before} before it joined): {specs}; woken worker: exit "
        f"{code_first} {err_first.strip()[-300:]}"
    )


def test_a_worker_whose_endpoint_names_another_model_is_not_let_into_a_running_job(
    tmp_path: Path,
) -> None:
    """README: while other workers run a job, one that joins with another --model is refused
    (exit 2, naming the option). With --endpoint NAME=URL,model=M (the README's way of naming
    an endpoint's model, "model defaults to --model") the check sees no model at all: the
    job's spec keeps `model` unset and the endpoints are not compared, so a worker asking
    gpu0 for sim-2 joins workers asking the same gpu0 for sim-1, and the job's lines are
    answered by both models at once."""
    home = Home.at(tmp_path, None)
    led = Ledger(home.ledger_url)
    inp = tmp_path / "in.jsonl"
    write_prompts(inp, 4)
    first = resolve({"endpoints": ["gpu0=http://127.0.0.1:9/v1,model=sim-1"]})
    second = resolve({"endpoints": ["gpu0=http://127.0.0.1:9/v1,model=sim-2"]})
    create_job(led, "j", inp, first)
    led.join("j", "w-sim-1", ttl=60, spec=reuse.joined(first), same=reuse.SAME)
    try:
        with pytest.raises(OptionError):
            led.join("j", "w-sim-2", ttl=60, spec=reuse.joined(second), same=reuse.SAME)
    finally:
        led.close()


def test_the_summary_of_a_worker_that_ran_beside_another_counts_both(tmp_path: Path) -> None:
    """README: "the summary line says how many workers took part". A worker counts only those
    whose heartbeat is at or after its own start (api._run): another worker that joined a
    moment before it (and beats every 20 s, or leaves only after it) is not counted, though it
    committed half the job while this one ran. Here worker A joins, then B runs; A commits its
    items during B's run and is still running when B ends: B's summary says it was alone (no
    "2 workers"; seen with three `resume`s started together too: the first to stop said so)."""
    import threading

    from batchrun import api
    from batchrun.ledger import ItemResult

    home = Home.at(tmp_path, None)
    led = Ledger(home.ledger_url)
    inp = tmp_path / "in.jsonl"
    write_prompts(inp, 6)
    spec = resolve({"backend": "sim", "model": "sim-1", "concurrency": 2})
    create_job(led, "j", inp, spec)
    led.join("j", "worker-a", ttl=60, spec=reuse.joined(spec), same=reuse.SAME)
    held = led.claim("j", "worker-a", 3, lease_ttl=60)
    assert len(held) == 3

    def worker_a() -> None:  # commits its items once B runs beside it
        deadline = time.monotonic() + 30
        while len(led.workers("j")) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        answers = [ItemResult(c.line, "done", 1, output="a", prompt_tokens=3) for c in held]
        led.record("j", "worker-a", answers)

    a = threading.Thread(target=worker_a)
    a.start()
    try:
        report = api.resume("j", home=tmp_path, backend="sim", model="sim-1", concurrency=2)
    finally:
        a.join(timeout=30)
        led.close()
    assert report.counts["done"] == 6
    assert report.stats.recorded == 3  # B did the other half
    assert report.workers == 2, f"B ran beside A, which did half the job; it says {report.workers}"
