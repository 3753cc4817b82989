"""The Python API against the in-process simulator, and the CLI in-process as its client."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import anyio
import orjson
import pytest
from click.testing import CliRunner

import batchrun
from batchrun import api
from batchrun.backends import CompletionRequest, OpenAICompatBackend
from batchrun.cli import main
from batchrun.errors import AuthFailed
from batchrun.sim import SimConfig, SimModel, SimTransport

SIM: dict[str, Any] = {"backend": "sim", "sim_options": {"ttft_ms": 0.0, "tpot_ms": 0.0}}


def rows(n: int) -> list[dict[str, Any]]:
    return [{"id": f"r{i}", "prompt": f"Say {i}.", "tag": i} for i in range(1, n + 1)]


def test_submit_rows_runs_them_and_results_come_back_typed_in_order(tmp_path: Path) -> None:
    report = batchrun.submit(rows(12), home=tmp_path, **SIM)
    assert report.complete and report.ok and report.loaded == 12
    assert report.counts["done"] == 12 and report.stats.requests == 12
    assert report.output is not None and len(report.output.read_bytes().splitlines()) == 12
    results = list(batchrun.results(report.job, home=tmp_path))
    assert [r.id for r in results] == [f"r{i}" for i in range(1, 13)]
    assert [r.line for r in results] == list(range(1, 13))
    assert all(isinstance(r, batchrun.Result) and r.status == "done" and r.output for r in results)
    assert [r.meta for r in results] == [{"tag": i} for i in range(1, 13)]
    # the results file says the same, line by line
    lines = [orjson.loads(x) for x in report.output.read_bytes().splitlines()]
    assert lines == [r.to_json() for r in results]


def test_the_same_rows_again_are_the_same_job_and_send_nothing(tmp_path: Path) -> None:
    first = batchrun.submit(rows(5), home=tmp_path, **SIM)
    said: list[str] = []
    again = batchrun.submit(rows(5), home=tmp_path, on_message=said.append, **SIM)
    assert again.job == first.job and again.loaded is None and again.stats.requests == 0
    assert again.complete and any("nothing left to do" in m for m in said)
    other = batchrun.submit(rows(6), home=tmp_path, **SIM)
    assert other.job != first.job  # other content: another job


def test_rows_under_a_taken_job_name_are_refused(tmp_path: Path) -> None:
    batchrun.submit(rows(3), job="nightly", home=tmp_path, **SIM)
    with pytest.raises(batchrun.UsageError, match="made from a different input"):
        batchrun.submit(rows(4), job="nightly", home=tmp_path, **SIM)


def test_load_without_running_then_resume_with_progress(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows(30)))
    loaded = batchrun.submit(path, home=tmp_path, run=False)  # no endpoint needed yet
    assert loaded.loaded == 30 and loaded.counts["pending"] == 30 and not loaded.complete
    assert batchrun.status("in", home=tmp_path)["counts"]["pending"] == 30
    updates: list[batchrun.ProgressUpdate] = []
    report = batchrun.resume("in", home=tmp_path, on_progress=updates.append, **SIM)
    assert report.ok and report.notes == ()
    assert updates[0].done == 0 and updates[-1].done == updates[-1].total == 30
    assert [u.done for u in updates] == sorted(u.done for u in updates)
    assert [job["job"] for job in batchrun.list_jobs(home=tmp_path)] == ["in"]


def test_export_writes_the_openai_batch_shape(tmp_path: Path) -> None:
    report = batchrun.submit(rows(3), job="j", home=tmp_path, **SIM)
    target = batchrun.export(report.job, fmt="openai", path=tmp_path / "b.jsonl", home=tmp_path)
    records = [orjson.loads(x) for x in target.read_bytes().splitlines()]
    assert [r["custom_id"] for r in records] == ["r1", "r2", "r3"]
    assert all(r["response"]["status_code"] == 200 for r in records)


def test_failed_items_are_retried_through_the_api(tmp_path: Path) -> None:
    flaky = {"ttft_ms": 0.0, "tpot_ms": 0.0, "fault_seed": 3, "faults": {"500": 0.5}}
    report = batchrun.submit(
        rows(20), job="j", home=tmp_path, backend="sim", max_attempts=1, sim_options=flaky
    )
    failed = report.counts["failed"]
    assert failed and not report.ok
    assert batchrun.retry("j", home=tmp_path) == failed
    again = batchrun.resume("j", home=tmp_path, max_attempts=5, **SIM)
    assert again.ok


def test_an_unknown_job_names_the_ones_there_are(tmp_path: Path) -> None:
    batchrun.submit(rows(2), job="known", home=tmp_path, **SIM)
    with pytest.raises(batchrun.UsageError, match="known"):
        batchrun.resume("nope", home=tmp_path)


@pytest.mark.anyio
async def test_the_async_twins_run_in_the_callers_event_loop(tmp_path: Path) -> None:
    report = await batchrun.submit_async(rows(4), job="a", home=tmp_path, run=False)
    assert report.counts["pending"] == 4
    done = await batchrun.resume_async("a", home=tmp_path, **SIM)
    assert done.ok


@pytest.mark.parametrize(
    "name", ["QWEN2_5_72B_API_KEY", "VLLM_KEY_20241205", "Azure_OpenAI_API_Key", "my_key"]
)
def test_an_unset_variable_name_of_words_is_a_name_where_a_key_is_optional(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    monkeypatch.delenv(name, raising=False)
    report = batchrun.submit(
        rows(1), home=tmp_path, backend="vllm", model="m", api_key_env=name, run=False
    )
    assert report.loaded == 1


def test_variable_names_of_any_case_are_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("MY_GROQ_API_KEY_FOR_NIGHTLY", "my_key", "OpenAIKeyForTheNightlyJob"):
        monkeypatch.setenv(name, "sk-test")  # a mixed-case long name is a name once it is set
        done = batchrun.submit(rows(1), home=tmp_path, api_key_env=name, **SIM)
        assert done.ok


# --- the CLI, in-process, as a client of the API ------------------------------------------------


def test_cli_submit_status_export_in_process(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows(8)))
    cli = CliRunner()
    home = ["--home", str(tmp_path)]
    ran = cli.invoke(main, [*home, "submit", str(path), "--backend", "sim", "--quiet"])
    assert ran.exit_code == 0, ran.output
    assert "job in: 8 done" in ran.stderr and "results:" in ran.stderr
    shown = cli.invoke(main, [*home, "status", "in", "--json"])
    assert shown.exit_code == 0 and json.loads(shown.stdout)["counts"]["done"] == 8
    wrote = cli.invoke(main, [*home, "export", "in", "--format", "openai"])
    assert wrote.exit_code == 0 and "wrote 8 lines" in wrote.stderr
    missing = cli.invoke(main, [*home, "resume", "nope"])
    assert missing.exit_code == 2 and "no job named 'nope'" in missing.stderr


def test_a_password_in_the_base_url_is_shown_nowhere(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows(2)))
    url = "http://bob:hunter2secret@127.0.0.1:1/v1"  # nothing listens: the models can't be listed
    cli = CliRunner()
    home = ["--home", str(tmp_path)]
    ran = cli.invoke(
        main, [*home, "submit", str(path), "--base-url", url, "--outage-timeout", "0.2"]
    )
    assert ran.exit_code == 3 and "cannot list models at http://***@127.0.0.1:1/v1" in ran.stderr
    said = [
        ran.output,
        cli.invoke(main, [*home, "status", "in"]).output,
        cli.invoke(main, [*home, "status", "in", "--json"]).output,
        cli.invoke(main, ["doctor", "--base-url", url, "--model", "m", "--timeout", "1"]).output,
        (tmp_path / "logs" / "in.log").read_text(),
    ]
    assert all("127.0.0.1:1" in text for text in said)
    assert not any("hunter2secret" in text for text in said)


# --- auth styles: a preset says how its key is sent --------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("auth", ["bearer", "x-api-key"])
async def test_each_auth_style_reaches_a_server_that_checks_the_key(auth: str) -> None:
    sim = SimTransport(SimModel(SimConfig(api_key="sk-test-123", ttft_ms=0, tpot_ms=0)))
    good = OpenAICompatBackend("http://sim/v1", api_key="sk-test-123", auth=auth, transport=sim)
    request = CompletionRequest(
        "chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    )
    assert (await good.complete(request)).text
    wrong = OpenAICompatBackend("http://sim/v1", api_key="sk-wrong", auth=auth, transport=sim)
    with pytest.raises(AuthFailed):
        await wrong.complete(request)
    none = OpenAICompatBackend("http://sim/v1", api_key="sk-test-123", auth="none", transport=sim)
    with pytest.raises(AuthFailed):
        await none.complete(request)


def test_option_errors_name_the_key_in_python_and_the_flag_on_the_command_line(
    tmp_path: Path,
) -> None:
    with pytest.raises(batchrun.UsageError, match=r"^max_attempts must be at least 1$"):
        batchrun.submit(rows(2), home=tmp_path, backend="sim", max_attempts=0)
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"prompt": "p"}) + "\n")
    said = CliRunner().invoke(
        main,
        ["--home", str(tmp_path), "submit", str(path), "--backend", "sim", "--concurrency", "0"],
    )
    assert said.exit_code == 2 and "error: --concurrency must be at least 1" in said.stderr


# --- what a hostile review found ---------------------------------------------------------------


def test_a_failed_rows_submit_does_not_block_its_job_name(tmp_path: Path) -> None:
    with pytest.raises(batchrun.InputError):
        batchrun.submit([{"nope": 1}], job="n", home=tmp_path, **SIM)
    assert batchrun.submit([{"prompt": "ok"}], job="n", home=tmp_path, **SIM).ok
    assert not list((tmp_path / "inputs").glob("*.tmp"))


def test_the_same_rows_asked_another_way_are_another_job(tmp_path: Path) -> None:
    first = batchrun.submit(rows(3), home=tmp_path, **SIM)
    other = batchrun.submit(rows(3), home=tmp_path, temperature=1.5, **SIM)
    assert other.job != first.job and other.stats.requests == 3


def test_the_same_rows_asked_with_an_edited_schema_file_are_another_job(tmp_path: Path) -> None:
    def needs(field: str) -> str:
        properties = {field: {"type": "integer"}}
        return json.dumps({"type": "object", "properties": properties, "required": [field]})

    path = tmp_path / "schema.json"
    path.write_text(needs("a"))
    first = batchrun.submit(rows(3), home=tmp_path, schema=str(path), **SIM)
    path.write_text(needs("b"))  # the answers must have "b" now
    again = batchrun.submit(rows(3), home=tmp_path, schema=str(path), **SIM)
    assert again.job != first.job and again.stats.requests == 3
    answers = [json.loads(r.output or "") for r in batchrun.results(again.job, home=tmp_path)]
    assert all("b" in answer for answer in answers)


def test_the_same_rows_asked_of_another_endpoints_model_are_another_job(tmp_path: Path) -> None:
    sim = SIM["sim_options"]
    alpha = ["a=http://sim.invalid/v1,backend=sim,model=alpha"]
    beta = ["a=http://sim.invalid/v1,backend=sim,model=beta"]
    first = batchrun.submit(rows(3), home=tmp_path, endpoints=alpha, sim_options=sim)
    other = batchrun.submit(rows(3), home=tmp_path, endpoints=beta, sim_options=sim)
    assert other.job != first.job and other.stats.requests == 3
    again = batchrun.submit(rows(3), home=tmp_path, endpoints=beta, sim_options=sim)
    assert again.job == other.job and again.stats.requests == 0


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ([{"prompt": "a"}, 5], "row 2 is int, not a dict"),
        ({"prompt": "a"}, "iterable of dicts"),
        ([{"prompt": object()}], "row 1 cannot be written as JSON"),
    ],
)
def test_rows_that_are_not_dicts_are_refused_by_row(
    tmp_path: Path, source: Any, message: str
) -> None:
    with pytest.raises(batchrun.UsageError, match=message):
        batchrun.submit(source, home=tmp_path, **SIM)
    assert not list((tmp_path / "inputs").glob("*.tmp"))


@pytest.mark.parametrize(
    ("secret", "backend"),
    [
        ("sk-proj-abcdefghijklmnop1234567890", "vllm"),
        ("gsk_Ab3dEfGh1jKlMn0pQrStUvWxYz9876543210ABCDefghijkl", "groq"),  # a valid name
        ("gsk_Ab3dEfGh1jKlMn0pQrStUvWxYz9876543210ABCDefghijkl", "vllm"),  # key optional
    ],
)
def test_a_key_pasted_as_its_variable_name_is_refused_and_not_echoed(
    tmp_path: Path, secret: str, backend: str
) -> None:
    with pytest.raises(batchrun.UsageError) as info:
        batchrun.submit(rows(1), home=tmp_path, backend=backend, api_key_env=secret)
    assert "NAME of an environment variable" in str(info.value) or "looks like a key" in str(
        info.value
    )
    assert secret[8:16] not in str(info.value)
    assert not (tmp_path / "jobs" / "ledger.db").exists() or secret not in (
        tmp_path / "jobs" / "ledger.db"
    ).read_bytes().decode("latin-1")


def test_out_of_range_options_are_refused_in_python_too(tmp_path: Path) -> None:
    for option, value in [("max_tokens", 0), ("outage_timeout", -1.0), ("max_line_bytes", 0)]:
        with pytest.raises(batchrun.UsageError, match=f"{option} must be"):
            batchrun.submit(rows(1), home=tmp_path, **{**SIM, option: value})


def test_a_value_with_braces_is_shown_as_given() -> None:
    from batchrun.cli_errors import flag
    from batchrun.config import resolve
    from batchrun.errors import OptionError

    with pytest.raises(OptionError) as info:
        resolve({"backend": "sim", "server_metrics": "/data/{run_id}/m"})
    assert "'/data/{run_id}/m'" in str(info.value)
    assert info.value.naming(flag).startswith("--server-metrics must be")
    assert "'/data/{run_id}/m'" in info.value.naming(flag)


def test_verbs_that_read_refuse_a_home_without_a_ledger(tmp_path: Path) -> None:
    with pytest.raises(batchrun.UsageError, match="no ledger at"):
        batchrun.list_jobs(home=tmp_path / "typo")
    assert not (tmp_path / "typo").exists()
    batchrun.submit(rows(1), job="j", home=tmp_path, **SIM)
    with pytest.raises(batchrun.UsageError, match="no job named 'nope'"):
        batchrun.results("nope", home=tmp_path)  # at once, not at the first next()
    with pytest.raises(batchrun.UsageError, match="unknown format 'csv'"):
        batchrun.export("j", fmt="csv", home=tmp_path)


def test_a_callbacks_error_reaches_the_caller_as_raised(tmp_path: Path) -> None:
    def broken(update: batchrun.ProgressUpdate) -> None:
        if update.done:
            raise KeyError("from the callback")

    with pytest.raises(KeyError, match="from the callback"):
        batchrun.submit(rows(5), job="cb", home=tmp_path, on_progress=broken, **SIM)
    assert batchrun.resume("cb", home=tmp_path, **SIM).ok  # nothing lost: the rest goes


def test_sync_verbs_inside_a_running_loop_point_to_the_async_ones(tmp_path: Path) -> None:
    async def inside() -> None:
        batchrun.submit(rows(1), home=tmp_path, **SIM)

    with pytest.raises(batchrun.UsageError, match="submit_async"):
        anyio.run(inside)


def test_ctrl_c_stops_gracefully_then_reaches_the_caller(tmp_path: Path) -> None:
    sent = []

    def interrupt(update: batchrun.ProgressUpdate) -> None:
        if update.done and not sent:
            sent.append(update.done)
            os.kill(os.getpid(), signal.SIGINT)

    mine = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        batchrun.submit(rows(40), job="c", home=tmp_path, on_progress=interrupt, **SIM)
    assert signal.getsignal(signal.SIGTERM) is mine  # handlers put back
    standing = batchrun.status("c", home=tmp_path)["counts"]
    assert standing["done"] >= sent[0] and standing["running"] == 0  # committed, released
    assert batchrun.resume("c", home=tmp_path, **SIM).ok


def test_an_openai_export_goes_beside_the_results_file_not_over_it(tmp_path: Path) -> None:
    batchrun.submit(rows(2), job="j.openai", home=tmp_path, **SIM)  # a name that could clash
    theirs = (tmp_path / "outputs" / "j.openai.jsonl").read_bytes()
    report = batchrun.submit(rows(3), job="j", home=tmp_path, **SIM)
    assert report.output is not None
    before = report.output.read_bytes()
    written = batchrun.export("j", fmt="openai", home=tmp_path)
    assert written == tmp_path / "outputs" / "openai" / "j.jsonl"
    assert report.output.read_bytes() == before
    assert (tmp_path / "outputs" / "j.openai.jsonl").read_bytes() == theirs
    assert [json.loads(line)["custom_id"] for line in written.read_text().splitlines()] == [
        "r1",
        "r2",
        "r3",
    ]


@pytest.mark.parametrize(
    ("options", "said"),
    [
        pytest.param({"backend": "sim", "sim_options": {"api_key": "sk-other"}}, "401", id="key"),
        pytest.param(
            {"backend": "sim", "model": "nope", "sim_options": {"strict_models": True}},
            "nope",
            id="model",
        ),
        pytest.param(
            {"base_url": "http://127.0.0.1:1/v1", "model": "m", "outage_timeout": 0.3},
            "unreachable",
            id="down",
        ),
    ],
)
def test_a_job_the_endpoint_stops_raises_with_its_report(
    tmp_path: Path, options: dict[str, Any], said: str
) -> None:
    # a pipeline that never looks at `ok` must not carry on as if the job had run
    with pytest.raises(batchrun.JobAborted, match=said) as stop:
        batchrun.submit(rows(3), job="f", home=tmp_path, **options)
    assert isinstance(stop.value, batchrun.FatalError)
    report = stop.value.report
    assert report.job == "f" and report.counts["pending"] == 3 and not report.ok
    assert "3 item(s) left" in str(stop.value)
    with pytest.raises(batchrun.JobAborted):
        batchrun.resume("f", home=tmp_path)


def test_the_sync_verbs_say_what_to_do_inside_a_running_loop_or_with_handle_signals(
    tmp_path: Path,
) -> None:
    batchrun.submit(rows(1), job="j", home=tmp_path, **SIM)
    with pytest.raises(batchrun.UsageError, match="handle_signals is for the async verbs"):
        batchrun.submit(rows(1), job="j", home=tmp_path, handle_signals=True, **SIM)

    async def inside() -> None:
        batchrun.cancel("j", home=tmp_path)

    with pytest.raises(batchrun.UsageError, match="inside a running event loop"):
        anyio.run(inside)


@pytest.mark.anyio
async def test_cancelling_an_async_submit_keeps_the_answers_it_already_has(
    tmp_path: Path,
) -> None:
    slow = {"backend": "sim", "sim_options": {"ttft_ms": 20.0, "tpot_ms": 0.0}}
    committed = anyio.Event()

    def heard(update: batchrun.ProgressUpdate) -> None:
        if update.done:
            committed.set()

    async with anyio.create_task_group() as tg:

        async def cancel_between_commits() -> None:
            await committed.wait()  # a group was just committed
            await anyio.sleep(0.12)  # more answers came, not committed yet
            tg.cancel_scope.cancel()  # a notebook's stop, asyncio.wait_for...

        tg.start_soon(cancel_between_commits)
        await batchrun.submit_async(
            rows(100), job="c", home=tmp_path, concurrency=1, on_progress=heard, **slow
        )
    counts = batchrun.status("c", home=tmp_path)["counts"]
    assert counts["running"] == 0  # the leases are given back
    log = (tmp_path / "logs" / "c.log").read_text().splitlines()
    stopped = next(json.loads(line) for line in log if '"run_stopped"' in line)
    # one request at a time: only the one in flight may go unanswered
    assert stopped["requests"] - stopped["recorded"] <= 1, stopped
    assert counts["done"] >= stopped["requests"] - 1


@pytest.mark.parametrize(
    ("call", "said"),
    [
        (lambda home: batchrun.submit(rows(1), job=123, home=home, **SIM), "job must be a string"),
        (lambda home: batchrun.submit(5, home=home, **SIM), "source must be a JSONL path"),
        (lambda home: batchrun.submit(rows(1), home=home / "f", **SIM), "is a file, not a folder"),
        (lambda home: batchrun.list_jobs(home=home / "f"), "is a file, not a folder"),
    ],
    ids=["job", "source", "home", "home-read"],
)
def test_arguments_of_the_wrong_kind_are_usage_errors_naming_them(
    tmp_path: Path, call: Any, said: str
) -> None:
    (tmp_path / "f").write_text("a file, not a folder")
    with pytest.raises(batchrun.UsageError, match=said):
        call(tmp_path)


@pytest.mark.parametrize("handler", ["python's", "a flag", "ignored"])
def test_a_ctrl_c_that_came_before_an_abort_reaches_the_caller_first(
    monkeypatch: pytest.MonkeyPatch, handler: str
) -> None:
    # stopped by Ctrl-C, then aborted while draining: the caller's handler hears the signal,
    # as from any stopped sync run; if it goes on, the abort is still raised
    stats = batchrun.JobReport("j", {"pending": 1}, False, None).stats
    stats.aborted, stats.stopped_by = "HTTP 401", signal.SIGINT
    stopped = batchrun.JobAborted(batchrun.JobReport("j", {"pending": 1}, False, None, stats=stats))

    def aborted(call: Any, options: Any) -> batchrun.JobReport:
        raise stopped

    monkeypatch.setattr(api, "in_new_loop", aborted)
    heard: list[int] = []
    handlers = {"a flag": lambda signum, _frame: heard.append(signum), "ignored": signal.SIG_IGN}
    old = signal.signal(signal.SIGINT, handlers.get(handler, signal.default_int_handler))
    try:
        with pytest.raises(KeyboardInterrupt if handler == "python's" else batchrun.JobAborted):
            batchrun.submit(rows(1), job="j")
    finally:
        signal.signal(signal.SIGINT, old)
    assert heard == ([signal.SIGINT] if handler == "a flag" else [])


def test_progress_counts_every_failed_line_a_repeated_request_fails(tmp_path: Path) -> None:
    # 10 requests, each on 3 lines: one request each is sent, and a failure of it is the failure
    # of its 3 lines. The progress counted one failed line for each.
    repeated = [{"id": f"r{i}", "prompt": f"Say {i % 10}."} for i in range(30)]
    flaky = {"ttft_ms": 0.0, "tpot_ms": 0.0, "fault_seed": 3, "faults": {"500": 0.5}}
    updates: list[batchrun.ProgressUpdate] = []
    report = batchrun.submit(
        repeated,
        job="j",
        home=tmp_path,
        backend="sim",
        max_attempts=1,
        sim_options=flaky,
        on_progress=updates.append,
    )
    failed = report.counts["failed"]
    assert failed and failed % 3 == 0
    assert (updates[-1].done, updates[-1].failed) == (30, failed)


def test_lines_answered_under_an_earlier_model_say_so_in_the_results(tmp_path: Path) -> None:
    # A resume under another --model: the results file mixed both models' answers without a
    # word (the OpenAI format named each; the native one, what a pipeline reads, did not).
    flaky = {"ttft_ms": 0.0, "tpot_ms": 0.0, "fault_seed": 3, "faults": {"500": 0.5}}
    first = batchrun.submit(
        rows(20),
        job="j",
        home=tmp_path,
        backend="sim",
        model="m1",
        max_attempts=1,
        sim_options=flaky,
    )
    assert first.counts["failed"] and first.counts["done"]
    batchrun.retry("j", home=tmp_path)
    assert batchrun.resume("j", home=tmp_path, model="m2", **SIM).ok
    lines = [orjson.loads(x) for x in (tmp_path / "outputs" / "j.jsonl").read_bytes().splitlines()]
    models = [line.get("model") for line in lines]
    assert models.count("m1") == first.counts["done"]
    assert models.count(None) == first.counts["failed"]  # the job's own model: not repeated
    assert [r.model for r in batchrun.results("j", home=tmp_path)] == models
